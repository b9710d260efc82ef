"""The planner counts `optimizer: muon`'s state: one buffer per element of a block's matrix (3-D experts too), no step
counter, AdamW's two moments elsewhere, byte for byte against the tensors MuonAdamW allocates."""

import pytest
import torch

from hf_p2r.errors import InputError
from hf_p2r.planning import PRECISIONS, Layout, model_state_bytes, parameter_tensors
from hf_p2r.planning.plan import Workload
from hf_p2r.training import TrainArguments
from hf_p2r.training.optim import build_optimizer

from ..conftest import tiny_model
from ..models.test_modeling_p2r_moe import moe_model
from .test_memory import MODELS, measured_model_states

MODELS_AND_MOE = [*MODELS, "moe"]


@pytest.mark.parametrize("name", MODELS_AND_MOE)
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_muon_state_bytes_match_allocated_tensors(name, dtype, precision):
    model = (moe_model() if name == "moe" else tiny_model(**MODELS[name])).to(dtype).train()
    optimizer = build_optimizer(model, TrainArguments(optimizer="muon"))
    ids = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()

    tensors = parameter_tensors(model.config)
    estimate = model_state_bytes(tensors, Layout(dp=1), PRECISIONS[precision], optimizer="muon")
    assert (estimate.weights, estimate.grads, estimate.optimizer) == measured_model_states(model, optimizer)
    adamw = model_state_bytes(tensors, Layout(dp=1), PRECISIONS[precision])
    assert estimate.optimizer < adamw.optimizer  # control: the two optimizers are sized differently


def test_the_workload_names_a_bad_optimizer():
    with pytest.raises(InputError, match=r"^optimizer: 'sgd' is not one of adamw, muon"):
        Workload(seq_len=16, micro_batch=1, global_batch=1, precision=PRECISIONS["mixed"], optimizer="sgd")
