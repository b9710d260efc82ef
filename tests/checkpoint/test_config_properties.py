"""config.json, as the converter reads it (`read_p2r_config_dict`, also `hf-p2r plan`'s reader) and as transformers
reads it (`read_p2r_config`: `P2RConfig.from_dict`): random and mutated configs end in one line naming the file, or
are accepted by both, with the same sharing. One validator for both: what `hf-p2r convert` accepts loads."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_p2r.checkpoint.source import read_p2r_config, read_p2r_config_dict
from hf_p2r.models.p2r.inventory_p2r import MOE_DEFAULTS
from hf_p2r.models.p2r.sharing_p2r import SIZE_FIELDS

from ..conftest import tiny_config
from ..models.test_modeling_p2r_moe import moe_config

# The fields the converter reads (and the model's validators check), and values a config.json may hold for them.
FIELDS = [
    "model_type",
    *SIZE_FIELDS,
    "num_hidden_layers",
    "share_layers",
    "num_unique_layers",
    "sharing_pattern",
    "attention_bias",
    "mlp_bias",
    "tie_word_embeddings",
    *MOE_DEFAULTS,
]
VALUES = (
    st.integers(-3, 12)
    | st.sampled_from([0, 16, 32, 48, 64, 10**9, 2**70, -(2**70)])
    | st.booleans()
    | st.sampled_from([2.0, 8.0, -1.5, 0.5, float("inf"), float("nan")])
    | st.sampled_from(["yes", "", "cycle", "sequence", "p2r", "p2r_moe", "llama", "8"])
    | st.none()
    | st.lists(st.integers(-2, 9) | st.sampled_from([1.0, True, "1"]), max_size=4)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
)
BASES = {
    "dense": lambda: tiny_config(share_layers=True, num_unique_layers=2).to_dict(),
    "moe": lambda: moe_config(share_layers=True, num_unique_layers=2).to_dict(),
}
_SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("base", BASES)
@_SETTINGS
@given(data=st.data())
def test_mutated_configs_are_one_line_or_load_alike(tmp_path, base, data):
    config = BASES[base]()
    for field in data.draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=4, unique=True)):
        if data.draw(st.booleans()) and field != "model_type":
            config.pop(field, None)
        else:
            config[field] = data.draw(VALUES)
    (tmp_path / "config.json").write_text(json.dumps(config))
    try:
        checked = read_p2r_config_dict(tmp_path)
    except ValueError as error:
        message = str(error)
        assert message.startswith(f"{tmp_path / 'config.json'}: ") and "\n" not in message, message
        assert len(message) < 600, message
        return
    loaded = read_p2r_config(tmp_path)  # what the converter accepts, transformers loads
    assert loaded.model_type == checked["model_type"]
    assert (loaded.share_layers, loaded.num_unique_layers) == (checked["share_layers"], checked["num_unique_layers"])
    assert loaded.num_hidden_layers == checked["num_hidden_layers"]


@_SETTINGS
@given(text=st.text(max_size=60) | st.binary(max_size=60).map(lambda b: b.decode("latin-1")))
def test_random_text(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError) as info:
        read_p2r_config_dict(tmp_path)
    assert str(info.value).startswith(f"{tmp_path / 'config.json'}: ") and "\n" not in str(info.value)
