"""P2R: a Llama decoder whose layers may share parameters (a *pseudo* model), and `delink()` to the *real* model
(growing a shallow model in depth on the way, if it is one).

Weight names are Llama's, so a real (delinked) P2R checkpoint is a Llama checkpoint. Everything that is not about
sharing comes from transformers: the attention, MLP and decoder layer are Llama's classes (P2R's subclasses change
only the KV-cache slot, which is the depth of the call, and the Depth-µP branch multiplier), as are the norm, rotary
embedding, attention kernels, masks, caches and generation.
This file imports nothing from `hf_p2r`, so `save_pretrained(..., remote_code=True)` folders load anywhere with
`trust_remote_code=True`.
"""

import copy
import functools
import inspect
import math
import os
from collections.abc import Callable

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.distributed.pipeline_parallel import PipelineIdentityLayer
from transformers.dynamic_module_utils import custom_object_save
from transformers.generation import GenerationMixin
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_p2r import LAYOUT_FIELDS, P2RConfig, validate_layout
from .sharing_p2r import LAYER_KEY, DelinkPlan, delink_names, plan_delink

logger = logging.get_logger(__name__)

# transformers 5.24 renamed the cache argument `past_key_values` -> `cache` (forwards, `create_causal_mask`, model
# outputs, `generate()`); earlier releases use the old name. P2R passes the cache to transformers under the name the
# installed release uses, and its forwards take `cache` and accept `past_key_values`, as transformers' Llama does.
CACHE_KWARG = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def accepts_past_key_values(forward: Callable) -> Callable:
    """Let `forward(cache=...)` also be called with `past_key_values=...`.

    Where transformers has renamed the argument, this is its own `deprecate_kwarg` (the notice Llama gives); where it
    has not, `generate()` itself passes `past_key_values`, so the rename is silent.
    """
    if CACHE_KWARG == "cache":
        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)

    @functools.wraps(forward)
    def forward_with_old_name(*args, **kwargs):
        if "past_key_values" in kwargs:
            if kwargs.get("cache") is not None:
                raise ValueError("pass the cache as `cache` or as `past_key_values`, not both")
            kwargs["cache"] = kwargs.pop("past_key_values")
        return forward(*args, **kwargs)

    return forward_with_old_name


# transformers' paged attention kernels index their cache by the module's `layer_idx`, i.e. by block, not by depth.
_PAGED_PSEUDO_ERROR = (
    "paged attention (continuous batching: `generate_batch`, `init_continuous_batching`; `paged|` attention "
    "implementations) indexes its KV cache by block, not by depth, so a pseudo model (share_layers=True) would compute "
    "another function; delink() the model first, or use `generate()`"
)


def scale_branch(output: torch.Tensor, config: P2RConfig) -> torch.Tensor:
    """A residual branch's output times `config.residual_multiplier` (Depth-µP's 1/sqrt(depth)); as it is otherwise."""
    return output * config.residual_multiplier if config.depth_mup else output


class P2RAttention(LlamaAttention):
    """Llama's attention, except that the KV-cache slot is the depth of the call (`layer_idx`), not the module's own
    index, and the output is scaled by the Depth-µP multiplier (`depth_mup`).

    A shared block runs at several depths; with a fixed `self.layer_idx` every depth would write the same cache slot
    and cached generation would differ from uncached generation.
    """

    @accepts_past_key_values
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        layer_idx: int | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if cache is not None:
            cache_idx = self.layer_idx if layer_idx is None else layer_idx
            key_states, value_states = cache.update(key_states, value_states, cache_idx, kwargs=kwargs)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )

        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = scale_branch(self.o_proj(attn_output), self.config)
        return attn_output, attn_weights


