"""The Hub token never appears in any output (issue 36): every command, every error path.

A local HTTP server (bound to 127.0.0.1, answering a bounded number of requests) stands in for the Hub and does what
a curious or careless server may do: it echoes each request's headers, `authorization: Bearer <token>` included, in
its error's body and in its `X-Error-Message` header. Each command runs in a fresh process (with a timeout) with a
fake `HF_TOKEN` and `HF_ENDPOINT` pointed at the server; the server seeing the token is the control (it was sent),
and the token must then appear nowhere in the process's stdout, stderr or the files it wrote."""

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hf_p2r.errors import redact, redacted_output, run_redacted

from ..conftest import tiny_model

TOKEN = "hf_FakeTokenForTheEchoTest0123456789ab"
MAX_REQUESTS = 200  # a command that loops on its requests fails the test instead of running for ever


class _Echo(http.server.BaseHTTPRequestHandler):
    def _reply(self):
        server = self.server
        server.requests += 1
        server.seen.append(self.headers.get("authorization", ""))
        if server.requests > MAX_REQUESTS:
            self.close_connection = True
            return
        echoed = "; ".join(f"{key}: {value}" for key, value in self.headers.items())
        body = json.dumps({"error": f"denied, you sent {echoed}"}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Error-Message", f"denied, you sent {echoed}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_POST = do_PUT = _reply

    def log_message(self, *args):
        pass


@pytest.fixture
def hub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    server.requests, server.seen = 0, []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def run(args: list[str], hub, tmp_path: Path) -> subprocess.CompletedProcess:
    """`args` in a fresh Python process that may reach the echo server (HF_HUB_OFFLINE unset there only)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update(
        HF_TOKEN=TOKEN,
        HF_ENDPOINT=f"http://127.0.0.1:{hub.server_address[1]}",
        HF_HOME=str(tmp_path / "hf_home"),  # no cached file, no stored token
        HF_HUB_ETAG_TIMEOUT="10",
        HF_HUB_DOWNLOAD_TIMEOUT="10",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
    )
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


def assert_no_token(result: subprocess.CompletedProcess, tmp_path: Path) -> None:
    shown = result.stdout + result.stderr
    assert TOKEN not in shown, shown[-3000:]
    for path in tmp_path.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert TOKEN.encode() not in path.read_bytes(), path


def assert_sent_and_echoed_redacted(result, hub) -> None:
    assert any(TOKEN in seen for seen in hub.seen), "the control: the token reached the server"
    assert "Bearer ***" in result.stderr, result.stderr[-3000:]  # the echo was shown, redacted (not dropped)


TRAIN_ARGS = ["--tokenizer_name", "some/repo", "--output_dir", "out", "--cpu", "true"]


@pytest.mark.parametrize(
    "command", [["-m", "hf_p2r.cli", "train"], ["-m", "hf_p2r.train"]], ids=["hf-p2r train", "python -m hf_p2r.train"]
)
def test_train_never_prints_the_token_a_server_echoes(hub, tmp_path, command):
    result = run([*command, *TRAIN_ARGS], hub, tmp_path)
    assert result.returncode != 0
    assert_sent_and_echoed_redacted(result, hub)
    assert_no_token(result, tmp_path)
    assert not (tmp_path / "out").exists(), "a run that failed at its start leaves no output_dir"


def _dcp_checkpoint(folder: Path, tokenizer_name: str) -> None:
    """A DCP checkpoint of a tiny model whose trainer_state.json names `tokenizer_name` (made without training)."""
    from hf_p2r.training import dcp, parse_config
    from hf_p2r.training.checkpointing import STATE_FILE, TrainState
    from hf_p2r.training.data import load_tokenizer
    from hf_p2r.training.train import build_model

    argv = ["--hidden_size", "32", "--intermediate_size", "64", "--num_hidden_layers", "2"]
    argv += ["--num_attention_heads", "2", "--pseudo_steps", "0", "--checkpoint_format", "dcp"]
    config = parse_config(argv)
    model = build_model(config, load_tokenizer(None), 2)
    dcp.save(folder, {"model": {name: param.detach() for name, param in model.named_parameters()}})
    saved = {**config.to_dict(), "tokenizer_name": tokenizer_name}
    state = {"stage": "real", "state": vars(TrainState(num_blocks=2, step=1)), "config": saved}
    (folder / STATE_FILE).write_text(json.dumps(state))


def test_export_never_prints_the_token_a_server_echoes(hub, tmp_path):
    _dcp_checkpoint(tmp_path / "checkpoint-1", "some/repo")
    result = run(["-m", "hf_p2r.cli", "export", "checkpoint-1", "exported"], hub, tmp_path)
    assert result.returncode != 0
    assert_sent_and_echoed_redacted(result, hub)
    assert_no_token(result, tmp_path)
    assert not (tmp_path / "exported").exists()


def test_push_never_prints_the_token_a_server_echoes(hub, tmp_path):
    tiny_model().save_pretrained(tmp_path / "model")
    result = run(["-m", "hf_p2r.cli", "push", "model", "me/model"], hub, tmp_path)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert_sent_and_echoed_redacted(result, hub)
    assert_no_token(result, tmp_path)


def test_convert_and_env_never_print_the_token(hub, tmp_path):
    """Neither talks to the Hub; a message quoting the token (here a path holding it) is redacted all the same."""
    missing = tmp_path / TOKEN / "pseudo"
    result = run(["-m", "hf_p2r.cli", "convert", str(missing), "real"], hub, tmp_path)
    assert result.returncode == 2 and "/***/pseudo: no such folder" in result.stderr, result.stderr
    assert_no_token(result, tmp_path)
    result = run(["-m", "hf_p2r.cli", "env"], hub, tmp_path)
    assert result.returncode == 0 and "torch version" in result.stdout
    assert_no_token(result, tmp_path)
    assert hub.requests == 0


# --- the redaction itself, in this process -----------------------------------------------------------------------


def test_a_traceback_a_command_lets_through_is_printed_redacted(monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", TOKEN)

    def buggy():
        raise RuntimeError(f"a bug, with the token {TOKEN} in its message")

    assert run_redacted(buggy) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: a bug, with the token *** in its message" in err
    assert TOKEN not in err


def test_log_lines_and_prints_are_redacted_on_their_way_out(monkeypatch, capsys):
    """A logging handler made before the redaction (as a library makes its own at import) included. (Warnings are
    written to sys.stderr: the same way out.)"""
    import logging

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    logger = logging.getLogger("tests.security.early")
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    try:
        with redacted_output():
            print(f"out {TOKEN}")
            logger.warning(f"logged {TOKEN}")
            sys.stderr.write(f"written {TOKEN}\n")
    finally:
        logger.removeHandler(handler)
    captured = capsys.readouterr()
    assert captured.out == "out ***\n"
    assert "logged ***" in captured.err and "written ***" in captured.err
    assert TOKEN not in captured.out + captured.err
    assert handler.stream is sys.stderr, "the handler's stream is given back"


def test_the_token_huggingface_hub_stores_is_redacted_too(monkeypatch, tmp_path):
    """`hf auth login`'s token (no HF_TOKEN in the environment), once huggingface_hub is loaded."""
    stored = "a-stored-token-that-is-not-hf-shaped-42"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: stored)
    assert redact(f"x {stored} y") == "x *** y"
    assert redact("short tokens are left: abc") == "short tokens are left: abc"


def test_the_redaction_keeps_the_output_as_it_was_otherwise(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    text = "step 10: loss 2.3456, hf_short, a/b/c\n\r\x1b[2K"
    assert redact(text) == text
