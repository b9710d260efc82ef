"""DeepSpeed is imported only by a run that uses it (issue 37: its import takes seconds and logs "Setting accelerator
to CPU" into the progress bar of every run): not by importing `hf_p2r.distributed` and every name it exports, nor by a
plain training run, checked in a fresh process (one for the three checks, in that order). Accelerate's unwrapping
would import it whenever it is installed (the control below, in a process of its own);
`compat.import_deepspeed_only_when_used` stops that until DeepSpeed is imported.

Skipped where DeepSpeed is not installed: nothing could import it there.
"""

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

import hf_p2r.distributed as distributed

from ..training.helpers import PYTHON, REPO, subprocess_env, tiny_argv

# The compatibility pass runs these too (Makefile COMPAT_TESTS): Accelerate's unwrapping changes with its version.
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"),
    pytest.mark.versions,
]


def run_python(code: str, timeout: int = 600) -> dict:
    """Run `code` in a fresh interpreter; returns the JSON it prints last."""
    done = subprocess.run(
        [PYTHON, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> dict:
    """One fresh interpreter, in this order: what importing `hf_p2r.distributed` and every name it exports imports,
    then what a plain training run (evaluating, saving, delinking) imports, then Accelerate's unwrapping with the
    compat shim, before and after DeepSpeed is imported. Each check sees only what ran before it: the imports first
    (nothing else imported yet), the run after imports that do not load DeepSpeed."""
    output_dir = tmp_path_factory.mktemp("plain") / "run"
    argv = tiny_argv(str(output_dir), pseudo_steps=1, real_steps=1, eval_steps=1, save_steps=1)
    found = run_python(
        "import json, sys\n"
        "import hf_p2r.distributed as distributed\n"
        "names = [getattr(distributed, name) for name in distributed.__all__]\n"
        "import hf_p2r.distributed.deepspeed, hf_p2r.distributed.pipeline.delink, hf_p2r.training.engines\n"
        "imports = {'names': len(names), 'deepspeed': 'deepspeed' in sys.modules}\n"
        "from hf_p2r.training import parse_config, train\n"
        f"status = train(parse_config({argv!r}))\n"
        "run = {'status': status, 'deepspeed': 'deepspeed' in sys.modules}\n"
        "import torch\n"
        "from accelerate.utils import extract_model_from_parallel\n"
        "from hf_p2r.compat import import_deepspeed_only_when_used\n"
        "module = torch.nn.Linear(1, 1)\n"
        "import_deepspeed_only_when_used(); import_deepspeed_only_when_used()\n"
        "extract_model_from_parallel(module)\n"
        "unimported = 'deepspeed' not in sys.modules\n"
        "import deepspeed\n"
        "engine = deepspeed.DeepSpeedEngine.__new__(deepspeed.DeepSpeedEngine)\n"
        "torch.nn.Module.__init__(engine); engine.__dict__['module'] = module\n"  # where DeepSpeed's engine keeps it
        "unwrap = {'unimported': unimported, 'unwrapped': extract_model_from_parallel(engine) is module}\n"
        "print(json.dumps({'imports': imports, 'run': run, 'unwrap': unwrap}))\n"
    )
    return found | {"output_dir": str(output_dir)}


def test_importing_hf_p2r_distributed_and_its_names_does_not_import_deepspeed(fresh):
    assert fresh["imports"] == {"names": len(distributed.__all__), "deepspeed": False}


def test_accelerates_unwrapping_imports_deepspeed_only_once_it_is_imported(fresh):
    assert fresh["unwrap"] == {"unimported": True, "unwrapped": True}  # and a DeepSpeed engine is still unwrapped
    # afterwards. The control, in an interpreter of its own: without the shim, Accelerate's unwrapping imports
    # DeepSpeed (the day this fails, drop the compat shim).
    control = run_python(
        "import json, sys, torch\n"
        "from accelerate.utils import extract_model_from_parallel\n"
        "extract_model_from_parallel(torch.nn.Linear(1, 1))\n"
        "print(json.dumps('deepspeed' in sys.modules))\n"
    )
    assert control is True


def test_a_plain_training_run_does_not_import_deepspeed(fresh):
    assert fresh["run"] == {"status": 0, "deepspeed": False}
    assert (Path(fresh["output_dir"]) / "real" / "config.json").is_file()  # the run evaluated, saved and delinked
