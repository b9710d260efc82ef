"""P2R: a Llama decoder whose layers may share parameters (a *pseudo* model), and `delink()` to the *real* model.

Weight names are Llama's, so a real (delinked) P2R checkpoint is a Llama checkpoint. Everything that is not about
sharing comes from transformers: the attention and decoder layer are Llama's classes (P2R's attention changes only the
KV-cache slot, which is the depth of the call), as are the MLP, norm, rotary embedding, attention kernels, masks,
caches and generation.
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

from .configuration_p2r import LAYOUT_FIELDS, P2RConfig, delink_sources, validate_layout
from .sharing_p2r import LAYER_KEY, delink_names

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


class P2RAttention(LlamaAttention):
    """Llama's attention, except that the KV-cache slot is the depth of the call (`layer_idx`), not the module's own
    index.

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
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


class P2RDecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer (its forward: the `layer_idx` the model passes reaches `P2RAttention` through its
    keyword arguments) with P2R's attention.

    `LlamaDecoderLayer.__init__` is not called: it would build, and draw random numbers for, Llama's own attention
    only to replace it. The modules are built in its order, so a seeded model's weights are unchanged.
    """

    def __init__(self, config: P2RConfig, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size

        self.self_attn = P2RAttention(config=config, layer_idx=layer_idx)

        self.mlp = LlamaMLP(config)
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
        # (Checked on the Linear itself: for custom code, transformers skips modules that hold no parameters directly.)
        if isinstance(module, nn.Linear) and getattr(module, "is_residual_projection", False):
            std = self.config.initializer_range / math.sqrt(2 * self.config.num_hidden_layers)
            init.normal_(module.weight, mean=0.0, std=std)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        r"""
        Like [`PreTrainedModel.from_pretrained`], and a pseudo checkpoint loads as a more delinked model when asked:

        ```python
        >>> pseudo = P2RForCausalLM.from_pretrained("pseudo_dir")                        # k shared blocks
        >>> real = P2RForCausalLM.from_pretrained("pseudo_dir", share_layers=False)      # L blocks, same function
        >>> wider = P2RForCausalLM.from_pretrained("pseudo_dir", num_unique_layers=4)    # partial delink
        ```

        The checkpoint is loaded as stored (only its k blocks are materialised) and then delinked in place. Weights load
        from safetensors only. The sharing overrides are checked like `P2RConfig` arguments; asking for fewer blocks
        (re-sharing) or another `num_hidden_layers` raises `ValueError`.

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
        requested = {key: kwargs.pop(key) for key in LAYOUT_FIELDS if key in kwargs}
        stored_dict = _stored_config_dict(cls.config_class, pretrained_model_name_or_path, kwargs)
        config = kwargs.get("config")
        target = None
        distributed = [key for key in _DISTRIBUTED_KWARGS if kwargs.get(key) is not None]
        if stored_dict is not None:
            # The Auto classes pass a config with the user's overrides already applied; a direct call passes kwargs.
            # (Compared by model_type: under trust_remote_code, AutoConfig's P2RConfig is another class object.)
            passed_config = getattr(config, "model_type", None) == cls.config_class.model_type
            if passed_config:
                requested = {key: getattr(config, key) for key in (*LAYOUT_FIELDS, "num_hidden_layers")}
            elif "num_hidden_layers" in kwargs:
                requested["num_hidden_layers"] = kwargs["num_hidden_layers"]
            stored, target = _target_blocks(cls.config_class, pretrained_model_name_or_path, stored_dict, requested)
            if distributed and target != stored.num_blocks:
                # delink() copies blocks, which cannot be done on blocks already sharded across processes.
                raise ValueError(
                    f"{pretrained_model_name_or_path}: delinking while loading cannot be combined with "
                    f"{', '.join(distributed)}; convert the checkpoint first (hf-p2r convert), then load the result"
                )
            if passed_config and target != stored.num_blocks:
                config = copy.deepcopy(config)
                config.share_layers, config.num_unique_layers = stored.share_layers, stored.num_blocks
                kwargs["config"] = config
        elif requested:
            kwargs.update(requested)
        model, loading_info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
        )
        _check_loaded_blocks(pretrained_model_name_or_path, model, loading_info)
        if target is not None and target != model.config.num_blocks:
            model.delink(target)
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

    def delink_parameter_map(self, num_unique_layers: int | None = None) -> dict[str, str]:
        """{parameter name after `delink(num_unique_layers)` -> parameter name now}, for every parameter.

        Computed without changing the model; an optimizer uses it to carry state across `delink`. Names are those of
        `named_parameters()` on this model.
        """
        return delink_names((name for name, _ in self.named_parameters()), self._delink_sources(num_unique_layers))

    def delink(self, num_unique_layers: int | None = None):
        """Give layers their own parameters, in place, without changing the function; returns the model.

        With `num_unique_layers=None` every depth gets its own block (the real model, `config.share_layers=False`).
        With k' < L the model stays pseudo with k' blocks (partial delinking, e.g. 1 -> 4 -> 16); see
        `delink_sources` for which transitions are valid. Each new block starts as a copy of the block its depths ran
        before (the first copy of a block is the block itself), keeping dtype, device and `requires_grad`. Use
        `delink_parameter_map` first to carry optimizer state.
        """
        sources = self._delink_sources(num_unique_layers)
        base, config = self.base_model, self.config
        taken: set[int] = set()
        blocks = []
        for new_block, old_block in enumerate(sources):
            block = base.layers[old_block]
            if old_block in taken:
                # The memo keeps `config` shared: a private copy would not see `set_attn_implementation` and the like.
                block = copy.deepcopy(block, {id(config): config})
            taken.add(old_block)
            block.self_attn.layer_idx = new_block
            blocks.append(block)
        base.layers = nn.ModuleList(blocks)
        config.share_layers = len(blocks) < config.num_hidden_layers
        config.num_unique_layers = len(blocks)
        return self

    def _delink_sources(self, num_unique_layers: int | None) -> list[int]:
        config = self.config
        if not config.share_layers:
            raise ValueError("this model is already real (share_layers=False): there is nothing to delink")
        target = config.num_hidden_layers if num_unique_layers is None else num_unique_layers
        return delink_sources(config.num_hidden_layers, config.num_unique_layers, target, config.sharing_pattern)


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


