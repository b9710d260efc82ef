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
line", appended last so they win): a few steps of short blocks on a small slice of the corpus. `make demo` takes them
in `ARGS`, as the README shows; the Trainer example takes its own `--max_steps` (its --help). A command passes when it
exits 0 and prints no traceback.

The commands share the machine's two cores: two at a time, each after every earlier command it depends on (`plan`:
one that names the same run folder, `runs/NAME`, or the trainer's output_dir; every `make` command, which shares the
Makefile's $(VENV)/.installed; launchers that open the same rendezvous port), and a command that starts several
processes runs alone (its processes take both cores).
"""

import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import pytest

from .docs_pages import REPO, code_blocks, pages, text
from .test_readme import PYTHON_BLOCKS
from .training.helpers import demo_launch

COMMAND_WORDS = ("hf-p2r", "accelerate", "torchrun", "python", "python3", "make", "pip", "source")
# The shortening: a few steps, both stages and every delink still (the partial delinks follow pseudo_steps: 1 -> 2
# blocks at step 1, -> 4 at step 2, the delink at 3), blocks of 32 tokens from a small corpus, no evaluation on the way.
SMOKE = (
    "--pseudo_steps 3 --real_steps 1 --warmup_steps 1 --eval_steps 0 --eval_blocks 4 --logging_steps 1 "
    "--save_steps 0 --corpus_max_bytes 40000 --block_size 32"
)
# The Trainer example's own length (60 steps by default): its delinks at a sixth and a third of the run (steps 2, 4),
# a checkpoint every 2 steps, evaluations at 4, 8 and 12.
EXAMPLE = "examples/trainer_callback.py"
EXAMPLE_SMOKE = "--max_steps 12"
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


def make_args(command: str) -> str | None:
    """The ARGS of a `make demo` command ('' when it gives none), or None for any other command."""
    words = shlex.split(command)
    if words[:2] != ["make", "demo"]:
        return None
    return next((word.split("=", 1)[1] for word in words if word.startswith("ARGS=")), "")


def trainer_args(command: str) -> list[str] | None:
    """The trainer's arguments in `command` (`make demo`: the Makefile recipe's, then ARGS; `scripts/train.py`,
    `hf-p2r train` and `-m hf_p2r.train`: the words after them), or None where it does not train (--help)."""
    words = shlex.split(command)
    if (given := make_args(command)) is not None:
        launch = demo_launch()
        args = [*launch[launch.index("scripts/train.py") + 1 :], *shlex.split(given)]
    elif entry := next((entry for entry in ("scripts/train.py", "hf_p2r.train") if entry in words), None):
        args = words[words.index(entry) + 1 :]
    else:
        args = words[2:] if words[:2] == ["hf-p2r", "train"] else None
    return None if args is None or "--help" in args else args


def shortened(command: str) -> str:
    """`command` with the smoke fields appended where it trains (`make demo` through ARGS, the others after their own
    arguments), and the Trainer example with its length."""
    if (given := make_args(command)) is not None:
        rest = [word for word in shlex.split(command) if not word.startswith("ARGS=")]
        return shlex.join([*rest, f"ARGS={given} {SMOKE}".strip()])
    if trainer_args(command) is not None:
        return f"{command} {SMOKE}"
    words = shlex.split(command)
    if EXAMPLE in words and "--help" not in words:
        return f"{command} {EXAMPLE_SMOKE}"
    return command


def processes(command: str) -> int:
    """How many processes `command` runs at once: a launcher's count, else 1."""
    found = re.search(r"--(?:nproc[-_]per[-_]node|num_processes)[= ](\d+)", command)
    return int(found.group(1)) if found else 1


def output_dir(args: list[str]) -> str:
    """Where the trainer given `args` writes: the last --output_dir, else its --config file's, else the default."""
    from hf_p2r.config.parse import read_yaml
    from hf_p2r.config.resume import field_defaults

    def last(flag: str) -> str | None:
        return next((args[i + 1] for i in reversed(range(len(args) - 1)) if args[i] == flag), None)

    config = last("--config")
    return last("--output_dir") or (read_yaml(REPO / config) if config else {}).get(
        "output_dir", field_defaults()["output_dir"]
    )


def run_folders(text: str) -> set[str]:
    """The run folders (`runs/NAME`) a command or a Python block names."""
    return {f"runs/{name}" for name in re.findall(r"\bruns/([\w.-]+)", text)}


