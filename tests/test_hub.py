"""push_to_hub and model cards, offline: the Hub is intercepted at the HfApi boundary only."""

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest
from huggingface_hub import CommitInfo, HfApi, ModelCard, constants
from huggingface_hub.errors import HfHubHTTPError
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_p2r import convert_pseudo_to_real, export_llama, push_to_hub
from hf_p2r.checkpoint.card import render_model_card
from hf_p2r.cli import main
from hf_p2r.errors import InputError
from hf_p2r.hub import check_branch

from .conftest import tiny_model

TOKEN = "hf_NotARealTokenButSecretAnyway0123456789"


@pytest.fixture
def hub(monkeypatch):
    """Replace HfApi's network methods; record what each would have sent (and with which token)."""
    calls = []

    def record(method):
        def fake(self, *args, **kwargs):
            calls.append((method, self.token, args, kwargs))
            if method == "create_commit":
                return CommitInfo(
                    commit_url=f"https://huggingface.co/{args[0]}/commit/abc",
                    commit_message="m",
                    commit_description="",
                    oid="abc",
                )

        return fake

    for method in ("create_repo", "create_branch", "create_commit", "upload_folder"):
        monkeypatch.setattr(HfApi, method, record(method))
    return calls


@pytest.fixture
def converted(tmp_path):
    tiny_model(share_layers=True, num_unique_layers=2).save_pretrained(tmp_path / "pseudo")
    return convert_pseudo_to_real(tmp_path / "pseudo", tmp_path / "real-8")


def _uploaded(calls):
    """{path in repo: bytes} of the single commit that was sent."""
    ((_, _, args, kwargs),) = [call for call in calls if call[0] == "create_commit"]
    operations = kwargs.get("operations", args[1] if len(args) > 1 else None)
    files = {}
    for op in operations:
        source = op.path_or_fileobj
        files[op.path_in_repo] = source if isinstance(source, bytes) else open(source, "rb").read()
    return files


def test_card_metadata_and_content(tmp_path):
    tiny_model(seed=1).save_pretrained(tmp_path / "real")
    card = render_model_card(tmp_path / "real", model_id="me/real")
    data = card.data.to_dict()
    assert data == {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["pseudo-to-real", "p2r"],
    }
    text = str(card)
    assert "# me/real" in text and "| Layers | 8 |" in text and "8 (real: one per layer)" in text
    assert "import hf_p2r" in text and 'AutoModelForCausalLM.from_pretrained("me/real")' in text
    assert "trust_remote_code" not in text and "## Provenance" not in text


def test_card_tags_custom_code_only_for_remote_code_folders(tmp_path):
    model = tiny_model(share_layers=True, num_unique_layers=2)
    model.save_pretrained(tmp_path / "remote", remote_code=True)
    export_llama(tiny_model(), tmp_path / "llama")
    remote = render_model_card(tmp_path / "remote", model_id="me/remote")
    assert remote.data.tags == ["pseudo-to-real", "p2r", "custom_code"]
    assert 'from_pretrained("me/remote", trust_remote_code=True)' in str(remote) and "import hf_p2r" not in str(remote)
    assert "pass `share_layers=False`" in str(remote), "a pseudo checkpoint says how to load it delinked"
    llama = render_model_card(tmp_path / "llama")
    assert llama.data.tags == ["pseudo-to-real", "llama"] and "import hf_p2r" not in str(llama)


def test_cards_of_moe_checkpoints_say_what_loads_them(tmp_path):
    from hf_p2r.checkpoint.mixtral import export_mixtral

    from .models.test_modeling_p2r_moe import moe_model

    moe_model(share_layers=True, num_unique_layers=2).save_pretrained(tmp_path / "pseudo")
    export_mixtral(moe_model(), tmp_path / "mixtral")
    pseudo, mixtral = render_model_card(tmp_path / "pseudo"), render_model_card(tmp_path / "mixtral")
    assert pseudo.data.tags == ["pseudo-to-real", "p2r_moe"] and mixtral.data.tags == ["pseudo-to-real", "mixtral"]
    assert "mixture-of-experts decoder whose 8 layers share 2 block(s)" in str(pseudo)
    assert "import hf_p2r" in str(pseudo) and "without hf-p2r" not in str(pseudo)
    assert "import hf_p2r" not in str(mixtral) and "it loads in transformers without hf-p2r" in str(mixtral)
    for card in (pseudo, mixtral):
        assert "Weight names are Mixtral's." in str(card) and "| Experts | 4 x FFN 48, top-2 per token |" in str(card)
    tiny_model().save_pretrained(tmp_path / "dense")
    dense = str(render_model_card(tmp_path / "dense"))
    assert "Weight names are Llama's." in dense and "| Experts |" not in dense


