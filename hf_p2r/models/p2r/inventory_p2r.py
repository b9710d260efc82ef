"""A P2R model's tensors and what they cost, from its config alone: the one inventory the converter, the planner and
the pipeline split read. Plain Python, no torch and no transformers (like `sharing_p2r`).

`inventory(config, num_blocks=None)` takes a config as a dict (config.json as `read_p2r_config_dict` returns it, or
`P2RConfig.to_dict()`; a config object is turned into one) and lists the model's pieces in the order the model holds
them: the embeddings, each stored block (`num_blocks` of them; default the config's own), and the head (final norm and
`lm_head`; with tied embeddings the norm only, the logits still computed). Each piece lists its tensors (`Tensor`:
the name and shape `named_parameters()` gives, and the names and shapes `save_pretrained` writes where they differ:
a sparse layer's 3-D experts are one tensor per expert and projection on disk, under Mixtral's names).

Costs, per token (PaLM's count, the one the planner and the trainer's pipeline split use):
- training FLOPs: 6 per element of a matrix product's weight that the token uses (forward 2, backward 4): all of the
  attention and dense MLP projections and the router, `num_experts_per_tok / num_experts` of a sparse layer's experts,
  nothing for norms, biases and the embedding lookup (`Piece.flops`); the head's `6 * hidden * vocab` whether tied or
  not; plus, per depth, `12 * seq_len * q` for the attention scores (q = heads x head_dim: `hidden_size` for most
  models), which `Inventory.depth_flops(depth, seq_len)` adds;
- memory: every parameter, all the experts included (`Piece.numel`; `active_numel` is the share one token computes
  with). Bytes are the caller's: numel times its bytes per parameter.

API, for the converter, the planner and the pipeline split:

```python
>>> from hf_p2r.models.p2r.inventory_p2r import inventory
>>> inv = inventory(read_p2r_config_dict("pseudo_1x24"))     # or inventory(P2RConfig(...)), or (config, num_blocks)
>>> inv.pieces                    # (embeddings, block 0, ..., block k-1, head): `Piece`s in the model's order
>>> inv.blocks[b].numel, inv.blocks[b].flops                  # a stored block: parameters, matmul FLOPs per token
>>> inv.depth_flops(depth, seq_len)                           # one depth: its block's FLOPs + attention scores
>>> inv.block_of_depth                                        # which stored block each depth runs
>>> inv.numel, inv.active_numel                               # parameters stored; those one token computes with
>>> inv.shapes()                  # {name: shape}, as named_parameters() gives them (tied ones once)
>>> inv.disk_shapes()             # {name: shape}, as save_pretrained writes them, in its order
>>> inv.disk_count                # len(inv.disk_shapes()), counted without building it
```

A pipeline stage running depths [start, end) costs `sum(inv.depth_flops(d, seq_len) for d in range(start, end))`
FLOPs per token (plus `inv.embeddings.flops` on the first stage, `inv.head.flops` on the last) and holds
`inv.blocks[b].numel` parameters for each distinct block b its depths run (plus `inv.embeddings.numel` first and
`inv.head.numel` last; a tied head keeps its own copy of the embeddings on the last stage, as Megatron does).

The depth is the one the model runs (`num_hidden_layers`): a shallow stage of depth growth (d < L) costs its d depths,
`inventory(stage_config).flops(seq_len)` per token, and a run's FLOPs are the sum over its steps of tokens x the
`flops(seq_len)` of the model that ran them (the one formula for the trainer, the planner and the GPU report's MFU;
tests/models/test_growth.py checks it against torch's `FlopCounterMode` on forward + backward). The inventory of a
stage the config is not yet at (the planner's next stage) is that of the config a delink or growth would give:
`inventory({**config_dict, **plan_delink(config, k, num_hidden_layers=d).fields})`.

tests/models/test_inventory_p2r.py holds the names, shapes and order equal to the model built on the meta device
(dense and MoE, pseudo and real, tied and untied, with biases) and the on-disk names to what `save_pretrained` writes.
"""

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from math import prod

from .sharing_p2r import block_of_depth, sparse_depths

