"""The model as users describe one (issue 37, item 6): a Llama or P2R `config.json` (`model_config`: a file, a folder,
a Hub model already in the local cache) and every Llama field, the YAML and the flags on top; the saved models keep
what it says (`max_position_embeddings` included)."""

import json

import huggingface_hub.constants
import pytest
from transformers import AutoConfig, LlamaConfig

from hf_p2r.config import ConfigError, parse_config
from hf_p2r.config.resume import differing
from hf_p2r.training import train

from ..tiny import TINY_SHAPE
from .helpers import tiny_argv

# A small Llama config.json as transformers writes one (v5: rope_parameters): the tiny model's shape, with non-default
# values everywhere else.
LLAMA = dict(
    TINY_SHAPE,
    head_dim=16,
    hidden_act="gelu",
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    attention_bias=True,
    mlp_bias=True,
    rope_parameters={"rope_type": "linear", "rope_theta": 50000.0, "factor": 2.0},
)


@pytest.fixture
def llama_json(tmp_path):
    folder = tmp_path / "llama"
    LlamaConfig(**LLAMA).save_pretrained(folder)
    return folder


def _argv(tmp_path, **fields) -> list[str]:
    """A tiny run's flags without the model's shape (the file gives it), `fields` added."""
    run = dict(output_dir=tmp_path / "run", block_size=32, corpus_max_bytes=5000, per_device_batch_size=4,
               pseudo_steps=1, real_steps=1, warmup_steps=1, eval_steps=0, eval_blocks=4, cpu="true")  # fmt: skip
    return [token for key, value in {**run, **fields}.items() for token in (f"--{key}", str(value))]


@pytest.mark.parametrize("form", ["folder", "file"])
def test_a_llama_config_gives_every_model_field_and_the_flags_override_it(tmp_path, llama_json, form):
    source = llama_json if form == "folder" else llama_json / "config.json"
    config = parse_config(_argv(tmp_path, model_config=source, intermediate_size=48))
    m = config.model
    assert (m.hidden_size, m.num_hidden_layers, m.num_key_value_heads, m.head_dim, m.vocab_size) == (32, 8, 2, 16, 101)
    assert m.intermediate_size == 48  # the flag, over the file
    assert (m.hidden_act, m.rms_norm_eps, m.attention_bias, m.mlp_bias) == ("gelu", 1e-5, True, True)
    assert (m.rope_theta, m.rope_scaling) == (50000.0, {"rope_type": "linear", "factor": 2.0})
    assert m.max_position_embeddings == 256
    # The model's config is what the file says (and the run's k).
    built = config.p2r_config(m.vocab_size, config.model.num_hidden_layers, special_tokens={})
    for name, value in LLAMA.items():
        if name != "intermediate_size":
            assert getattr(built, name) == value, name


def test_a_hub_model_in_the_local_cache_is_read_offline(tmp_path, llama_json, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--tiny-llama" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_bytes((llama_json / "config.json").read_bytes())
    (cache / "models--someone--tiny-llama" / "refs").mkdir()
    (cache / "models--someone--tiny-llama" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert parse_config(_argv(tmp_path, model_config="someone/tiny-llama")).model.head_dim == 16
    with pytest.raises(
        ConfigError, match=r"^model_config: 'someone/other' is not a file, a model folder or a model in"
    ):
        parse_config(_argv(tmp_path, model_config="someone/other"))


def test_a_p2r_pseudo_config_gives_its_k_and_a_v4_llama_config_its_rope_fields(tmp_path):
    pseudo = tmp_path / "pseudo.json"
    shape = {k: v for k, v in LLAMA.items() if k != "rope_parameters"}
    sharing = {"share_layers": True, "num_unique_layers": 2, "sharing_pattern": "sequence"}
    pseudo.write_text(json.dumps({"model_type": "p2r", **shape, **sharing}))
    config = parse_config(_argv(tmp_path, model_config=pseudo))
    assert (config.model.num_unique_layers, config.model.sharing_pattern) == (2, "sequence")
    v4 = tmp_path / "v4.json"
    rope = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}
    v4.write_text(json.dumps({"model_type": "llama", **shape, **rope}))
    m = parse_config(_argv(tmp_path, model_config=v4)).model
    assert (m.rope_theta, m.rope_scaling) == (500000.0, {"rope_type": "dynamic", "factor": 4.0})


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"model_type": "gpt2", "n_embd": 32}, "model_type 'gpt2' is not a Llama or P2R model (llama, p2r, p2r_moe)"),
        ({"model_type": "llama", "hidden_size": 32, "sliding_window": 8}, "'sliding_window': not a field of the"),
        ({"model_type": "llama", "rms_norm_eps": "small"}, "rms_norm_eps: expected a finite number, got 'small'"),
        ({"model_type": "llama", "max_position_embeddings": 16}, "max_position_embeddings: 16 is less than block_size"),
    ],
    ids=["another model", "unknown field", "mistyped field", "positions below the block"],
)
def test_a_config_the_trainer_cannot_take_is_one_line_naming_it(tmp_path, content, message):
    path = tmp_path / "model.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ConfigError) as raised:
        parse_config(_argv(tmp_path, model_config=path))
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_missing_model_config_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^model_config: .*missing\.json: no such file or folder$"):
        parse_config(_argv(tmp_path, model_config=tmp_path / "missing.json"))


def test_a_bad_activation_or_rope_type_is_refused_before_the_run_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"^hidden_act: 'swishy' is not one of transformers' activations"):
        train(parse_config(tiny_argv(tmp_path / "a", hidden_act="swishy")))
    with pytest.raises(ConfigError, match=r"^rope_scaling: rope_type 'warp' is not one of transformers'"):
        train(parse_config(tiny_argv(tmp_path / "b", rope_scaling="{rope_type: warp}")))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_saved_models_keep_what_the_config_says(tmp_path, llama_json):
    """A run from a Llama config.json: real/ and pseudo/ declare its fields, max_position_embeddings included (it was
    block_size), and load with transformers as they are."""
    output_dir = tmp_path / "run"
    argv = _argv(tmp_path, model_config=llama_json, num_unique_layers=2, vocab_size=320)
    assert train(parse_config(argv)) == 0
    for folder in ("pseudo", "real"):
        saved = AutoConfig.from_pretrained(output_dir / folder, trust_remote_code=True)
        assert (saved.max_position_embeddings, saved.head_dim, saved.hidden_act) == (256, 16, "gelu"), folder
        assert (saved.rms_norm_eps, saved.attention_bias, saved.mlp_bias) == (1e-5, True, True), folder
        assert saved.rope_parameters == LLAMA["rope_parameters"], folder


def test_a_checkpoint_saved_before_these_fields_existed_resumes():
    """A saved configuration without the new fields had their defaults: nothing differs."""
    current = parse_config([]).to_dict()
    old = {key: value for key, value in current.items() if key not in ("rms_norm_eps", "hidden_act", "model_config")}
    assert differing(old, current) == []
    assert differing({**old, "rms_norm_eps": 1e-5}, current) == ["rms_norm_eps"]
