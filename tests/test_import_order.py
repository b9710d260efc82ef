"""`import hf_p2r` before or after transformers, in every order users write, each in a fresh process.

P2R's Auto registration once ran inside transformers' own import (`import hf_p2r; from transformers import
AutoModelForCausalLM` and `... import pipeline` failed with circular-import errors). Each case below imports
hf_p2r first or second around one transformers import, then uses the Auto classes on P2R (config, base model,
causal LM, save and load, the MoE sibling). .ci/run's compatibility pass runs this file on the declared floors and on
the newest releases.
"""

import os
import subprocess
import sys

import pytest

from .tiers import time_factor

# The compatibility pass (Makefile COMPAT_TESTS) runs this file on the declared floors and the newest releases too:
# whether registering P2R's Auto classes survives each transformers' import graph.
pytestmark = pytest.mark.versions

IMPORTS = {
    "AutoConfig": "from transformers import AutoConfig",
    "AutoModel": "from transformers import AutoModel",
    "AutoModelForCausalLM": "from transformers import AutoModelForCausalLM",
    "pipeline": "from transformers import pipeline",
    "LlamaForCausalLM": "from transformers import LlamaForCausalLM",
    "transformers": "import transformers; transformers.AutoModelForCausalLM",
}
ORDERS = ("hf_p2r first", "hf_p2r second")

USE = """
import tempfile
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
shape = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2)
config = AutoConfig.for_model("p2r", share_layers=True, **shape)
model = AutoModelForCausalLM.from_config(config)
folder = tempfile.mkdtemp()
model.save_pretrained(folder)
loaded = AutoModelForCausalLM.from_pretrained(folder)
moe = AutoConfig.for_model("p2r_moe", num_experts=2, num_experts_per_tok=1, **shape)
print(type(config).__name__, type(AutoModel.from_config(config)).__name__, type(model).__name__,
      type(loaded).__name__, loaded.config.num_unique_layers, type(AutoModelForCausalLM.from_config(moe)).__name__)
"""
EXPECTED = "P2RConfig P2RModel P2RForCausalLM P2RForCausalLM 1 P2RMoeForCausalLM"


def _script(order: str, statement: str) -> str:
    first, second = ("import hf_p2r", statement) if order == ORDERS[0] else (statement, "import hf_p2r")
    return f"{first}\n{second}\n{USE}"


class Cases:
    """The cases' processes, as many at a time as there are cores, in the tests' order; `cases(case)` waits for one
    (starting it first if it is not yet) and starts the next. Each is import-bound (~11 CPU s): all twelve started at
    once share the cores twelve ways, and on this 2-core machine at a load average of ~20 the first one waited for ran
    past its 300 s timeout (twice)."""

    def __init__(self, scripts: dict, env: dict):
        self.pending, self.running, self.finished, self.env = dict(scripts), {}, {}, env
        self.at_once = os.cpu_count() or 1
        self.fill()

    def start(self, case) -> None:
        command = [sys.executable, "-c", self.pending.pop(case)]
        self.running[case] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                              env=self.env)  # fmt: skip

    def fill(self) -> None:
        while self.pending and len(self.running) < self.at_once:
            self.start(next(iter(self.pending)))

    def __call__(self, case) -> tuple[str, str]:
        if case not in self.finished:
            if case in self.pending:
                self.start(case)
            self.finished[case] = self.running.pop(case).communicate(timeout=300 * time_factor())
            self.fill()
        return self.finished[case]

    def close(self) -> None:
        for process in self.running.values():
            process.kill()
            process.communicate()


@pytest.fixture(scope="module")
def runs():
    """Every (order, import) case in its own process; each finished on first use."""
    env = dict(os.environ, HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error")
    # In the tests' order (by import, then by order), so that the processes running are the next ones waited for.
    cases = Cases(
        {(order, name): _script(order, statement) for name, statement in IMPORTS.items() for order in ORDERS}, env
    )
    yield cases
    cases.close()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", IMPORTS)
def test_auto_classes_find_p2r_in_every_import_order(runs, order, name):
    out, err = runs((order, name))
    assert "Traceback" not in err, err
    assert out.strip().splitlines()[-1] == EXPECTED


def test_import_hf_p2r_imports_neither_torch_nor_transformers():
    code = "import sys, hf_p2r; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == "[]"


def test_register_auto_classes_after_the_deferred_entries_is_idempotent():
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_p2r
    from hf_p2r import P2RConfig, P2RForCausalLM, P2RMoeConfig, P2RMoeForCausalLM

    hf_p2r.register_auto_classes()
    hf_p2r.register_auto_classes()
    config = AutoConfig.for_model("p2r", vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2)
    assert type(config) is P2RConfig
    assert AutoModelForCausalLM._model_mapping[P2RConfig] is P2RForCausalLM
    assert AutoModelForCausalLM._model_mapping[P2RMoeConfig] is P2RMoeForCausalLM
    assert P2RConfig in AutoModelForCausalLM._model_mapping.keys()
