import hashlib
import os
import subprocess
import sys
from pathlib import Path

# Tests never touch the network: set before transformers / huggingface_hub are imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# DeepSpeed runs on CPU here: named, its accelerator is not detected, which logs a warning to stdout in whichever test
# first asks for it (a command's stdout that a test reads whole, once another test of the process imported DeepSpeed).
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import platform  # noqa: E402

# The processor's name, which `platform` reads from `uname -p` once per process, read now, before tests/tiers.py
# watches the tests for processes they start (a benchmark's machine line would be the first to read it).
platform.processor()

import pytest  # noqa: E402
import torch  # noqa: E402

import hf_p2r  # noqa: E402,F401  (registers the Auto classes)

from .tiers import load_hypothesis_profile, pytest_configure  # noqa: E402,F401  (`make test` / `make test-all`)
from .tiny import tiny_config, tiny_model  # noqa: E402,F401  (the tests import them from here)

load_hypothesis_profile()  # before the test modules build their settings (tests/tiers.py)

# DeepSpeed's C++ ops (the shm op of its CPU collectives) are built by torch.utils.cpp_extension into one folder per
# Python version whatever the torch, and a process that finds a build under way waits for it and loads it: two venvs'
# test runs side by side (`make -j2 compat`) could load each other's build. One folder per venv and torch (the
# processes the tests start inherit it).
_venv = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions" / f"hf-p2r-{torch.__version__}-{_venv}")
)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Every test on one intra-op thread. Tiny models gain nothing from more, and where another process shares the
    cores (`make -j2 compat` runs two test processes on two cores) each op's threads spin-wait for each other: a
    12-token generate() took 23 s instead of 0.25 s. The processes the tests start get one thread too (they inherit
    OMP_NUM_THREADS): a remote-code folder's MoE logits in a subprocess equal this process's bitwise only at the same
    thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate's process-wide state forgotten after every test, so a test sees the same state whatever ran before
    it in its process (pytest-xdist sends tests to its workers in no fixed order). Accelerate keeps the first
    Accelerator's settings in shared singletons: after TRL's SFTTrainer run in bf16 (tests/integrations/test_trl.py),
    test_parity's P2RTrainer inherited bf16 and its losses differed from hf-p2r's own trainer by 5e-4."""
    yield
    if "accelerate.state" in sys.modules:  # no import where no test used Accelerate
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _build_deepspeed_ops(*builders: str) -> None:
    """DeepSpeed's C++ ops built into this venv's TORCH_EXTENSIONS_DIR (above), in a fresh process. On a fresh machine a
    build takes minutes, more than the few minutes a test allows each launch it starts; built, a process loads an op
    in a second.

    One build at a time across processes (pytest-xdist's workers each set up this session fixture), under a file lock
    the kernel releases when its holder dies. torch's own build lock is a plain file (`<op>/lock`) that a build killed
    part-way leaves behind, and every later build then waits on it forever: a CI run's builds hung 1500 s in both
    workers. Every build of the tests' ops runs here, under the file lock, so a `lock` found while holding it is such a
    leftover, and is removed."""
    from filelock import FileLock

    from .training.helpers import PYTHON, subprocess_env

    root = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(root / "hf-p2r-tests-build.lock", timeout=1500):
        for leftover in root.glob("*/lock"):
            leftover.unlink(missing_ok=True)
        build = "from deepspeed.accelerator import get_accelerator\n" + "".join(
            f"get_accelerator().create_op_builder({name!r}).load()\n" for name in builders
        )
        done = subprocess.run([PYTHON, "-c", build], env=subprocess_env(), capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, f"building DeepSpeed's ops {builders} failed:\n{done.stderr[-3000:]}"


@pytest.fixture(scope="session")
def deepspeed_ops():
    """The op every DeepSpeed process of a CPU run loads: its shared-memory collectives (124 CPU s to build)."""
    _build_deepspeed_ops("ShareMemCommBuilder")


@pytest.fixture(scope="session")
def deepspeed_offload_ops(deepspeed_ops):
    """And the CPU Adam that Accelerate's ZeRO-Offload plugin maps AdamW to (configs/accelerate/
    deepspeed_zero3_offload.*; 232 CPU s to build)."""
    _build_deepspeed_ops("CPUAdamBuilder")


@pytest.fixture
def input_ids() -> torch.Tensor:
    return torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(1))


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
