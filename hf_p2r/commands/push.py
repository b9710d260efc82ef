"""`hf-p2r push DIR REPO_ID`: publish a checkpoint folder to the Hugging Face Hub; see `hf_p2r.push_to_hub`."""

import argparse

HELP = "publish a checkpoint folder to the Hugging Face Hub (with a model card)"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "push",
        help=HELP,
        description="Create the repository if needed, render the model card and upload the folder. The token comes "
        "from HF_TOKEN or `hf auth login`; it is never printed.",
    )
    parser.add_argument("folder", metavar="DIR", help="checkpoint folder to upload")
    parser.add_argument("repo_id", metavar="REPO_ID", help="e.g. user/model-name")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--revision", help="branch to push to (default: main)")
    parser.add_argument("--commit-message", help="commit message (default: 'Upload <folder name> with hf-p2r')")
    parser.add_argument(
        "--dry-run", action="store_true", help="list the files and print the model card; no network access"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import httpx2  # huggingface_hub's HTTP client: its errors are not OSError
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import HfHubHTTPError

    from ..hub import push_to_hub

    try:
        result = push_to_hub(
            args.folder,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            commit_message=args.commit_message,
            dry_run=args.dry_run,
        )
    except HfHubHTTPError as error:  # the Hub answered with an error (401, 403, 404...): an OSError, one line
        raise OSError(_without_token(f"{constants.ENDPOINT}: {error}", get_token())) from None
    except httpx2.HTTPError as error:  # no answer: refused, unreachable, timed out, TLS...
        raise ConnectionError(_without_token(f"cannot reach {constants.ENDPOINT}: {error}", get_token())) from None
    print(result)
    return 0


def _without_token(message: str, token: str | None) -> str:
    """Messages never carry the token; this makes sure of it."""
    return message.replace(token, "***") if token else message
