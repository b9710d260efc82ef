"""Every usage snippet runs as written in a fresh process (issue 37 point 2): the model card's "How to use" and the run
summary's "load it" line, tokenizer and `generate` included, on tiny saved models with and without their modeling
code; and the saved tokenizer loads with `AutoTokenizer` alone, never asking to run custom code."""

import os
import re
import subprocess
import sys

import pytest

from hf_p2r.checkpoint import save_model
from hf_p2r.checkpoint.card import USAGE_PROMPT, render_model_card
from hf_p2r.training.data import byte_level_tokenizer
from hf_p2r.training.run import run_summary

from ..conftest import tiny_model


def _fresh_python(code: list[str], home) -> subprocess.CompletedProcess:
    """`python *code` in a fresh process: offline, its own Hugging Face home (the modules a remote-code folder
    copies), no standard input (a prompt fails at once instead of waiting)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(home), "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.run(
        [sys.executable, *code], capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=300
    )


@pytest.fixture(params=[True, False], ids=["remote_code", "import_hf_p2r"])
def saved(request, tmp_path):
    """A tiny real P2R model saved with the built-in tokenizer, with (remote_code) or without its modeling code."""
    model = tiny_model(vocab_size=320, bos_token_id=256, eos_token_id=256, pad_token_id=257, num_hidden_layers=2)
    folder = tmp_path / "run" / "real"
    save_model(model, folder, tokenizer=byte_level_tokenizer(), remote_code=request.param, progress=False)
    return folder, request.param


def _check_generated(result: subprocess.CompletedProcess) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "custom code" not in output and "trust_remote_code" not in output, output[-3000:]
    assert result.stdout.startswith(USAGE_PROMPT) and len(result.stdout.strip()) > len(USAGE_PROMPT), result.stdout


def test_the_model_cards_how_to_use_runs_as_written(saved, tmp_path):
    folder, remote_code = saved
    card = str(render_model_card(folder, model_id=str(folder)))
    (code,) = re.findall(r"## How to use\n\n```python\n(.*?)```", card, flags=re.S)
    assert ("trust_remote_code=True" in code) is remote_code and ("import hf_p2r" in code) is not remote_code
    assert "AutoTokenizer.from_pretrained" in code and "model.generate(" in code
    _check_generated(_fresh_python(["-c", code], tmp_path / "home"))


def test_the_run_summarys_load_line_runs_as_written(saved, tmp_path):
    folder, remote_code = saved
    summary = run_summary(folder.parent, [], 1.0, remote_code)
    (line,) = [line for line in summary.splitlines() if line.strip().startswith("load it (Python):")]
    code = line.split(":", 1)[1].strip()
    assert "AutoTokenizer.from_pretrained" in code and "model.generate(" in code
    _check_generated(_fresh_python(["-c", code], tmp_path / "home"))


def test_the_saved_tokenizer_loads_with_auto_tokenizer_alone_without_a_prompt(saved, tmp_path):
    """Its files are a plain tokenizer.json (transformers' own class): a folder without modeling code loads it with
    transformers alone (hf_p2r not imported); a remote-code folder's config.json is custom code, which AutoTokenizer
    (that reads it) loads with trust_remote_code=True, as the snippets say."""
    folder, remote_code = saved
    config = (folder / "tokenizer_config.json").read_text()
    assert '"tokenizer_class": "TokenizersBackend"' in config and "auto_map" not in config
    trust = ", trust_remote_code=True" if remote_code else ""
    code = (
        "from transformers import AutoTokenizer; "
        f"t = AutoTokenizer.from_pretrained({str(folder)!r}{trust}); print(t.decode(t('héllo')['input_ids']))"
    )
    result = _fresh_python(["-c", code], tmp_path / "home")
    assert result.returncode == 0 and result.stdout == "héllo\n", (result.stdout + result.stderr)[-3000:]
    assert "custom code" not in result.stdout + result.stderr