# config.json fields that decide the weights' names and shapes, with `P2RConfig`'s defaults (Llama's).
SHAPE_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_key_value_heads": None,  # num_attention_heads
    "head_dim": None,  # hidden_size // num_attention_heads
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
}
LAYOUT_DEFAULTS = {
    "share_layers": False,
    "num_unique_layers": None,
    "sharing_pattern": "cycle",
    "real_num_hidden_layers": None,  # num_hidden_layers: the model runs its real depth
    "depth_mup": False,
}
DEPTH_DEFAULT = 32  # `P2RConfig`'s num_hidden_layers (Llama's)
# The MoE fields of a `p2r_moe` config.json, with `P2RMoeConfig`'s defaults (None: `intermediate_size`, and no dense
# depths).
MOE_DEFAULTS = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": None,
    "decoder_sparse_step": 1,
    "mlp_only_layers": None,
    "norm_topk_prob": True,
    "num_expert_groups": 1,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
}
MOE_MODEL_TYPE = "p2r_moe"
FLOPS_PER_MATMUL_PARAMETER = 6  # per token in training: 2 forward, 4 backward
ATTENTION_SCORE_FLOPS = 12  # per token, per depth, per key and per query dimension: QK^T and AV, forward + backward


@dataclass(frozen=True)
class Tensor:
    """One parameter: its name and shape in memory, what one token does with it, and how it is stored on disk."""

    name: str  # as `named_parameters()` gives it
    shape: tuple[int, ...]
    matmul: bool = False  # a matrix product's weight: `FLOPS_PER_MATMUL_PARAMETER` per element a token uses
    routed: float = 1.0  # share of it one token uses: `num_experts_per_tok / num_experts` for experts, else all
    # On disk, when not under `name` and `shape`: (name, shape) pairs, "{e}" in a name standing for each expert.
    disk: tuple[tuple[str, tuple[int, ...]], ...] | None = None
    experts: int = 0  # how many experts "{e}" runs over

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def active_numel(self) -> float:
        return self.numel * self.routed

    def on_disk(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of each tensor `save_pretrained` writes for this parameter, in its order."""
        if self.disk is None:
            return [(self.name, self.shape)]
        return [
            (pattern.format(e=expert), shape)
            for pattern, shape in self.disk
            for expert in (range(self.experts) if "{e}" in pattern else (0,))
        ]

    @property
    def disk_count(self) -> int:
        if self.disk is None:
            return 1
        return sum(self.experts if "{e}" in pattern else 1 for pattern, _ in self.disk)


class _Totals:
    """Parameters (all, and those one token uses) and tensors on disk, summed over the parts of a whole once (a
    split's search asks for them many times)."""

    def _parts(self):  # a piece's tensors, a model's pieces
        raise NotImplementedError

    @cached_property
    def numel(self) -> int:
        return sum(part.numel for part in self._parts())

    @cached_property
    def active_numel(self) -> float:
        return sum(part.active_numel for part in self._parts())

    @cached_property
    def disk_count(self) -> int:
        """How many tensors `save_pretrained` writes (a MoE layer's experts one per expert and projection)."""
        return sum(part.disk_count for part in self._parts())


@dataclass(frozen=True)
class Piece(_Totals):
    """A part of the model a pipeline stage holds whole: the embeddings, one stored block, or the head."""

    name: str  # "embeddings", "block <b>", "head"
    block: int | None  # the stored block, None for the embeddings and the head
    tensors: tuple[Tensor, ...]
    flops: float  # training FLOPs per token of one run (matrix products only; a depth adds its attention scores)
    sparse: bool = False  # a MoE block with a router and experts

    def _parts(self) -> tuple[Tensor, ...]:
        return self.tensors


@dataclass(frozen=True)
class Inventory(_Totals):
    """The pieces of one model (see the module docstring)."""

    embeddings: Piece
    blocks: tuple[Piece, ...]
    head: Piece
    block_of_depth: tuple[int, ...]
    attention_width: int  # q = num_attention_heads x head_dim
    tie_word_embeddings: bool
    moe: bool  # MoE: save_pretrained sorts the names (transformers' reverse conversion)

    @property
    def pieces(self) -> tuple[Piece, ...]:
        return (self.embeddings, *self.blocks, self.head)

    def _parts(self) -> tuple[Piece, ...]:
        return self.pieces

    def tensors(self) -> Iterator[Tensor]:
        """Every parameter, in `named_parameters()` order (tied ones once)."""
        for piece in self.pieces:
            yield from piece.tensors

    def attention_flops(self, seq_len: int) -> float:
        """Training FLOPs per token of one depth's attention scores over `seq_len` tokens."""
        return float(ATTENTION_SCORE_FLOPS * seq_len * self.attention_width)

    def depth_flops(self, depth: int, seq_len: int) -> float:
        """Training FLOPs per token of depth `depth`: its block's matrix products and its attention scores."""
        return self.blocks[self.block_of_depth[depth]].flops + self.attention_flops(seq_len)

    def flops(self, seq_len: int) -> float:
        """Training FLOPs per token of the whole model (every depth, the head)."""
        layers = sum(self.blocks[block].flops for block in self.block_of_depth)
        return layers + len(self.block_of_depth) * self.attention_flops(seq_len) + self.head.flops

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """{name: shape} as `named_parameters()` gives them."""
        return {t.name: t.shape for t in self.tensors()}

    def disk_shapes(self) -> dict[str, tuple[int, ...]]:
        """{name: shape} of the tensors `save_pretrained` writes, in its order: the model's for a dense model; for a
        MoE model, transformers' reverse conversion sorts the state dict by name (numbers as numbers) and writes each
        sparse layer's 3-D experts as one tensor per expert and projection (w1, then w3, of `gate_up_proj`)."""
        tensors = list(self.tensors())
        if self.moe:
            tensors.sort(key=lambda t: natural_key(t.name))
        return {name: shape for t in tensors for name, shape in t.on_disk()}


def inventory(config, num_blocks: int | None = None) -> Inventory:
    """The `Inventory` of the model `config` describes (a dict: config.json, `P2RConfig.to_dict()`; or a config
    object, read through its `to_dict()`), with `num_blocks` stored blocks (default: the config's own, k for a pseudo
    model, L for a real one). Fields left out take `P2RConfig`'s (`P2RMoeConfig`'s) defaults; the sizes are expected
    valid (`validate_layout`, `validate_moe` have checked them)."""
    if not isinstance(config, Mapping):
        config = config.to_dict()
    c = {**SHAPE_DEFAULTS, **LAYOUT_DEFAULTS, **config}
    depth = c.get("num_hidden_layers", DEPTH_DEFAULT)
    if num_blocks is None:
        num_blocks = (c["num_unique_layers"] or 1) if c["share_layers"] else depth
    hidden, heads, vocab = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    head_dim = c["head_dim"] or hidden // heads
    q, kv = heads * head_dim, (c["num_key_value_heads"] or heads) * head_dim
    order = tuple(block_of_depth(depth, num_blocks, c["sharing_pattern"] or "cycle"))
    moe = c.get("model_type") == MOE_MODEL_TYPE
    sparse = [False] * num_blocks
    if moe:
        m = {**MOE_DEFAULTS, **{key: c[key] for key in MOE_DEFAULTS if key in c}}
        m["moe_intermediate_size"] = m["moe_intermediate_size"] or c["intermediate_size"]
        for d, is_sparse in enumerate(sparse_depths(depth, m["decoder_sparse_step"], m["mlp_only_layers"] or [])):
            sparse[order[d]] = is_sparse  # the depths of a block agree (`validate_moe`)

    def linear(name: str, rows: int, columns: int, bias: bool) -> list[Tensor]:
        weight = Tensor(f"{name}.weight", (rows, columns), matmul=True)
        return [weight, Tensor(f"{name}.bias", (rows,))] if bias else [weight]

    def block(b: int) -> Piece:
        prefix = f"model.layers.{b}."
        tensors = [
            *linear(f"{prefix}self_attn.q_proj", q, hidden, c["attention_bias"]),
            *linear(f"{prefix}self_attn.k_proj", kv, hidden, c["attention_bias"]),
            *linear(f"{prefix}self_attn.v_proj", kv, hidden, c["attention_bias"]),
            *linear(f"{prefix}self_attn.o_proj", hidden, q, c["attention_bias"]),
        ]
        if sparse[b]:
            tensors += _sparse_mlp(prefix, hidden, m)
        else:
            size = c["intermediate_size"]
            tensors += [
                *linear(f"{prefix}mlp.gate_proj", size, hidden, c["mlp_bias"]),
                *linear(f"{prefix}mlp.up_proj", size, hidden, c["mlp_bias"]),
                *linear(f"{prefix}mlp.down_proj", hidden, size, c["mlp_bias"]),
            ]
        tensors += [Tensor(f"{prefix}input_layernorm.weight", (hidden,))]
        tensors += [Tensor(f"{prefix}post_attention_layernorm.weight", (hidden,))]
        return Piece(f"block {b}", b, tuple(tensors), _matmul_flops(tensors), sparse=sparse[b])

    tied = c["tie_word_embeddings"]
    head = [Tensor("model.norm.weight", (hidden,))]
    head += [] if tied else [Tensor("lm_head.weight", (vocab, hidden), matmul=True)]
    return Inventory(
        embeddings=Piece("embeddings", None, (Tensor("model.embed_tokens.weight", (vocab, hidden)),), 0.0),
        blocks=tuple(block(b) for b in range(num_blocks)),
        head=Piece("head", None, tuple(head), float(FLOPS_PER_MATMUL_PARAMETER * hidden * vocab)),
        block_of_depth=order,
        attention_width=q,
        tie_word_embeddings=tied,
        moe=moe,
    )


def _sparse_mlp(prefix: str, hidden: int, m: dict) -> list[Tensor]:
    """A sparse layer's router and 3-D experts (Mixtral's layout in memory: `gate_up_proj` [E, 2I, H] holds each
    expert's w1 and w3 rows, `down_proj` [E, H, I] its w2), stored under Mixtral's names, one tensor per expert."""
    experts, size = m["num_experts"], m["moe_intermediate_size"]
    routed = m["num_experts_per_tok"] / experts
    on_disk = f"{prefix}block_sparse_moe."
    return [
        Tensor(
            f"{prefix}mlp.gate.weight",
            (experts, hidden),
            matmul=True,
            disk=((f"{on_disk}gate.weight", (experts, hidden)),),
        ),
        Tensor(
            f"{prefix}mlp.experts.gate_up_proj",
            (experts, 2 * size, hidden),
            matmul=True,
            routed=routed,
            disk=tuple((f"{on_disk}experts.{{e}}.{part}.weight", (size, hidden)) for part in ("w1", "w3")),
            experts=experts,
        ),
        Tensor(
            f"{prefix}mlp.experts.down_proj",
            (experts, hidden, size),
            matmul=True,
            routed=routed,
            disk=((f"{on_disk}experts.{{e}}.w2.weight", (hidden, size)),),
            experts=experts,
        ),
    ]


def _matmul_flops(tensors: list[Tensor]) -> float:
    return float(sum(FLOPS_PER_MATMUL_PARAMETER * t.active_numel for t in tensors if t.matmul))


def natural_key(name: str) -> list[tuple]:
    """transformers' `dot_natural_key` (the order in which it saves a converted state dict): dotted parts compared as
    numbers when they are digits (layers.2 before layers.10), as text otherwise."""
    key = []
    for part in name.split("."):
        if part.isdigit():
            key.append((0, int(part)))
        else:
            text = part.rstrip("0123456789")
            key.append((1, text, int(part[len(text) :])) if text != part else (1, part))
    return key


__all__ = [
    "DEPTH_DEFAULT",
    "LAYOUT_DEFAULTS",
    "MOE_DEFAULTS",
    "SHAPE_DEFAULTS",
    "Inventory",
    "Piece",
    "Tensor",
    "inventory",
    "natural_key",
]