class P2RMLP(LlamaMLP):
    """Llama's MLP, its output scaled by the Depth-µP multiplier (`depth_mup`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale_branch(super().forward(x), self.config)


class P2RDecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer (its forward: the `layer_idx` the model passes reaches `P2RAttention` through its
    keyword arguments) with P2R's attention and MLP.

    `LlamaDecoderLayer.__init__` is not called: it would build, and draw random numbers for, Llama's own attention and
    MLP only to replace them. The modules are built in its order, so a seeded model's weights are unchanged.
    """

    def __init__(self, config: P2RConfig, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size

        self.self_attn = P2RAttention(config=config, layer_idx=layer_idx)

        self.mlp = P2RMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Outputs added to the residual stream: `_init_weights` scales their init by depth.
        self.self_attn.o_proj.is_residual_projection = True
        self.mlp.down_proj.is_residual_projection = True


class P2RPreTrainedModel(PreTrainedModel):
    config: P2RConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["P2RDecoderLayer"]
    _skip_keys_device_placement = [CACHE_KWARG]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True

    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "hidden_states": P2RDecoderLayer,
        "attentions": P2RAttention,
    }

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        # Residual-branch outputs get std / sqrt(2 L) (GPT-2, Megatron): a pseudo model adds its shared block's output
        # to the residual stream L times, so the unscaled init grows the stream with depth however few blocks there are.
        # Under Depth-µP the branch multiplier scales them instead, and their init is the other weights'.
        # (Checked on the Linear itself: for custom code, transformers skips modules that hold no parameters directly.)
        if isinstance(module, nn.Linear) and getattr(module, "is_residual_projection", False):
            init.normal_(module.weight, mean=0.0, std=self.residual_projection_std)

    @property
    def residual_projection_std(self) -> float:
        """The init std of the residual branches' output projections: `initializer_range / sqrt(2 d)`, or
        `initializer_range` under `depth_mup`."""
        config = self.config
        return config.initializer_range / (1.0 if config.depth_mup else math.sqrt(2 * config.num_hidden_layers))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        r"""
        Like [`PreTrainedModel.from_pretrained`], and a pseudo (or shallow) checkpoint loads as a more delinked (or
        deeper) model when asked:

        ```python
        >>> pseudo = P2RForCausalLM.from_pretrained("pseudo_dir")                        # k shared blocks
        >>> real = P2RForCausalLM.from_pretrained("pseudo_dir", share_layers=False)      # L blocks, same function
        >>> wider = P2RForCausalLM.from_pretrained("pseudo_dir", num_unique_layers=4)    # partial delink
        >>> grown = P2RForCausalLM.from_pretrained("shallow_dir", num_hidden_layers=8,   # depth growth (a delink)
        ...                                        growth="interleave", function_preserving=True)
        ```

        The checkpoint is loaded as stored (only its k blocks at its d depths are materialised) and then delinked in
        place (`delink`, with `growth` and `function_preserving` as there). Weights load from safetensors only. The
        overrides of the sharing fields and `num_hidden_layers` are checked like `P2RConfig` arguments and describe the
        model wanted: a stored `num_unique_layers` is kept when the checkpoint shares and derived when it does not;
        asking for fewer blocks (re-sharing), fewer layers, more layers without `growth`, or a transition that is not
        a delink raises `ValueError`.

        Layer weights must match the config's blocks: a checkpoint that has blocks but lacks a layer weight, or has
        layer weights beyond the config's blocks, raises `ValueError` naming it and the keys (a randomly initialised or
        dropped block would silently compute another function). Everything else is transformers' contract: a missing
        head, norm or embedding is initialised, warned about and listed in `output_loading_info`, so a `P2RModel`
        checkpoint loads into `P2RForCausalLM` (the head tied when `tie_word_embeddings`); unexpected non-layer weights
        are ignored with a report; a checkpoint with no layer weight at all (`from_pretrained(None, config=config,
        state_dict={})`) is initialised like any other.
        """
        if kwargs.get("use_safetensors") is False:
            raise ValueError("P2R models load weights from safetensors only (use_safetensors=False was given)")
        kwargs["use_safetensors"] = True
        output_loading_info = kwargs.pop("output_loading_info", False)
        growth = {key: kwargs.pop(key) for key in ("growth", "function_preserving") if key in kwargs}
        requested = {key: kwargs.pop(key) for key in LAYOUT_FIELDS if key in kwargs}
        stored_dict = _stored_config_dict(cls.config_class, pretrained_model_name_or_path, kwargs)
        config = kwargs.get("config")
        plan, real = None, None
        distributed = [key for key in _DISTRIBUTED_KWARGS if kwargs.get(key) is not None]
        if stored_dict is not None:
            # The Auto classes pass a config with the user's overrides already applied; a direct call passes kwargs.
            # (Compared by model_type: under trust_remote_code, AutoConfig's P2RConfig is another class object.)
            passed_config = getattr(config, "model_type", None) == cls.config_class.model_type
            if passed_config:
                requested = {key: getattr(config, key) for key in (*LAYOUT_FIELDS, "num_hidden_layers")}
                if requested["real_num_hidden_layers"] == stored_dict.get("real_num_hidden_layers"):
                    del requested["real_num_hidden_layers"]  # not asked for: it follows the depth asked for
            elif "num_hidden_layers" in kwargs:
                requested["num_hidden_layers"] = kwargs.pop("num_hidden_layers")
            stored, plan, real = _load_plan(
                cls.config_class, pretrained_model_name_or_path, stored_dict, requested, **growth
            )
            if distributed and plan is not None:
                # delink() copies blocks, which cannot be done on blocks already sharded across processes.
                raise ValueError(
                    f"{pretrained_model_name_or_path}: delinking while loading cannot be combined with "
                    f"{', '.join(distributed)}; convert the checkpoint first (hf-p2r convert), then load the result"
                )
            if passed_config and (plan is not None or real != stored.real_num_hidden_layers):
                config = copy.deepcopy(config)
                for key in (*LAYOUT_FIELDS, "num_hidden_layers", "mlp_only_layers"):
                    if hasattr(stored, key):
                        setattr(config, key, getattr(stored, key))
                kwargs["config"] = config
        elif requested or growth:
            if growth:
                raise ValueError(f"{', '.join(growth)}: growing while loading needs a P2R checkpoint with config.json")
            kwargs.update(requested)
        model, loading_info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
        )
        _check_loaded_blocks(pretrained_model_name_or_path, model, loading_info)
        if plan is not None:
            model.delink(plan)
        if stored_dict is not None:
            model.config.real_num_hidden_layers = real
        return (model, loading_info) if output_loading_info else model

    def save_pretrained(self, save_directory, *args, remote_code: bool = False, **kwargs):
        """Like [`PreTrainedModel.save_pretrained`]; `remote_code=True` also copies this model's code into the folder
        and writes `auto_map` into config.json, so it loads with `trust_remote_code=True` where hf_p2r is not installed.
        """
        if not remote_code:
            return super().save_pretrained(save_directory, *args, **kwargs)
        # Per instance, not `register_for_auto_class()`, which would turn it on for every model of the class.
        self._auto_class = "AutoModelForCausalLM" if isinstance(self, GenerationMixin) else "AutoModel"
        self.config._auto_class = "AutoConfig"
        try:
            os.makedirs(save_directory, exist_ok=True)
            custom_object_save(self, save_directory, config=self.config)
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            del self._auto_class, self.config._auto_class
            self.config.__dict__.pop("auto_map", None)

    def delink_parameter_map(self, num_unique_layers: int | DelinkPlan | None = None, **growth) -> dict[str, str]:
        """{parameter name after `delink(num_unique_layers, **growth)` -> parameter name now}, for every parameter.

        Computed without changing the model; an optimizer uses it to carry state across `delink`. Names are those of
        `named_parameters()` on this model.
        """
        plan = self.delink_plan(num_unique_layers, **growth)
        return delink_names((name for name, _ in self.named_parameters()), list(plan.sources))

    def delink_plan(self, num_unique_layers: int | DelinkPlan | None = None, **growth) -> DelinkPlan:
        """The `DelinkPlan` of `delink(num_unique_layers, **growth)` (`sharing_p2r.plan_delink` on this model's
        config): the new blocks' sources, those that start with zero outputs, the config fields after. A plan is
        returned as it is if it was made for this model as it is now (`ValueError` otherwise)."""
        if not isinstance(num_unique_layers, DelinkPlan):
            return plan_delink(self.config, num_unique_layers, **growth)
        plan, config = num_unique_layers, self.config
        if growth or plan.before != (config.num_hidden_layers, config.num_blocks):
            raise ValueError(
                f"a DelinkPlan for a model of {plan.before[0]} layers and {plan.before[1]} blocks, given alone, "
                f"delinks that model; this one has {config.num_hidden_layers} layers and {config.num_blocks} blocks"
            )
        return plan

    def delink(
        self,
        num_unique_layers: int | DelinkPlan | None = None,
        *,
        num_hidden_layers: int | None = None,
        growth: str = "stack",
        function_preserving: bool = False,
    ):
        """Give layers their own parameters, in place, without changing the function; or grow the model in depth, a
        delink along the depths. Returns the model.

        With no argument: the real model (`config.real_depth` layers, each its own block, `share_layers=False`).
        `num_unique_layers=k'` at the same depth: a partial delink (e.g. 1 -> 4 -> 16 blocks; `delink_sources` says
        which transitions keep the function). `num_hidden_layers=L'` grows a model of depth d to L' >= d depths (one
        block per depth unless `num_unique_layers` says fewer): new depth i runs a copy of old depth
        `source_depths(d, L', growth)[i]`, `growth="stack"` (i mod d, G_stack) or `"interleave"` (floor(i d / L')).
        Each new block starts as a bitwise copy of the old block its depths ran (the first copy of a block is the block
        itself), keeping dtype, device and `requires_grad`; `config.num_hidden_layers`, `num_unique_layers`,
        `share_layers` and `real_num_hidden_layers` (and a MoE model's `mlp_only_layers`) follow.

        Growth adds layers, so it changes the function, unless `function_preserving=True`: then of the new depths that
        copy one old depth the first keeps the weights and the later ones start with zero residual outputs (o_proj,
        down_proj, a sparse layer's experts' down projections, biases included), so the grown model computes the
        shallow one's function (bitwise; under `depth_mup` the kept blocks' outputs are also multiplied by
        sqrt(L'/d) to undo the new branch multiplier, equal to rounding). See `sharing_p2r.plan_delink`.

        A `DelinkPlan` (from `delink_plan`) may be passed instead of the arguments. Use `delink_parameter_map` first
        (same arguments) to carry optimizer state.
        """
        options = dict(num_hidden_layers=num_hidden_layers, growth=growth, function_preserving=function_preserving)
        if isinstance(num_unique_layers, DelinkPlan):  # the plan says it all: only options given are checked
            options = {key: value for key, value in options.items() if value != _DELINK_DEFAULTS[key]}
        plan = self.delink_plan(num_unique_layers, **options)
        base, config = self.base_model, self.config
        taken: set[int] = set()
        blocks = []
        for new_block, old_block in enumerate(plan.sources):
            block = base.layers[old_block]
            if old_block in taken or new_block in plan.fresh:
                # The memo keeps `config` shared: a private copy would not see `set_attn_implementation` and the like.
                block = copy.deepcopy(block, {id(config): config})
            else:
                taken.add(old_block)
            block.self_attn.layer_idx = new_block
            blocks.append(block)
        with torch.no_grad():
            for new_block, block in enumerate(blocks):
                for name, parameter in block.named_parameters():
                    plan.start_copy(f"layers.{new_block}.{name}", parameter)
        base.layers = nn.ModuleList(blocks)
        for key, value in plan.fields.items():
            setattr(config, key, value)
        return self


