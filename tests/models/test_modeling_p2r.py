import warnings

import pytest
import torch
from transformers import LlamaForCausalLM

from hf_p2r import P2RForCausalLM
from hf_p2r.checkpoint.llama import llama_config
from hf_p2r.models.p2r import modeling_p2r

from ..conftest import requires_cuda, tiny_config, tiny_model


def _tile_into_real(pseudo: P2RForCausalLM) -> P2RForCausalLM:
    """The real model a pseudo model stands for, built from its state dict alone (not through delink)."""
    config = tiny_config(**{k: getattr(pseudo.config, k) for k in ("num_hidden_layers", "tie_word_embeddings")})
    real = P2RForCausalLM(config).eval()
    state = {}
    for depth, block in enumerate(pseudo.config.block_of_depth):
        for key, value in pseudo.model.layers[block].state_dict().items():
            state[f"model.layers.{depth}.{key}"] = value
    for key, value in pseudo.state_dict().items():
        if ".layers." not in key:
            state[key] = value
    real.load_state_dict(state, strict=True)
    return real


@pytest.mark.parametrize(("k", "pattern"), [(1, "cycle"), (2, "cycle"), (3, "sequence")])
def test_pseudo_stores_k_blocks_without_aliases(k, pattern):
    model = tiny_model(share_layers=True, num_unique_layers=k, sharing_pattern=pattern)
    blocks = {key.split(".")[2] for key in model.state_dict() if key.startswith("model.layers.")}
    assert blocks == {str(b) for b in range(k)}
    pointers = [p.data_ptr() for p in model.parameters()]
    assert len(pointers) == len(set(pointers))
    assert len(model.model.layers) == k


@pytest.mark.parametrize(("k", "pattern"), [(1, "cycle"), (2, "cycle"), (3, "sequence")])
def test_pseudo_runs_every_depth(k, pattern, input_ids):
    pseudo = tiny_model(share_layers=True, num_unique_layers=k, sharing_pattern=pattern)
    with torch.no_grad():
        out = pseudo(input_ids, output_hidden_states=True)
        expected = _tile_into_real(pseudo)(input_ids).logits
    assert len(out.hidden_states) == pseudo.config.num_hidden_layers + 1
    torch.testing.assert_close(out.logits, expected, rtol=0, atol=0)


def test_real_state_dict_uses_llama_names():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tiny_model()
    llama = LlamaForCausalLM(
        LlamaConfig(
            **{
                k: v
                for k, v in model.config.to_diff_dict().items()
                if k not in ("share_layers", "num_unique_layers", "sharing_pattern", "model_type")
            }
        )
    )
    assert model.state_dict().keys() == llama.state_dict().keys()
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in llama.state_dict().items()}


@pytest.mark.parametrize(("k", "pattern"), [(1, "cycle"), (2, "cycle"), (2, "sequence")])
def test_pseudo_cached_generation_equals_uncached(k, pattern, input_ids):
    model = tiny_model(seed=3, share_layers=True, num_unique_layers=k, sharing_pattern=pattern)
    prompt = input_ids[:, :5]
    cached = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, use_cache=True)
    uncached = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, use_cache=False)
    assert cached.shape == (2, 17)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("share_layers", [True, False])
def test_cached_generation_equals_uncached_without_warnings(share_layers, input_ids, recwarn):
    """Under the cache name the installed transformers uses (5.24 renamed `past_key_values` to `cache`); a forward
    that misses the name drops the cache silently and every new token attends to itself alone."""
    model = tiny_model(seed=3, share_layers=share_layers, num_unique_layers=2 if share_layers else None)
    prompt = input_ids[:, :5]
    cached = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, use_cache=True)
    uncached = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    assert [str(w.message) for w in recwarn] == []


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_forward_takes_the_cache_under_both_names(name, input_ids):
    """Step-by-step decoding through either name equals the full forward (both names reach the same cache). The old
    name gets transformers' own deprecation notice where transformers has renamed it, as Llama does, and none before."""
    model = tiny_model(seed=4, share_layers=True, num_unique_layers=2)
    renamed = name == "past_key_values" and modeling_p2r.CACHE_KWARG == "cache"
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        full = model(input_ids[:, :8]).logits
        first = model(input_ids[:, :5], use_cache=True)
        cache = getattr(first, modeling_p2r.CACHE_KWARG)
        step = model(input_ids[:, 5:8], use_cache=True, **{name: cache}).logits
    assert [issubclass(w.category, FutureWarning) and "past_key_values" in str(w.message) for w in caught] == (
        [True] if renamed else []
    )
    assert cache.get_seq_length() == 8
    torch.testing.assert_close(step, full[:, 5:8], rtol=1e-5, atol=1e-6)


