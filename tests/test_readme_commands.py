"""Every shell command the README and the pages of docs/ show runs as written: on a fresh output folder, page by page
(the README, the index, then the pages in the index's order) and in each page's order, after
`source .venv/bin/activate` (the README's own instruction), shortened only by documented overrides.

The commands are the lines of the pages' ```bash blocks and the inline code spans that start with a command
(`hf-p2r ...`, `make ...`, `python ...`), each run once however many pages show it. Each is either run, or excused
below with the reason this machine cannot run it (a GPU, the Hub, an install, an interactive prompt) or another test
runs it. A command that is neither fails `test_every_readme_command_is_run_or_excused`, so a new command cannot go
untested by accident, and an excuse that matches no command fails too. The Python blocks that read what the commands
wrote (test_readme.py's PYTHON_BLOCKS marks them "after the commands") run last, each in a fresh process.

Training commands are shortened with trainer fields the pages document ("any field can be overridden on the command
line", appended last so they win): a few steps on a small slice of the corpus. `make demo` takes them in `ARGS`, as
the README shows. A command passes when it exits 0 and prints no traceback.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from .docs_pages import REPO, code_blocks, pages, text
from .test_readme import PYTHON_BLOCKS

COMMAND_WORDS = ("hf-p2r", "accelerate", "torchrun", "python", "python3", "make", "pip", "source")
# The shortening: a few steps (growth steps follow pseudo_steps), a small corpus, no evaluation on the way.
SMOKE = (
    "--pseudo_steps 6 --real_steps 3 --warmup_steps 1 --eval_steps 0 --eval_blocks 4 --logging_steps 3 "
    "--save_steps 0 --corpus_max_bytes 40000"
)
# (pattern, why this test does not run the command here); each pattern must match at least one command of the pages.
EXCUSED = [
    (
        r"scripts/train\.py.*configs/gpu_1b\.yaml",
        "downloads GPT-2's tokenizer and WikiText-103 from the Hub and is sized for GPUs (the DDP, FSDP2 and DeepSpeed "
        "launcher configs also need GPUs: Accelerate turns those engines on only there)",
    ),
    (r"^pip install|^python3 -m venv", "installs packages from an index"),
    (
        r"^make gpu-report$|scripts/bench_offload\.py(?!.*--device cpu)",
        "measures on a CUDA GPU, which this machine lacks (each says so in one line and exits non-zero here)",
    ),
    (r"^make gpu-report DRY=1$", "the report's CPU dry run: tests/test_gpu_report.py runs it"),
    (
        r"^python scripts/bench_async_save\.py$",
        "rewrites the committed benchmarks/async_save.md with this machine's figures: "
        "tests/test_bench_async_save.py runs it small into a temporary folder",
    ),
    (
        r"^python scripts/bench_offload_(host|delayed)\.py$",
        "rewrites the committed benchmarks/offload_host.md / offload_delayed.md with this machine's figures (the "
        "delayed one trains three 300-step runs): tests/test_bench_offload.py runs both in their smoke modes",
    ),
    (
        r"^python scripts/bench_streaming\.py\b|^python -m benchmarks\.malloc$",
        "rewrite the committed benchmarks/streaming.md / malloc.md with this machine's figures and run for 10-20 "
        "minutes (four trainer runs; four FSDP2 processes per row): not run by the suite (no smoke test yet)",
    ),
    (
        r"^python scripts/bench_scale\.py$",
        "the scale benchmark trains 25 multi-process runs (16 minutes here): tests/test_bench_scale.py runs its "
        "--quick mode",
    ),
    (r"^make (test|compat|lock)\b", "the test suite and the dependency pins: CI runs them itself"),
    (
        r"^python scripts/gen_config_docs\.py$",
        "rewrites docs/configuration.md: tests/test_config_docs.py checks the committed page is what it writes",
    ),
    (r"^accelerate config$", "asks questions interactively"),
    (r"^hf-p2r push (?!.*--dry-run)", "uploads to the Hugging Face Hub (the dry run above runs)"),
    (
        r"^(hf-p2r( convert| plan| export| train)?|accelerate( launch)?|torchrun|make|python( scripts/train\.py)?)$",
        "a name in the prose, not a command",
    ),
]


def readme_commands() -> list[str]:
    """The pages' shell commands in order, each once: ```bash lines (continuations joined, comments dropped) and
    inline code spans that start with a command word."""
    found = []
    for page in pages():
        for block, inline in re.findall(r"```bash\n(.*?)```|`([^`\n]+)`", text(page), re.S):
            lines = block.replace("\\\n", " ").splitlines() if block else [inline]
            for line in lines:
                line = " ".join(line.split("#", 1)[0].split()) if block else " ".join(line.split())
                if line and line.split()[0] in COMMAND_WORDS and line not in found:
                    found.append(line)
    return found


def python_after_the_commands() -> list[str]:
    """The Python blocks that read what the commands wrote (runs/demo/...)."""
    keys = [key for key, how in PYTHON_BLOCKS.items() if how == "after the commands"]
    return [block for page in pages() for block in code_blocks(page, "python") if any(key in block for key in keys)]


def excuse(command: str) -> str | None:
    return next((why for pattern, why in EXCUSED if re.search(pattern, command)), None)


def shortened(command: str) -> str:
    """`command` with the smoke fields appended where it trains (`make demo` through ARGS; `scripts/train.py`,
    `hf-p2r train` and `-m hf_p2r.train` after their own arguments)."""
    words = shlex.split(command)
    if words[:2] == ["make", "demo"]:
        given = next((word.split("=", 1)[1] for word in words if word.startswith("ARGS=")), "")
        rest = [word for word in words if not word.startswith("ARGS=")]
        return shlex.join([*rest, f"ARGS={given} {SMOKE}".strip()])
    trains = "scripts/train.py" in words or "hf_p2r.train" in words or words[:2] == ["hf-p2r", "train"]
    if trains and "--help" not in words:
        return f"{command} {SMOKE}"
    return command


def test_every_readme_command_is_run_or_excused():
    commands = readme_commands()
    assert len(pages()) >= 10, "the README, the index and the pages of docs/"
    run = [command for command in commands if excuse(command) is None]
    for command in run:
        assert command.split()[0] in COMMAND_WORDS and "[" not in command, f"not runnable as written: {command}"
    unused = [pattern for pattern, _ in EXCUSED if not any(re.search(pattern, c) for c in commands)]
    assert not unused, f"excuses that match no command of the pages: {unused}"
    # What the run below covers: the demo, a conversion, the dry-run push, the planner and every pipeline command.
    assert "make demo" in run and any(c.startswith("hf-p2r convert") for c in run)
    assert any("--dry-run" in c for c in run) and any(c.startswith("hf-p2r plan") for c in run)
    assert sum("--pipeline_parallel_size" in c for c in run) >= 3


def _workspace(tmp_path: Path) -> Path:
    """A fresh folder that looks like the repository to the commands (its configs, scripts, Makefile and .venv), so
    every output they write (runs/...) lands in it."""
    for name in (
        "configs",
        "scripts",
        "Makefile",
        "pyproject.toml",
        "requirements",
        "README.md",
        "docs",
        "hf_p2r",
        "benchmarks",
        "tests",
        "examples",
    ):
        if (REPO / name).exists():
            (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    return tmp_path


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path):
    workspace = _workspace(tmp_path)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("VIRTUAL_ENV", None)
    failures = []
    for command in readme_commands():
        if excuse(command) is not None:
            continue
        # Each command in a shell that has done what the README says first.
        script = f"source .venv/bin/activate && {shortened(command)}"
        done = subprocess.run(
            ["bash", "-c", script], cwd=workspace, env=env, capture_output=True, text=True, timeout=600
        )
        output = done.stdout + done.stderr
        if done.returncode != 0 or "Traceback" in output:
            failures.append(f"{command}\n  exit {done.returncode}: {output[-1500:]}")
    blocks = python_after_the_commands()
    for number, block in enumerate(blocks):
        (workspace / f"block_{number}.py").write_text(block, encoding="utf-8")
        script = f"source .venv/bin/activate && python block_{number}.py"
        done = subprocess.run(
            ["bash", "-c", script], cwd=workspace, env=env, capture_output=True, text=True, timeout=600
        )
        if done.returncode != 0 or "Traceback" in done.stdout + done.stderr:
            failures.append(f"{block}\n  exit {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")
    assert not failures, "\n".join(failures)
    assert blocks, "the README's load-and-generate block runs here"
    assert (workspace / "runs/demo/real/model.safetensors").is_file()


def test_every_training_command_is_shortened():
    """The smoke fields reach every command that trains, whichever entry point it uses."""
    for command in readme_commands():
        words = shlex.split(command)
        trains = {"scripts/train.py", "hf_p2r.train"} & set(words) or words[:2] in (
            ["hf-p2r", "train"],
            ["make", "demo"],
        )
        if trains and "--help" not in words and excuse(command) is None:
            assert SMOKE in shortened(command), command