_DELINK_DEFAULTS = {"num_hidden_layers": None, "growth": "stack", "function_preserving": False}
# Keyword arguments of `from_pretrained` that shard the model across processes as it loads.
_DISTRIBUTED_KWARGS = ("distributed_config", "tp_plan", "tp_size", "device_mesh")
# Keyword arguments of `from_pretrained` that say where to find files (forwarded when reading the stored config).
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")


def _stored_config_dict(config_class: type[P2RConfig], pretrained_model_name_or_path, kwargs) -> dict | None:
    """The config.json the checkpoint itself declares (no overrides), or None if it has no P2R config.json."""
    if pretrained_model_name_or_path is None:
        return None
    hub_kwargs = {key: kwargs[key] for key in _HUB_KWARGS if key in kwargs}
    try:
        config_dict, _ = config_class.get_config_dict(pretrained_model_name_or_path, **hub_kwargs)
    except OSError:
        return None
    if config_dict.get("model_type") != config_class.model_type:
        return None
    return config_dict


def _check_loaded_blocks(source, model: PreTrainedModel, loading_info: dict) -> None:
    """Raise if the checkpoint has blocks and they are not exactly the config's: no layer weight may be initialised at
    random or dropped. Other keys are left to transformers (initialised or ignored, and reported)."""
    layer_keys = {key for key in model.state_dict() if LAYER_KEY.match(key)}
    missing = sorted(key for key in loading_info["missing_keys"] if key in layer_keys)
    unexpected = sorted(key for key in loading_info["unexpected_keys"] if LAYER_KEY.match(key))
    if not unexpected and (not missing or len(missing) == len(layer_keys)):
        return  # every block loaded, or the checkpoint has none (e.g. `state_dict={}`) and all are initialised
    stored = {int(LAYER_KEY.match(key)["block"]) for key in (layer_keys - set(missing)) | set(unexpected)}
    problems = []
    for kind, names in (("missing keys", missing), ("unexpected keys", unexpected)):
        if names:
            more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
            problems.append(f"{kind}: {', '.join(names[:3])}{more}")
    config = model.config
    raise ValueError(
        f"{'the state_dict' if source is None else source}: the layer weights (blocks {sorted(stored)}) do not match "
        f"the config's {config.num_blocks} blocks (share_layers={config.share_layers}, "
        f"num_unique_layers={config.num_unique_layers}, num_hidden_layers={config.num_hidden_layers}), and no block is "
        "initialised at random or dropped: " + "; ".join(problems)
    )