def shared(command: str) -> set[str]:
    """What `command` reads or writes that another command may too: the run folders it names and the trainer's
    output_dir; the Makefile's $(VENV)/.installed (every `make` command: make may rebuild it); a launcher's rendezvous
    port (torchrun's, or accelerate launch's with several processes: 29500 unless given)."""
    found = run_folders(command)
    if (args := trainer_args(command)) is not None:
        found.add("/".join(Path(output_dir(args)).parts[:2]))
    words = command.split()
    if words[0] == "make":
        found.add("the Makefile's $(VENV)/.installed")
    if words[0] == "torchrun" or (words[:2] == ["accelerate", "launch"] and processes(command) > 1):
        port = re.search(r"--(?:master[-_]port|main_process_port)[= ](\d+)", command)
        found.add(f"port {port.group(1) if port else 29500}")
    return found


@dataclasses.dataclass
class Step:
    shown: str  # what a failure names: the command as the page shows it, or the Python block
    script: str  # what bash runs, in the workspace
    processes: int
    after: set[int]  # the steps that must have ended first


def plan(commands: list[str], blocks: list[str]) -> list[Step]:
    """The commands (each shortened, in a shell that has done what the README says first), then the Python blocks,
    each after the last earlier step it shares something with (`shared`); a block that names no command's run folder
    after every command."""
    steps, last = [], {}
    for command in commands:
        keys = shared(command)
        after = {last[key] for key in keys if key in last}
        last.update(dict.fromkeys(keys, len(steps)))
        steps.append(Step(command, f"source .venv/bin/activate && {shortened(command)}", processes(command), after))
    for number, block in enumerate(blocks):
        after = {last[key] for key in run_folders(block) if key in last} or set(range(len(commands)))
        steps.append(Step(block, f"source .venv/bin/activate && python block_{number}.py", 1, after))
    return steps


LANES = 2  # the machine's cores
TIMEOUT = 600  # seconds, a step


def run_step(step: Step, workspace: Path, env: dict, running: dict) -> str | None:
    """Run `step` (kept in `running` while it runs); None when it exits 0 without a traceback, else the failure: what
    it runs and its output's tail."""
    with subprocess.Popen(
        ["bash", "-c", step.script],
        cwd=workspace,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, ended whole on a time-out
    ) as process:
        running[id(step)] = process
        try:
            output, _ = process.communicate(timeout=TIMEOUT)
            ended = f"exit {process.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            ended = f"killed after {TIMEOUT} s"
        finally:
            running.pop(id(step), None)
    if process.returncode != 0 or "Traceback" in output:
        return f"{step.shown}\n  {ended}: {output[-1500:]}"
    return None


def run_steps(steps: list[Step], workspace: Path, env: dict) -> list[str]:
    """Run `steps` in `LANES` lanes, each after its `after` steps; one of several processes alone. The failures, in
    the steps' order."""
    failures, done, waiting, processes_of = {}, set(), list(range(len(steps))), {}
    with ThreadPoolExecutor(LANES) as pool:
        futures = {}
        try:
            while waiting or futures:
                ready = [i for i in waiting if steps[i].after <= done]
                alone = any(steps[i].processes > 1 for i in futures.values())
                for i in [i for i in ready if steps[i].processes == 1]:
                    if alone or len(futures) == LANES:
                        break
                    futures[pool.submit(run_step, steps[i], workspace, env, processes_of)] = i
                    waiting.remove(i)
                several = [i for i in ready if steps[i].processes > 1]
                if several and not futures:
                    futures[pool.submit(run_step, steps[several[0]], workspace, env, processes_of)] = several[0]
                    waiting.remove(several[0])
                assert futures, f"steps wait on each other: {[steps[i].shown for i in waiting]}"
                finished, _ = wait(futures, return_when=FIRST_COMPLETED)
                for future in finished:
                    i = futures.pop(future)
                    done.add(i)
                    if (failure := future.result()) is not None:
                        failures[i] = failure
        finally:  # a time limit or an error here: end what still runs, so the pool's threads end too
            for process in list(processes_of.values()):
                os.killpg(process.pid, signal.SIGKILL)
    return [failures[i] for i in sorted(failures)]


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
    blocks = python_after_the_commands()
    for number, block in enumerate(blocks):
        (workspace / f"block_{number}.py").write_text(block, encoding="utf-8")
    failures = run_steps(plan([c for c in readme_commands() if excuse(c) is None], blocks), workspace, env)
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
        if EXAMPLE in words and excuse(command) is None:
            assert shortened(command) == f"{command} {EXAMPLE_SMOKE}", command