def test_cache_indexed_by_block_breaks_generation(monkeypatch, input_ids):
    """The check above can fail: indexing the cache by the block (naive repetition) changes cached generation."""
    model = tiny_model(seed=3, share_layers=True, num_unique_layers=1)
    cache = getattr(model(input_ids[:, :5], use_cache=True), modeling_p2r.CACHE_KWARG)
    assert len(cache.layers) == 8 and all(layer.keys.shape[-2] == 5 for layer in cache.layers)

    forward = modeling_p2r.P2RAttention.forward

    def naive(self, *args, layer_idx=None, **kwargs):
        return forward(self, *args, layer_idx=self.layer_idx, **kwargs)

    monkeypatch.setattr(modeling_p2r.P2RAttention, "forward", naive)
    prompt = input_ids[:, :5]
    cached = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, use_cache=True)
    uncached = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, use_cache=False)
    assert not torch.equal(cached, uncached)


def test_left_padded_batch_generation_matches_single_sequences():
    model = tiny_model(seed=5, share_layers=True, num_unique_layers=2)
    short = torch.tensor([[7, 8, 9]])
    long = torch.tensor([[10, 11, 12, 13, 14]])
    batch = torch.tensor([[0, 0, 7, 8, 9], [10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(out[0, 5:], model.generate(short, max_new_tokens=6, do_sample=False)[0, 3:])
    assert torch.equal(out[1, 5:], model.generate(long, max_new_tokens=6, do_sample=False)[0, 5:])


@pytest.mark.parametrize("impl", ["sdpa", pytest.param("flex_attention", marks=pytest.mark.processes)])  # inductor: g++
def test_attention_implementations_agree(impl, input_ids):
    reference = tiny_model(share_layers=True, num_unique_layers=2)
    reference.set_attn_implementation("eager")  # not the default (sdpa): the comparison must be able to fail
    model = tiny_model(share_layers=True, num_unique_layers=2)
    model.set_attn_implementation(impl)
    assert model.config._attn_implementation == impl
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, reference(input_ids).logits, rtol=1e-4, atol=1e-5)


def test_pseudo_gradient_is_the_sum_over_depths(input_ids):
    """A shared block's gradient is the sum of the gradients its copies get in the real model."""
    pseudo = tiny_model(share_layers=True, num_unique_layers=2).train()
    real = _tile_into_real(pseudo).train()
    pseudo(input_ids, labels=input_ids).loss.backward()
    real(input_ids, labels=input_ids).loss.backward()
    for block in range(2):
        for name, param in pseudo.model.layers[block].named_parameters():
            copies = [
                real.model.layers[d].get_parameter(name).grad
                for d, b in enumerate(pseudo.config.block_of_depth)
                if b == block
            ]
            torch.testing.assert_close(param.grad, torch.stack(copies).sum(0), rtol=1e-5, atol=1e-7)


def test_activation_checkpointing_keeps_loss_and_gradients(input_ids):
    plain = tiny_model(share_layers=True, num_unique_layers=2).train()
    checkpointed = tiny_model(share_layers=True, num_unique_layers=2).train()
    checkpointed.activation_checkpointing_enable()
    assert all(layer.gradient_checkpointing for layer in checkpointed.model.layers)
    loss_a = plain(input_ids, labels=input_ids).loss
    loss_b = checkpointed(input_ids, labels=input_ids).loss
    loss_a.backward()
    loss_b.backward()
    assert torch.equal(loss_a, loss_b)
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("layout", [dict(share_layers=True, num_unique_layers=1), dict()])
def test_residual_output_projections_are_scaled_by_depth(layout):
    model = tiny_model(seed=0, hidden_size=128, intermediate_size=256, num_attention_heads=4, **layout)
    expected = model.config.initializer_range / (2 * model.config.num_hidden_layers) ** 0.5
    for layer in model.model.layers:
        assert abs(layer.self_attn.o_proj.weight.std().item() - expected) < 0.15 * expected
        assert abs(layer.mlp.down_proj.weight.std().item() - expected) < 0.15 * expected
        assert abs(layer.self_attn.q_proj.weight.std().item() - 0.02) < 0.15 * 0.02
        assert abs(layer.mlp.up_proj.weight.std().item() - 0.02) < 0.15 * 0.02


def test_tied_embeddings():
    model = tiny_model(share_layers=True, num_unique_layers=1, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.delink()
    assert model.lm_head.weight is model.model.embed_tokens.weight


@requires_cuda
@pytest.mark.parametrize("impl", ["sdpa", "flash_attention_2"])
def test_cuda_bf16_attention(impl, input_ids):
    pytest.importorskip("flash_attn") if impl == "flash_attention_2" else None
    model = tiny_model(share_layers=True, num_unique_layers=2).to("cuda", torch.bfloat16)
    reference = tiny_model(share_layers=True, num_unique_layers=2).to("cuda", torch.bfloat16)
    reference.set_attn_implementation("eager")
    model.set_attn_implementation(impl)
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids.cuda()).logits, reference(input_ids.cuda()).logits, rtol=2e-2, atol=2e-2
        )


def test_pseudo_model_compiles_as_one_graph(input_ids):
    """`_can_compile_fullgraph = True` holds: the depth -> block loop is plain Python over config values."""
    model = tiny_model(share_layers=True, num_unique_layers=2)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids).logits, model(input_ids).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("pattern", "splittable"), [("cycle", False), ("sequence", True)])
