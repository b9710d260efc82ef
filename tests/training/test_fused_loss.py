"""The trainer's `loss_kernel`: the loss from the hidden states and the head (`HeadLoss` as the model's
`loss_from_hidden_states`, `hf_p2r.ops.linear_cross_entropy`) equals the plain path's (logits, then transformers'
loss) in loss and gradients, with no tokens x vocab tensor, through the model's forward (DDP, FSDP2), for tied heads,
MoE's aux loss and `num_items_in_batch`, and through the trainer.

Tolerances: fp32, the chunked path sums the same terms in another order (rtol 1e-5, atol 1e-6).
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_p2r.models.p2r import P2RConfig, P2RMoeConfig
from hf_p2r.ops import HeadLoss
from hf_p2r.training import parse_config, train
from hf_p2r.training.metrics import read_metrics

from ..distributed import spawn
from .helpers import loss_and_grads, tiny_argv

SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=2)
CLOSE = dict(rtol=1e-5, atol=1e-6)


def tiny_model(moe=False, tied=False, seed=0):
    torch.manual_seed(seed)
    config_class = P2RMoeConfig if moe else P2RConfig
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if moe else {}
    return AutoModelForCausalLM.from_config(config_class(**SHAPE, **extra, tie_word_embeddings=tied)).train()


def assert_same(fused, plain):
    (outputs, grads), (expected, expected_grads) = fused, plain
    torch.testing.assert_close(outputs.loss, expected.loss, **CLOSE)
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], **CLOSE)


@pytest.mark.parametrize(
    ("moe", "tied", "kwargs"),
    [
        (False, False, {}),
        (False, True, {}),
        (False, False, {"num_items_in_batch": torch.tensor(300)}),  # a sum over micro-batches of 300 tokens
        (True, False, {"output_router_logits": True}),
    ],
    ids=["dense", "tied-head", "num_items_in_batch", "moe-aux-loss"],
)
def test_the_loss_from_hidden_states_equals_the_plain_loss_and_gradients(moe, tied, kwargs):
    model, ids = tiny_model(moe=moe, tied=tied), torch.randint(0, 256, (3, 24))
    fused = copy.deepcopy(model)
    fused.loss_from_hidden_states = HeadLoss("chunked")
    result, expected = loss_and_grads(fused, ids, **kwargs), loss_and_grads(model, ids, **kwargs)
    assert_same(result, expected)
    assert result[0].logits is None and expected[0].logits.shape == (3, 24, 256)
    if moe:
        assert result[0].aux_loss is not None
        torch.testing.assert_close(result[0].aux_loss, expected[0].aux_loss, **CLOSE)
    if tied:
        assert "model.embed_tokens.weight" in result[1] and "lm_head.weight" not in result[1]


class LargestTensors(torch.overrides.TorchFunctionMode):
    """Every tensor a torch function returns from Python in the forward and backward of the loss, by size; and,
    through saved-tensor hooks, every tensor autograd saves for the backward."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, tuple | list) else (result,):
            if isinstance(value, torch.Tensor):
                self.shapes.append(tuple(value.shape))
        return result

    def saved(self, tensor):
        self.shapes.append(tuple(tensor.shape))
        return tensor


@pytest.mark.parametrize("kernel", ["plain", "chunked"])
def test_the_chunked_loss_never_creates_a_tokens_by_vocab_tensor(kernel):
    """96 tokens x 256 words: the plain path's logits have 24,576 entries; the chunked path's largest tensor with a
    vocabulary dimension is one chunk's logits (32 tokens, the hidden size) or the head's weight (256 x 32)."""
    model, ids = tiny_model(), torch.randint(0, 256, (4, 24))
    if kernel == "chunked":
        model.loss_from_hidden_states = HeadLoss("chunked")
    seen = LargestTensors()
    with seen, torch.autograd.graph.saved_tensors_hooks(seen.saved, lambda tensor: tensor):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    tokens, vocab = ids.numel(), 256
    with_vocab = [shape for shape in seen.shapes if vocab in shape]
    largest = max(torch.Size(shape).numel() for shape in with_vocab)
    if kernel == "plain":
        assert largest >= tokens * vocab  # the measure sees the logits where they exist
    else:
        assert largest == 32 * vocab < tokens * vocab


def ddp_and_fsdp2_fused_vs_plain(rank: int, world_size: int) -> dict:
    """Each process takes its half of a batch; DDP's and FSDP2's gradients of the fused loss against the plain
    loss's gradients of the whole batch (the mean of the two halves' losses) computed in one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from hf_p2r.distributed import fully_shard_p2r

    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(1))
    mine = ids.chunk(world_size)[rank]
    reference = tiny_model(moe=True, tied=True)
    losses = [reference(input_ids=half, labels=half, use_cache=False).loss for half in ids.chunk(world_size)]
    (sum(losses) / world_size).backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    worst = {}
    for wrap in ("ddp", "fsdp2"):
        model = tiny_model(moe=True, tied=True)
        model.loss_from_hidden_states = HeadLoss("chunked")
        if wrap == "ddp":
            wrapped = DistributedDataParallel(model)
        else:
            wrapped = fully_shard_p2r(model, mesh=init_device_mesh("cpu", (world_size,)))
        wrapped(input_ids=mine, labels=mine, use_cache=False).loss.backward()
        differences = []
        for name, param in model.named_parameters():
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            differences.append(((grad - expected[name]).abs().max() / expected[name].abs().max()).item())
        worst[wrap] = max(differences)
    return worst


def test_ddp_and_fsdp2_run_the_fused_loss_inside_the_wrapped_forward(tmp_path):
    """Tied head, MoE: the gradients DDP averages and FSDP2 reduce-scatters equal the plain whole-batch gradients."""
    worst = spawn.run(ddp_and_fsdp2_fused_vs_plain, 2, tmp_path)
    assert worst["ddp"] < 1e-5 and worst["fsdp2"] < 1e-5


SCHEDULE = dict(pseudo_steps=3, real_steps=2, eval_steps=2, gradient_accumulation_steps=2)


@pytest.mark.parametrize(
    "extra",
    [{"tie_word_embeddings": "true"}, {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}],
    ids=["tied", "moe"],
)
def test_the_trainer_with_the_chunked_loss_follows_the_plain_run(tmp_path, monkeypatch, extra):
    """Loss, gradient norm and validation loss at every step, through the delink, with gradient accumulation."""
    calls = []
    call = HeadLoss.__call__
    monkeypatch.setattr(
        HeadLoss, "__call__", lambda self, *args, **kwargs: calls.append(1) or call(self, *args, **kwargs)
    )
    runs = {}
    for kernel in ("plain", "chunked"):
        assert train(parse_config(tiny_argv(tmp_path / kernel, **SCHEDULE, **extra, loss_kernel=kernel))) == 0
        runs[kernel] = read_metrics(tmp_path / kernel / "metrics.jsonl")
    # Every forward: 5 steps x 2 micro-batches, and 5 evaluations (steps 0, 2, 3: the delink, 4, 5) of 2 batches.
    assert len(calls) == 20
    for key in ("loss", "grad_norm", "val_loss"):
        got, want = ([r[key] for r in runs[kernel] if key in r] for kernel in ("chunked", "plain"))
        assert len(got) == len(want) >= 2
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0.0)


def test_liger_on_a_cpu_run_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="^loss_kernel: liger runs on CUDA"):
        train(parse_config(tiny_argv(tmp_path / "run", **SCHEDULE, loss_kernel="liger")))