def _load_plan(
    config_class: type[P2RConfig], source, stored_dict: dict, requested: dict, **growth
) -> tuple[P2RConfig, DelinkPlan | None, int | None]:
    """The stored config, the delink (and growth) that gives the model the caller asks for (None: the stored one),
    and the `real_num_hidden_layers` of the model loaded.

    The request is checked like `P2RConfig` arguments; only a delink (more blocks with the same pattern, or more
    depths copied from the stored ones) is a transition from the stored model.
    """
    stored = config_class.from_dict(stored_dict)
    try:
        wanted = config_class.from_dict(stored_dict, **requested)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    depth, target, pattern = wanted.num_hidden_layers, wanted.num_blocks, wanted.sharing_pattern
    if depth != stored.num_hidden_layers and (depth < stored.num_hidden_layers or "growth" not in growth):
        raise ValueError(
            f"{source}: num_hidden_layers={depth} differs from the checkpoint's {stored.num_hidden_layers}; a P2R "
            "checkpoint loads at its own depth (its blocks would silently run at another depth), or grows to more "
            "layers when `growth` ('stack' or 'interleave') says how"
        )
    if target < stored.num_blocks or (pattern != stored.sharing_pattern and target < depth):
        raise ValueError(
            f"{source}: the checkpoint stores {stored.num_blocks} blocks (sharing_pattern={stored.sharing_pattern!r}) "
            f"and cannot load as a model with {target} blocks (sharing_pattern={pattern!r}): only delinking to more "
            "blocks with the same pattern keeps the function"
        )
    if (depth, target) == (stored.num_hidden_layers, stored.num_blocks):
        if growth.get("function_preserving"):
            raise ValueError(f"{source}: function_preserving: nothing grows (num_hidden_layers is the checkpoint's)")
        return stored, None, wanted.real_num_hidden_layers
    try:
        plan = plan_delink(stored, target, num_hidden_layers=depth, **growth)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    return stored, plan, wanted.real_num_hidden_layers