def test_pipeline_split_guard(pattern, splittable, input_ids):
    """transformers' pipeline split keeps a range of stored blocks per stage: right for 'sequence', not for 'cycle'."""
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    model = tiny_model(share_layers=True, num_unique_layers=2, sharing_pattern=pattern)
    block_outputs = []
    model.model.layers[0].register_forward_hook(lambda module, args, output: block_outputs.append(output))
    with torch.no_grad():
        model(input_ids)
    model.model.layers[1] = PipelineIdentityLayer()
    if splittable:
        # The first stage keeps block 0 and runs exactly its depths (0-3 of 8), then passes the hidden states on.
        assert len(block_outputs) == 4
        block_outputs.clear()
        with torch.no_grad():
            logits = model(input_ids).logits
            expected = model.lm_head(model.model.norm(block_outputs[3]))
        assert len(block_outputs) == 4
        assert torch.equal(logits, expected)
    else:
        with pytest.raises(ValueError, match="build_pipeline"):
            model(input_ids)


def test_continuous_batching_is_refused_for_pseudo_models():
    """Paged attention indexes its cache by the block's `layer_idx`: a pseudo model would generate other tokens."""
    model = tiny_model(share_layers=True, num_unique_layers=2)
    with pytest.raises(ValueError, match="delink"):
        model.generate_batch([[5, 6, 7]], max_new_tokens=2, warmup=False)
    assert model.delink().init_continuous_batching() is not None, "the real model may batch continuously"


@pytest.mark.parametrize("impl", ["paged|eager", "sdpa"])
def test_paged_attention_is_refused_for_pseudo_models(impl, input_ids):
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    model = tiny_model(share_layers=True, num_unique_layers=2)
    model.set_attn_implementation(impl)
    # A paged cache is how continuous batching reaches the attention kernels (with sdpa and flash too).
    paged_cache = PagedAttentionCache.__new__(PagedAttentionCache)
    with pytest.raises(ValueError, match="delink"):
        model(input_ids, cache=paged_cache)


def test_a_real_p2r_model_and_llama_with_the_same_weights_give_equal_logits(input_ids):
    """P2R's attention and decoder layer are Llama's subclasses: a real P2R model is Llama, logits and generation bit
    for bit (the config as the Llama export writes it)."""
    model = tiny_model(attention_bias=True, mlp_bias=True)
    llama = LlamaForCausalLM(llama_config(model.config)).eval()
    llama.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, llama(input_ids).logits)
        generated = model.generate(input_ids[:, :5], max_new_tokens=6, do_sample=False)
        assert torch.equal(generated, llama.generate(input_ids[:, :5], max_new_tokens=6, do_sample=False))
