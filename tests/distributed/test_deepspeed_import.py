"""DeepSpeed is imported only by a run that uses it (issue 37: its import takes seconds and logs "Setting accelerator
to CPU" into the progress bar of every run): not by importing `hf_p2r.distributed` and every name it exports, nor by a
plain training run, each checked in a fresh process. Accelerate's unwrapping would import it whenever it is installed
(the control below); `compat.import_deepspeed_only_when_used` stops that until DeepSpeed is imported.

Skipped where DeepSpeed is not installed: nothing could import it there.
"""

import importlib.util
import json
import subprocess

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


def test_importing_hf_p2r_distributed_and_its_names_does_not_import_deepspeed():
    found = run_python(
        "import json, sys\n"
        "import hf_p2r.distributed as distributed\n"
        "names = [getattr(distributed, name) for name in distributed.__all__]\n"
        "import hf_p2r.distributed.deepspeed, hf_p2r.distributed.pipeline.delink, hf_p2r.training.engines\n"
        "print(json.dumps({'names': len(names), 'deepspeed': 'deepspeed' in sys.modules}))\n"
    )
    assert found == {"names": len(distributed.__all__), "deepspeed": False}


def test_accelerates_unwrapping_imports_deepspeed_only_once_it_is_imported():
    found = run_python(
        "import json, sys, torch\n"
        "from accelerate.utils import extract_model_from_parallel\n"
        "from hf_p2r.compat import import_deepspeed_only_when_used\n"
        "module = torch.nn.Linear(1, 1)\n"
        "import_deepspeed_only_when_used(); import_deepspeed_only_when_used()\n"
        "extract_model_from_parallel(module)\n"
        "unimported = 'deepspeed' not in sys.modules\n"
        "import deepspeed\n"
        "engine = deepspeed.DeepSpeedEngine.__new__(deepspeed.DeepSpeedEngine)\n"
        "torch.nn.Module.__init__(engine); engine.module = module\n"
        "print(json.dumps({'unimported': unimported, 'unwrapped': extract_model_from_parallel(engine) is module}))\n"
    )
    assert found == {"unimported": True, "unwrapped": True}  # and a DeepSpeed engine is still unwrapped afterwards
    # The control: without it, Accelerate's unwrapping imports DeepSpeed (the day this fails, drop the compat shim).
    control = run_python(
        "import json, sys, torch\n"
        "from accelerate.utils import extract_model_from_parallel\n"
        "extract_model_from_parallel(torch.nn.Linear(1, 1))\n"
        "print(json.dumps('deepspeed' in sys.modules))\n"
    )
    assert control is True


def test_a_plain_training_run_does_not_import_deepspeed(tmp_path):
    argv = tiny_argv(str(tmp_path / "run"), pseudo_steps=1, real_steps=1, eval_steps=1, save_steps=1)
    found = run_python(
        "import json, sys\n"
        "from hf_p2r.training import parse_config, train\n"
        f"status = train(parse_config({argv!r}))\n"
        "print(json.dumps({'status': status, 'deepspeed': 'deepspeed' in sys.modules}))\n"
    )
    assert found == {"status": 0, "deepspeed": False}
    assert (tmp_path / "run" / "real" / "config.json").is_file()  # the run evaluated, saved and delinked