class P2RModel(P2RPreTrainedModel):
    def __init__(self, config: P2RConfig):
        validate_layout(config)  # again: fields may have been assigned since the config was built
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size

        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(self._stored_blocks(config))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False

        # Initialize weights and apply final processing
        self.post_init()

    def _stored_blocks(self, config: P2RConfig) -> list[nn.Module]:
        """The decoder layers the model stores: k for a pseudo model, L for a real one (the MoE model's differ)."""
        return [P2RDecoderLayer(config, block) for block in range(config.num_blocks)]

    @accepts_past_key_values
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

        if self.config.share_layers and (
            str(self.config._attn_implementation).startswith("paged") or isinstance(cache, PagedAttentionCache)
        ):
            raise ValueError(_PAGED_PSEUDO_ERROR)

        if inputs_embeds is None:
            inputs_embeds: torch.Tensor = self.embed_tokens(input_ids)

        if use_cache and cache is None:
            # One cache slot per depth (config.num_hidden_layers), however many blocks are stored.
            cache = DynamicCache(config=self.config)

        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{CACHE_KWARG: cache},
        )

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)

        if self.config.share_layers and self.config.sharing_pattern == "cycle":
            # transformers' own pipeline split keeps a contiguous range of *stored* blocks per stage; a cycle runs
            # every block at every stage, so a model split that way would silently compute another function.
            # hf_p2r.distributed.build_pipeline splits by depth instead, with a replica of the shared blocks per stage.
            if any(isinstance(layer, PipelineIdentityLayer) for layer in self.layers):
                raise ValueError(
                    "sharing_pattern='cycle' pseudo models cannot be split by transformers' pipeline split (it keeps "
                    "stored blocks, not depths, per stage); use hf_p2r.distributed.build_pipeline (trainer field "
                    "pipeline_parallel_size), which keeps a replica of the shared blocks on every stage"
                )

        # The one place sharing shows: depth i runs block `block_of_depth[i]` and uses cache slot i.
        for depth, block in enumerate(self.config.block_of_depth):
            hidden_states = self.layers[block](
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                use_cache=use_cache,
                layer_idx=depth,
                # Under the installed name: transformers' checkpointing layer drops the cache by that name.
                **{CACHE_KWARG: cache},
                **kwargs,
            )

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_KWARG: cache})


