"""The trainer's model saves (`pseudo/`, `real/`) go through `hf_p2r.checkpoint.save_model`, also when sharded."""

import copy
import functools
import json
from pathlib import Path
from unittest import mock

import pytest
import torch
from accelerate import Accelerator
from torch.distributed.checkpoint import state_dict as state_dict_module
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from hf_p2r import P2RForCausalLM
from hf_p2r.checkpoint import writer as writer_module
from hf_p2r.distributed import fully_shard_p2r
from hf_p2r.training.checkpointing import save_model
from hf_p2r.training.data import byte_level_tokenizer

from ..conftest import tiny_model
from ..distributed import spawn
from ..models.helpers import MODEL_FILES_WITH_CODE


def _logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids).logits


def _input_ids():
    return torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(1))


def _load(folder):
    """(model, loading info) through the Auto class, as a user loads the trainer's output."""
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, trust_remote_code=True)
    return model.eval(), {key: sorted(value) for key, value in info.items() if key != "error_msgs"}


@pytest.mark.parametrize("tied", [False, True])
def test_save_model_one_process(tmp_path, monkeypatch, tied):
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", mock.Mock(side_effect=AssertionError("save_pretrained")))
    write_file = mock.Mock(wraps=writer_module.write_file)
    monkeypatch.setattr(writer_module, "write_file", write_file)
    accelerator = Accelerator(cpu=True)
    reference = tiny_model(share_layers=True, num_unique_layers=2, tie_word_embeddings=tied)
    model = accelerator.prepare(copy.deepcopy(reference).train())
    (tmp_path / "pseudo").mkdir()
    (tmp_path / "pseudo" / "stale.txt").write_text("an earlier save")  # replaced, like the old save_pretrained path
    save_model(accelerator, accelerator.unwrap_model(model), byte_level_tokenizer(), tmp_path / "pseudo", True)
    assert [call.args[0].name for call in write_file.call_args_list] == ["model.safetensors"], "hf-p2r's writer"
    files = sorted(p.name for p in (tmp_path / "pseudo").iterdir())
    assert files == [*MODEL_FILES_WITH_CODE, "tokenizer.json", "tokenizer_config.json"]
    loaded, info = _load(tmp_path / "pseudo")
    assert info == {"missing_keys": [], "mismatched_keys": [], "unexpected_keys": []}
    assert torch.equal(_logits(loaded, _input_ids()), _logits(reference, _input_ids()))
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is tied
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "pseudo", trust_remote_code=True)
    assert tokenizer.eos_token == byte_level_tokenizer().eos_token


def _fsdp2_save(folder: str, rank: int, world_size: int) -> dict:
    """Shard a model with FSDP2 across the processes, save it with the trainer's save_model from every process, and
    (rank 0) load it back."""
    torch.manual_seed(0)
    reference = tiny_model(share_layers=True, num_unique_layers=2, tie_word_embeddings=True)
    model = fully_shard_p2r(copy.deepcopy(reference), mesh=init_device_mesh("cpu", (world_size,)))
    local = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
    # Accelerate turns FSDP on only for accelerators: on CPU its FSDP2 branch of get_state_dict (the one used on GPUs,
    # torch's get_model_state_dict with full_state_dict=True) is reached by saying that FSDP2 is on.
    gather = mock.Mock(wraps=state_dict_module.get_model_state_dict)
    with (
        mock.patch.object(Accelerator, "is_fsdp2", new_callable=mock.PropertyMock, return_value=True),
        mock.patch.object(state_dict_module, "get_model_state_dict", gather),
    ):
        accelerator = Accelerator(cpu=True)
        save_model(accelerator, model, byte_level_tokenizer(), Path(folder) / "real", True)
    gathered = [call.kwargs["options"].full_state_dict for call in gather.call_args_list]
    if rank != 0:
        return {}
    loaded, info = _load(Path(folder) / "real")
    return {
        "gathered": gathered,
        "sharded": any(local[name] != tuple(p.shape) for name, p in reference.named_parameters()),
        "info": info,
        "equal": torch.equal(_logits(loaded, _input_ids()), _logits(reference, _input_ids())),
        "tied": loaded.lm_head.weight is loaded.model.embed_tokens.weight,
        "config": json.loads((Path(folder) / "real" / "config.json").read_text()),
    }


def test_save_model_of_an_fsdp2_sharded_model(tmp_path):
    """Every process takes part in gathering the full state dict; the main process alone writes it."""
    result = spawn.run(functools.partial(_fsdp2_save, str(tmp_path)), 2, tmp_path)
    assert result["sharded"], "the control: each process held only shards"
    assert result["gathered"] == [True], "the full state dict, gathered through torch's FSDP2 state-dict API"
    assert result["info"] == {"missing_keys": [], "mismatched_keys": [], "unexpected_keys": []}
    assert result["equal"] and result["tied"]
    assert result["config"]["architectures"] == ["P2RForCausalLM"], "not FSDP2's FSDPP2RForCausalLM"
    assert result["config"]["auto_map"]["AutoModelForCausalLM"] == "modeling_p2r.P2RForCausalLM"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json", "real"], "no temporary folder left"
    assert P2RForCausalLM.from_pretrained(tmp_path / "real").config.num_unique_layers == 2
