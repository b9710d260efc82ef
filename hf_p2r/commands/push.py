"""`hf-p2r push DIR REPO_ID`: publish a checkpoint folder to the Hugging Face Hub; see `hf_p2r.push_to_hub`.

Create the repository if needed, render the model card and upload the folder in one commit. Only files within DIR are
uploaded (a Hugging Face cache snapshot's links into its blobs included): links out of it, FIFOs and devices are
skipped, and named. REPO_ID and --revision are checked before anything is read or sent. The token comes from HF_TOKEN or
`hf auth login`; it is never printed.
"""

import argparse

from . import add_command

HELP = "publish a checkpoint folder to the Hugging Face Hub (with a model card)"
DESCRIPTION = (__doc__ or "").rsplit("\n\n", 1)[-1]  # `--help` shows this docstring's last paragraph


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "push", HELP, DESCRIPTION, run)
    parser.add_argument("folder", metavar="DIR", help="checkpoint folder to upload")
    parser.add_argument("repo_id", metavar="REPO_ID", help="e.g. user/model-name")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--revision", help="branch to push to, created if needed (default: main)")
    parser.add_argument("--commit-message", help="commit message (default: 'Upload <folder name> with hf-p2r')")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="list the files (and what is skipped) and print the model card; no network access",
    )


def run(args: argparse.Namespace) -> int:
    import logging
    import sys

    import httpx2  # huggingface_hub's HTTP client: its errors are not OSError
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError

    from ..errors import redact
    from ..hub import logger, push_to_hub

    # push_to_hub's warnings (what it skipped) are one line each on stderr.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("hf-p2r push: warning: %(message)s"))
    logger.addHandler(handler)
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
        raise OSError(redact(f"{constants.ENDPOINT}: {error}")) from None
    except httpx2.HTTPError as error:  # no answer: refused, unreachable, timed out, TLS...
        raise ConnectionError(redact(f"cannot reach {constants.ENDPOINT}: {error}")) from None
    finally:
        logger.removeHandler(handler)
    print(result)
    return 0