class P2RForCausalLM(P2RPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    base_model_class = P2RModel  # what `self.model` is (the MoE model's differs)
    # The loss from the last hidden states and the head, instead of logits and `loss_function`, when labels are given:
    # `(hidden_states, lm_head, labels, **kwargs) -> loss` (kwargs as `loss_function` gets them: `num_items_in_batch`,
    # `ignore_index`, `shift_labels`). A trainer sets it on the instance to compute the loss without full-vocabulary
    # logits (a chunked or fused linear cross-entropy); the output's `logits` is then None. Default: logits and
    # `loss_function`.
    loss_from_hidden_states: Callable | None = None

    def __init__(self, config: P2RConfig):
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

        # Initialize weights and apply final processing
        self.post_init()

    def init_continuous_batching(self, *args, **kwargs):
        """`GenerationMixin.init_continuous_batching` (behind `generate_batch`), refused up front for pseudo models."""
        if self.config.share_layers:
            raise ValueError(_PAGED_PSEUDO_ERROR)
        return super().init_continuous_batching(*args, **kwargs)

    @accepts_past_key_values
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )

        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits, loss = self.head_and_loss(hidden_states, labels, **kwargs)

        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{CACHE_KWARG: getattr(outputs, CACHE_KWARG)},
        )

    def head_and_loss(self, hidden_states: torch.Tensor, labels: torch.LongTensor | None, **kwargs):
        """(logits, loss) of the last `hidden_states`: the head's logits and `loss_function`'s loss (None without
        labels), or, with labels and `loss_from_hidden_states` set, (None, its loss)."""
        if labels is not None and self.loss_from_hidden_states is not None:
            return None, self.loss_from_hidden_states(hidden_states, self.lm_head, labels, **kwargs)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return logits, loss


__all__ = ["P2RForCausalLM", "P2RModel", "P2RPreTrainedModel"]