def test_dry_run_lists_files_and_card_without_network(converted, hub, capsys):
    (converted / ".cache").mkdir()
    (converted / ".cache" / "lock").write_text("")
    assert main(["push", str(converted), "me/real-8", "--private", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert hub == [], "no HfApi call"
    assert "private model repo me/real-8" in out
    listing = out[: out.index("\n\n")].splitlines()[1:]
    listed = [line.split()[0] for line in listing]
    assert listed == ["config.json", "generation_config.json", "model.safetensors", "README.md"]
    card = out[out.index("---") :]
    assert card.strip() == str(render_model_card(converted, model_id="me/real-8", provenance=_provenance(converted)))


def _provenance(folder):
    return ModelCard.load(folder / "README.md").data.to_dict()["hf_p2r"]


def test_push_sends_the_folder_and_card_in_one_commit(converted, hub):
    url = push_to_hub(converted, "me/real-8", private=True, revision="v1", token=TOKEN)
    assert url == "https://huggingface.co/me/real-8/commit/abc"
    assert [call[0] for call in hub] == ["create_repo", "create_branch", "create_commit"]
    (_, _, repo_args, repo_kwargs), (_, _, _, branch_kwargs), (_, _, _, commit_kwargs) = hub
    assert repo_args == ("me/real-8",) and repo_kwargs["private"] is True and repo_kwargs["exist_ok"] is True
    assert branch_kwargs["branch"] == "v1" and commit_kwargs["revision"] == "v1"
    files = _uploaded(hub)
    on_disk = {p.name: p.read_bytes() for p in converted.iterdir() if p.name != "README.md"}
    assert {k: v for k, v in files.items() if k != "README.md"} == on_disk, "exactly the folder's files"
    card = files["README.md"].decode()
    assert card == str(render_model_card(converted, model_id="me/real-8", provenance=_provenance(converted)))
    assert "source_num_unique_layers: 2" in card and 'from_pretrained("me/real-8")' in card
    assert (converted / "README.md").read_text() != card, "the folder itself is not modified"


def test_public_push_leaves_visibility_to_the_hub(converted, hub):
    push_to_hub(converted, "me/real-8")
    (_, _, _, repo_kwargs), (name, _, _, commit_kwargs) = hub
    assert repo_kwargs["private"] is None and name == "create_commit" and commit_kwargs["revision"] is None


def test_token_is_used_but_never_printed_or_logged(converted, hub, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    push_to_hub(converted, "me/real-8", token=TOKEN)
    print(push_to_hub(converted, "me/real-8", token=TOKEN, dry_run=True))
    assert {token for _, token, _, _ in hub} == {TOKEN}, "the control: the token did reach the API"
    captured = capsys.readouterr()
    assert TOKEN not in captured.out + captured.err + caplog.text


def test_edited_or_foreign_cards_are_uploaded_unchanged(converted, hub):
    readme = converted / "README.md"
    readme.write_text(readme.read_text() + "\nMy own notes.\n")
    push_to_hub(converted, "me/real-8")
    assert _uploaded(hub)["README.md"] == readme.read_bytes()
    hub.clear()
    readme.write_text("# Hand-written card\n")
    push_to_hub(converted, "me/real-8")
    assert _uploaded(hub)["README.md"] == b"# Hand-written card\n"


def test_folder_without_card_gets_one(tmp_path, hub):
    tiny_model().save_pretrained(tmp_path / "plain")
    push_to_hub(tmp_path / "plain", "me/plain")
    card = _uploaded(hub)["README.md"].decode()
    assert card == str(render_model_card(tmp_path / "plain", model_id="me/plain"))


@pytest.mark.parametrize("damage", ["truncate", "no config"])
def test_broken_folders_are_not_pushed(converted, hub, damage):
    if damage == "truncate":
        weights = converted / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
        message = "model.safetensors: not a valid safetensors file"
    else:
        (converted / "config.json").unlink()
        message = "real-8: no config.json"
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        push_to_hub(converted, "me/real-8")
    assert hub == []


def test_cli_push_errors_are_one_line(tmp_path, hub, capsys):
    assert main(["push", str(tmp_path / "missing"), "me/x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hf-p2r push: error: ") and "no such folder" in err


def test_model_card_template_ships_inside_the_package():
    """hf_p2r/model_cards links to the repository's model_cards/, so wheels carry the templates (package data)."""
    from pathlib import Path

    from hf_p2r.checkpoint.card import MODEL_CARD_TEMPLATE

    repo = Path(__file__).resolve().parents[1]
    assert MODEL_CARD_TEMPLATE.parent == repo / "hf_p2r" / "model_cards"
    assert MODEL_CARD_TEMPLATE.resolve() == repo / "model_cards" / "model_card.md"


def test_renamed_folder_gets_its_card_rendered_for_the_repo(converted, hub, tmp_path):
    """`mv real-8 final`: the card still says `# real-8`, but it is hf-p2r's unedited card, so the push renders it
    for the repo (title, snippet) instead of uploading the stale one."""
    final = converted.rename(tmp_path / "final")
    stale = (final / "README.md").read_text()
    assert "# real-8" in stale and _provenance(final)["rendered_for"] == "real-8"
    push_to_hub(final, "me/final")
    card = _uploaded(hub)["README.md"].decode()
    assert "# me/final" in card and 'from_pretrained("me/final")' in card and "real-8" not in card
    assert card == str(render_model_card(final, model_id="me/final", provenance=_provenance(final)))
    assert (final / "README.md").read_text() == stale, "the folder itself is not modified"
    # an edited card in a renamed folder is still the author's
    hub.clear()
    (final / "README.md").write_text(stale.replace("# real-8", "# My model"))
    push_to_hub(final, "me/final")
    assert _uploaded(hub)["README.md"].decode() == stale.replace("# real-8", "# My model")


def _free_port() -> int:
    """A loopback port that nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_hub_is_one_line_without_the_token(converted):
    """A real connection to a closed local port: huggingface_hub raises httpx's ConnectError (not an OSError)."""
    endpoint = f"http://127.0.0.1:{_free_port()}"
    env = dict(os.environ, HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="0", HF_TOKEN=TOKEN)
    result = subprocess.run(
        [sys.executable, "-m", "hf_p2r.cli", "push", str(converted), "me/real-8"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(f"hf-p2r push: error: cannot reach {endpoint}: "), result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr and TOKEN not in result.stderr


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            httpx2.ConnectError("[Errno -3] Temporary failure in name resolution"),
            "cannot reach {endpoint}: [Errno -3] Temporary failure in name resolution",
        ),
        (httpx2.ReadTimeout("The read operation timed out"), "cannot reach {endpoint}: The read operation timed out"),
        (
            HfHubHTTPError(
                f"401 Client Error: Unauthorized for url: x\n\nInvalid credentials in {TOKEN}",
                response=httpx2.Response(401, request=httpx2.Request("POST", "https://hub.example/api/repos/create")),
            ),
            "{endpoint}: 401 Client Error: Unauthorized for url: x Invalid credentials in ***",
        ),
    ],
    ids=["dns", "timeout", "401"],
)
def test_hub_errors_are_one_line_without_the_token(converted, monkeypatch, capsys, error, expected):
    monkeypatch.setenv("HF_TOKEN", TOKEN)

    def fail(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(HfApi, "create_repo", fail)
    assert main(["push", str(converted), "me/real-8"]) == 1
    err = capsys.readouterr().err
    assert err == f"hf-p2r push: error: {expected.format(endpoint=constants.ENDPOINT)}\n"


# Issue 23: nothing out of the folder is uploaded; bad arguments are refused before anything is read or sent.


def _outside_files(tmp_path):
    """A secret file, a folder and a FIFO outside any checkpoint folder."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("root:x:0:0\n")
    (outside / "folder").mkdir()
    (outside / "folder" / "inner").write_text("inner")
    os.mkfifo(outside / "fifo")
    return outside


def test_links_out_of_the_folder_fifos_and_devices_are_skipped_and_named(converted, hub, tmp_path, capsys):
    outside = _outside_files(tmp_path)
    (converted / "passwd").symlink_to("/etc/passwd")
    (converted / "secret").symlink_to(outside / "secret")
    (converted / "linked").symlink_to(outside / "folder")
    (converted / "dangling").symlink_to(tmp_path / "nothing")
    os.mkfifo(converted / "pipe")
    (converted / "null").symlink_to("/dev/null")
    (converted / "copy.json").symlink_to("config.json")  # a link within the folder: uploaded
    skipped = ["dangling", "linked", "null", "passwd", "pipe", "secret"]

    assert main(["push", str(converted), "me/real-8", "--dry-run"]) == 0
    out = capsys.readouterr().out
    listing = out[: out.index("\n\n")].splitlines()
    assert [line.split()[0] for line in listing[1:-1]] == [
        "config.json",
        "copy.json",
        "generation_config.json",
        "model.safetensors",
        "README.md",
    ]
    assert (
        listing[-1] == f"Not uploaded: skipped 6 of {converted}'s entries, not files within it (links out of it, "
        f"FIFOs, devices, links to folders): {', '.join(skipped)}"
    )

    assert main(["push", str(converted), "me/real-8"]) == 0
    captured = capsys.readouterr()
    assert captured.err == f"hf-p2r push: warning: {listing[-1].removeprefix('Not uploaded: ')}\n"
    assert captured.out == "https://huggingface.co/me/real-8/commit/abc\n"
    files = _uploaded(hub)
    assert sorted(files) == ["README.md", "config.json", "copy.json", "generation_config.json", "model.safetensors"]
    assert files["copy.json"] == (converted / "config.json").read_bytes()
    assert b"root:" not in b"".join(files.values())


def test_a_hub_cache_snapshots_links_into_its_blobs_are_uploaded(tmp_path, hub):
    """What `hf download` leaves: snapshots/<revision>/<file> are links to ../../blobs/<hash>."""
    tiny_model().save_pretrained(tmp_path / "saved")
    repo = tmp_path / "hub" / "models--me--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for index, file in enumerate(sorted((tmp_path / "saved").iterdir())):
        blob = repo / "blobs" / f"{index:040x}"
        file.rename(blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    push_to_hub(snapshot, "me/tiny")
    files = _uploaded(hub)
    assert sorted(files) == ["README.md", "config.json", "generation_config.json", "model.safetensors"]
    assert files["model.safetensors"] == (repo / "blobs" / f"{2:040x}").read_bytes()


@pytest.mark.parametrize("readme", ["fifo in the folder", "link to a fifo outside", "link to a file outside"])
def test_a_readme_that_is_not_a_file_within_the_folder_is_never_read(converted, tmp_path, readme):
    """A FIFO would block a reader forever: the command must end, in a fresh process, with a rendered card."""
    outside = _outside_files(tmp_path)
    (converted / "README.md").unlink()
    if readme == "fifo in the folder":
        os.mkfifo(converted / "README.md")
    else:
        (converted / "README.md").symlink_to(outside / ("fifo" if "fifo" in readme else "secret"))
    result = subprocess.run(
        [sys.executable, "-m", "hf_p2r.cli", "push", str(converted), "me/real-8", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert "README.md  (rendered from model_cards/: the folder's README.md is not a file within it, below)" in (
        result.stdout
    )
    assert "Not uploaded: skipped 1 of" in result.stdout and result.stdout.count("README.md") >= 2
    assert "root:x" not in result.stdout and "# me/real-8" in result.stdout


BAD_REPO_IDS = ["", "a b", "me/x/y", "me/x..y", "me--x/y", "me/x.git", "-me/x", "me/" + "x" * 97, "../x"]
BAD_BRANCHES = ["", "a b", "a..b", "-b", "b/", "/b", "b.", "b.lock", ".b", "a/.b", "a//b", "a@{b", "a~1", "a^", "a:b"]
BAD_BRANCHES += ["a?", "a*", "a[b", "a\\b", "HEAD", "@", "a\tb", "a\x7fb"]


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry run", "push"])
@pytest.mark.parametrize(
    "argument,value", [("repo_id", v) for v in BAD_REPO_IDS] + [("revision", v) for v in BAD_BRANCHES]
)
def test_bad_repo_ids_and_branches_are_refused_before_anything_is_read(tmp_path, hub, capsys, dry_run, argument, value):
    """The folder does not even exist: the arguments are checked first, in a dry run too."""
    repo_id, options = (value, []) if argument == "repo_id" else ("me/x", [f"--revision={value}"])
    argv = ["push", *options, *["--dry-run"] * dry_run, "--", str(tmp_path / "missing"), repo_id]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"hf-p2r push: error: {argument} {value!r}"[:60]), captured.err
    assert hub == []


@pytest.mark.parametrize("revision", ["v1", "feature/x", "release-1.0", "user@host", "v1.0_rc", "é"])
def test_good_branches_are_pushed_to(converted, hub, revision):
    push_to_hub(converted, "me/real-8", revision=revision)
    assert [call[3].get("branch") for call in hub if call[0] == "create_branch"] == [revision]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab/.-@{}~^:?*[\\ \t\x7fé") | st.characters(), max_size=12))
def test_branch_names_follow_git(name):
    """Every name `check_branch` accepts, git accepts as a branch (`git check-ref-format --branch`); every name git
    accepts but "@" (which git reads as the current branch), `check_branch` accepts."""
    try:
        check_branch(name)
        ours = True
    except InputError as error:
        assert str(error).count("\n") == 0 and str(error).startswith("revision ")
        ours = False
    if "\x00" in name or any("\ud800" <= c <= "\udfff" for c in name):  # not UTF-8 / not an argument: refused
        assert not ours
        return
    git = subprocess.run(["git", "check-ref-format", "--branch", name], capture_output=True, cwd="/").returncode == 0
    assert ours == (git and name != "@"), (name, ours, git)


def test_a_readme_with_broken_metadata_is_one_line(converted, hub, capsys):
    (converted / "README.md").write_text("---\nlicense: [mit\n---\n# Mine\n")
    assert main(["push", str(converted), "me/real-8", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hf-p2r push: error: {converted / 'README.md'}: its metadata block") and err.count("\n") == 1
    assert hub == []


@pytest.mark.parametrize("content", [b"\xff\xfe not UTF-8", b"x" * ((1 << 20) + 1)], ids=["binary", "over 1 MiB"])
def test_readmes_that_cannot_be_hf_p2rs_card_go_up_unchanged(converted, hub, content):
    (converted / "README.md").write_bytes(content)
    push_to_hub(converted, "me/real-8")
    assert _uploaded(hub)["README.md"] == content


def test_token_shaped_strings_are_masked_too(monkeypatch):
    from hf_p2r.errors import redact

    monkeypatch.setenv("HF_TOKEN", "not-hf-shaped-secret-0123")
    other = "hf_" + "A1b2" * 9
    message = redact(f"401: {TOKEN} and {other}, not-hf-shaped-secret-0123")
    assert message == "401: *** and ***, ***"


_CARD_FIELDS = ["model_type", "architectures", "num_hidden_layers", "share_layers", "num_unique_layers", "auto_map"]
_CARD_FIELDS += ["sharing_pattern", "num_experts", "hidden_size", "tie_word_embeddings"]
_ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("card") / "model"
    tiny_model().save_pretrained(folder)
    return folder


@settings(max_examples=100, deadline=None)
@given(changes=st.dictionaries(st.sampled_from(_CARD_FIELDS), _ANY_JSON, max_size=4))
def test_cards_render_from_any_config_values(saved, changes):
    """A config.json whose fields have any JSON value renders a card, or is refused in one line; nothing else."""
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**config, **changes}))
    try:
        card = render_model_card(saved, model_id="me/x")
    except (ValueError, FileNotFoundError) as error:
        assert "\n" not in str(error)
        return
    finally:
        (saved / "config.json").write_text(json.dumps(config))
    assert "# me/x" in str(card)


# Issue 36: names from disk are printed escaped, and the dry run lists exactly what the push uploads.


def _listing(out: str) -> list[str]:
    """The paths a dry run's report lists (its lines up to the card or the "Not uploaded" line)."""
    head = out[: out.index("\n\n")] if "\n\n" in out else out
    lines = [line for line in head.splitlines()[1:] if line.startswith("  ")]
    return [line[2:].rsplit("  (", 1)[0] for line in lines]


def test_a_file_name_with_a_newline_cannot_forge_a_line_of_the_dry_run(converted):
    """As users run it, in a fresh process: the name is skipped (the Hub's paths are text) and shown escaped."""
    forged = "notes\n  model-00002-of-00002.safetensors  (5.0GB)\nNot uploaded: nothing"
    (converted / forged).write_text("x")
    (converted / "ok\x1b[2Jname.txt").write_text("y")
    result = subprocess.run(
        [sys.executable, "-m", "hf_p2r.cli", "push", str(converted), "me/real-8", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "model-00002-of-00002" not in _listing(result.stdout)
    assert not any(line.startswith("  model-00002") for line in result.stdout.splitlines())
    assert "Not uploaded: nothing" not in result.stdout.splitlines()
    assert "\x1b" not in result.stdout
    skipped = result.stdout.splitlines()[len(_listing(result.stdout)) + 1]
    assert skipped.startswith("Not uploaded: skipped 2 of ")
    assert "notes\\n  model-00002-of-00002.safetensors  (5.0GB)\\nNot uploaded: nothing (its name has unprintable" in (
        skipped
    )
    assert "ok\\x1b[2Jname.txt (its name has unprintable characters)" in skipped


def test_push_plans_exactly_what_it_uploads(converted, hub, capsys):
    """A README.md that is a folder, a 0-byte or damaged .safetensors file, a .json file that is not JSON: skipped
    and named, in the dry run and the push alike; the rest is uploaded, and listed, as it is."""
    (converted / "README.md").unlink()
    (converted / "README.md").mkdir()
    (converted / "README.md" / "inside.txt").write_text("not a card")
    (converted / "extra.safetensors").write_bytes(b"")
    (converted / "damaged.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    (converted / "notes.json").write_text("{")
    (converted / "notes.txt").write_text("kept")
    assert main(["push", str(converted), "me/real-8", "--dry-run"]) == 0
    out = capsys.readouterr().out
    listed = _listing(out)
    assert listed == ["config.json", "generation_config.json", "model.safetensors", "notes.txt", "README.md"]
    assert "README.md  (rendered from model_cards/: a folder named README.md" in out
    skipped = next(line for line in out.splitlines() if line.startswith("Not uploaded: "))
    assert skipped.startswith(f"Not uploaded: skipped 4 of {converted}'s entries, not valid files of their kind")
    named = [
        "README.md/ (a folder named README.md",
        "damaged.safetensors (not a valid safetensors file: its",
        "extra.safetensors (not a valid safetensors file: the file has 0 bytes",
        "notes.json (not valid JSON",
    ]
    assert [text for text in named if text not in skipped] == [], skipped
    assert main(["push", str(converted), "me/real-8"]) == 0
    assert sorted(_uploaded(hub)) == sorted(listed), "the push uploads what the dry run lists"
    assert capsys.readouterr().err == f"hf-p2r push: warning: {skipped.removeprefix('Not uploaded: ')}\n"


@pytest.mark.parametrize("damage", ["empty weights", "config not JSON"])
def test_a_model_whose_own_files_are_damaged_is_not_pushed(converted, hub, damage):
    """Its own weights and config.json are refused (one line), not skipped: the model would not load. (The author's
    own card, which reads neither, included.)"""
    (converted / "README.md").write_text("# My own card\n")
    if damage == "empty weights":
        (converted / "model.safetensors").write_bytes(b"")
        message = r"model\.safetensors: not a valid safetensors file: the file has 0 bytes"
    else:
        (converted / "config.json").write_text("{")
        message = r"config\.json: not valid JSON"
    for dry_run in (True, False):
        with pytest.raises(InputError, match=message):
            push_to_hub(converted, "me/real-8", dry_run=dry_run)
    assert hub == []


_KINDS = ["file", "empty", "empty weights", "bad json", "folder", "link in", "link out", "fifo", "card folder"]
_NAMES = st.text(
    st.sampled_from("ab.-_ é\n\t\x1b\x7f") | st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"),
    min_size=1,
    max_size=10,
).filter(lambda name: name not in (".", "..") and len(name.encode()) < 200)


def _make(folder, name: str, kind: str, outside) -> str | None:
    """Entry `name` of `kind` in `folder`; its name (None if it could not be made: taken already)."""
    name = {"empty weights": f"{name}.safetensors", "bad json": f"{name}.json", "card folder": "README.md"}.get(
        kind, name
    )
    path = folder / name
    if os.path.lexists(path):
        return None
    if kind == "file":
        path.write_bytes(b"data")
    elif kind in ("empty", "empty weights"):
        path.write_bytes(b"")
    elif kind == "bad json":
        path.write_text("{")
    elif kind in ("folder", "card folder"):
        if kind == "card folder":
            (folder / "README.md").unlink(missing_ok=True)
            path = folder / "README.md"
        path.mkdir()
        (path / "inner.txt").write_text("inner")
    elif kind == "link in":
        path.symlink_to("config.json")
    elif kind == "link out":
        path.symlink_to(outside)
    else:
        os.mkfifo(path)
    return name


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("push") / "model"
    tiny_model().save_pretrained(folder)
    (folder.parent / "outside.txt").write_text("secret")
    return folder


@settings(max_examples=25, deadline=None)
@given(entries=st.lists(st.tuples(_NAMES, st.sampled_from(_KINDS)), min_size=1, max_size=6))
def test_the_dry_run_lists_exactly_what_the_push_uploads_whatever_the_folder_holds(saved_model, entries):
    import tempfile
    from unittest import mock

    from hf_p2r.checkpoint.headers import read_header
    from hf_p2r.errors import printable

    with tempfile.TemporaryDirectory() as name:
        folder = Path(name) / "model"
        shutil.copytree(saved_model, folder)
        outside = saved_model.parent / "outside.txt"
        made = [made for entry, kind in entries if (made := _make(folder, entry, kind, outside))]
        report = push_to_hub(folder, "me/model", dry_run=True)
        sent = []

        def commit(self, *args, **kwargs):
            sent.append(kwargs["operations"])
            url = "https://huggingface.co/me/model/commit/abc"
            return CommitInfo(commit_url=url, commit_message="m", commit_description="", oid="abc")

        with mock.patch.object(HfApi, "create_repo"), mock.patch.object(HfApi, "create_commit", commit):
            push_to_hub(folder, "me/model")
        head = report[: report.index("\n\n")]
        assert all(line.isprintable() for line in head.splitlines()), "every line of the listing printable"
        listed = _listing(report)
        (operations,) = sent
        uploaded = {op.path_in_repo: op.path_or_fileobj for op in operations}
        assert sorted(listed) == sorted(uploaded), "the listing is the upload"
        for path, source in uploaded.items():
            if path == "README.md" and isinstance(source, bytes):
                continue
            assert path.isprintable() and not path.startswith("README.md/")
            assert Path(source).is_file() and Path(source).resolve().is_relative_to(folder.resolve())
            if path.endswith(".safetensors"):
                read_header(source)
            if path.endswith(".json"):
                json.loads(Path(source).read_text())
        skipped_line = next((line for line in head.splitlines() if line.startswith("Not uploaded: ")), "")
        for name in made:  # every entry made is uploaded (a folder: its files) or named as skipped
            if name.startswith(".") or name == "README.md":
                continue
            inside = any(path.startswith(f"{name}/") for path in uploaded)
            assert name in uploaded or inside or printable(name) in skipped_line, (name, skipped_line)