def _target_blocks(config_class: type[P2RConfig], source, stored_dict: dict, requested: dict) -> tuple[P2RConfig, int]:
    """The stored config and how many blocks the caller asks for.

    The request is checked like `P2RConfig` arguments; only delinking (more blocks, same pattern, same depth) keeps the
    function.
    """
    stored = config_class.from_dict(stored_dict)
    depth = requested.get("num_hidden_layers", stored.num_hidden_layers)
    if depth != stored.num_hidden_layers:
        raise ValueError(
            f"{source}: num_hidden_layers={depth!r} differs from the checkpoint's {stored.num_hidden_layers}; a P2R "
            "checkpoint loads at its own depth (a pseudo model would silently run its blocks at another depth)"
        )
    try:
        wanted = config_class.from_dict(stored_dict, **requested)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    target, pattern = wanted.num_blocks, wanted.sharing_pattern
    if target < stored.num_blocks or (pattern != stored.sharing_pattern and target < depth):
        raise ValueError(
            f"{source}: the checkpoint stores {stored.num_blocks} blocks (sharing_pattern={stored.sharing_pattern!r}) "
            f"and cannot load as a model with {target} blocks (sharing_pattern={pattern!r}): only delinking to more "
            "blocks with the same pattern keeps the function"
        )
    if stored.num_blocks < target < depth:
        try:
            delink_sources(depth, stored.num_blocks, target, stored.sharing_pattern)
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from None
    return stored, target


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