def test_each_command_runs_after_the_commands_it_reads_from():
    """The plan orders what reads a run folder after what writes it, every `make` after the one before, the launchers
    of one port one after the other, and the Python blocks after the commands that wrote what they load."""
    commands = [command for command in readme_commands() if excuse(command) is None]
    blocks = python_after_the_commands()
    steps = plan(commands, blocks)

    def index(start: str) -> int:
        return next(i for i, command in enumerate(commands) if command.startswith(start))

    def before(i: int) -> set[int]:  # every step that ends before step i starts
        found, stack = set(), list(steps[i].after)
        while stack:
            if (j := stack.pop()) not in found:
                found.add(j)
                stack.extend(steps[j].after)
        return found

    demo = commands.index("make demo")
    for reader in ("hf-p2r convert runs/demo/real", "hf-p2r push runs/demo/real", "hf-p2r convert runs/demo/pseudo"):
        assert demo in before(index(reader)), reader
    assert index("python examples/stand_ins.py") in before(index("hf-p2r train --model_config runs/own/"))
    assert index("hf-p2r train --model_config runs/own/") in before(index("hf-p2r convert runs/own-run"))
    assert index('python -c "from hf_p2r.training.data import stdlib_corpus') in before(
        index("hf-p2r train --config configs/demo.yaml --streaming")
    )
    assert index("hf-p2r train --config configs/demo.yaml --checkpoint_format dcp") in before(
        index("hf-p2r export runs/demo-dcp")
    )
    fsdp4 = [i for i, command in enumerate(commands) if "runs/demo-fsdp4" in command]
    trainer = [i for i, command in enumerate(commands) if EXAMPLE in command]
    make = [i for i, command in enumerate(commands) if command.startswith("make ")]
    port = [i for i, command in enumerate(commands) if command.startswith("torchrun")]  # 29500, torchrun's default
    for chain in (fsdp4, trainer, make, port):
        assert len(chain) >= 2 and all(chain[k] in before(chain[k + 1]) for k in range(len(chain) - 1)), chain
    assert {"runs/demo", "runs/own-llama"} <= set().union(*map(run_folders, blocks))
    for number, block in enumerate(blocks):
        writers = [i for i, command in enumerate(commands) if run_folders(block) & shared(command)]
        assert writers and set(writers) <= before(len(commands) + number), block
    # What runs beside nothing: the commands that start several processes.
    assert {processes(command) for command in commands} == {1, 2, 4}


def test_steps_run_in_two_lanes_after_their_steps_and_several_processes_alone(tmp_path, monkeypatch):
    """run_steps on shell steps that log when they start and end: no step starts before those it comes after have
    ended, at most LANES run at once, a step of several processes beside none; a failure names the step and its
    output's tail, in the steps' order, and a step past its time limit is ended with its process group."""
    monkeypatch.setattr(sys.modules[__name__], "TIMEOUT", 5)
    log = tmp_path / "log"

    def step(name: str, after: set[int], processes: int = 1, then: str = "true") -> Step:
        script = f"echo start {name} >> {log}; sleep 0.3; echo end {name} >> {log}; {then}"
        return Step(name, script, processes, after)

    steps = [
        step("a", set()),
        step("b", set()),
        step("c", {0}, then="echo the tail of c; exit 3"),
        step("d", set(), processes=2),
        step("e", {3}),
        step("f", set(), then="echo Traceback here"),
        step("g", {2, 5}),
        step("h", set(), then="sleep 60 & sleep 60"),
    ]
    failures = run_steps(steps, tmp_path, dict(os.environ))
    assert len(failures) == 3
    assert failures[0].startswith("c\n  exit 3: ") and failures[0].endswith("the tail of c\n")
    assert failures[1].startswith("f\n  exit 0: ") and "Traceback here" in failures[1]
    assert failures[2].startswith("h\n  killed after 5 s: ")
    running, ended = set(), set()
    for line in log.read_text().splitlines():
        event, name = line.split()
        i = "abcdefgh".index(name)
        if event == "start":
            assert all(j in ended for j in steps[i].after), (name, ended)
            running.add(i)
            assert len(running) <= LANES and (len(running) == 1 or all(steps[j].processes == 1 for j in running))
        else:
            running.remove(i)
            ended.add(i)
    assert len(ended) == len(steps)
