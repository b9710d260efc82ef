"""Data: the byte-level tokenizer, the built-in corpus, packing, the validation split and the block order."""

import torch
from transformers import AutoTokenizer

from hf_p2r.training import DataArguments
from hf_p2r.training.data import BlockOrder, build_blocks, byte_level_tokenizer, stdlib_corpus


def test_byte_level_tokenizer_round_trips_and_loads_with_auto_tokenizer(tmp_path):
    tokenizer = byte_level_tokenizer()
    text = "def f(x):\n\treturn 'héllo' + \"🙂\"  # ünïcode\n"
    ids = tokenizer(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert (len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id) == (258, 256, 257)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text)["input_ids"] == ids and loaded.eos_token == "<|endoftext|>"


def test_stdlib_corpus_is_deterministic_and_bounded():
    first, second = stdlib_corpus(50_000), stdlib_corpus(50_000)
    assert first["text"] == second["text"] and len(first) > 1
    assert sum(len(text.encode()) for text in first["text"]) <= 50_000


def test_blocks_pack_documents_with_end_of_text_and_hold_out_the_tail(tmp_path):
    files = []
    for i in range(20):
        path = tmp_path / f"doc{i}.txt"
        path.write_text(f"document {i} " * 30)
        files.append(str(path))
    tokenizer = byte_level_tokenizer()
    args = DataArguments(train_files=files, block_size=64, validation_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    train, validation = build_blocks(args, tokenizer, seed=0)
    total = sum(len(f"document {i} " * 30) + 1 for i in range(20))  # + one end-of-text token per document
    assert len(train) + len(validation) == total // 64
    assert len(validation) == round((total // 64) * 0.2)
    assert train[0]["input_ids"].shape == (64,) and train[0]["input_ids"].dtype == torch.long
    stream = torch.cat([train[:]["input_ids"].flatten(), validation[:]["input_ids"].flatten()])
    assert (stream == 256).sum() >= 19  # documents are separated by <|endoftext|>
    again, _ = build_blocks(args, tokenizer, seed=0)
    assert torch.equal(again[:]["input_ids"], train[:]["input_ids"])
    other, _ = build_blocks(args, tokenizer, seed=1)
    assert not torch.equal(other[:]["input_ids"], train[:]["input_ids"]), "the seed shuffles the documents"


def test_block_order_is_a_pure_function_of_the_position():
    order = BlockOrder(num_blocks=10, seed=3)
    run = order.indices(0, 25)
    assert sorted(run[:10]) == list(range(10)) and sorted(run[10:20]) == list(range(10))
    assert run[:10] != run[10:20], "each epoch has its own permutation"
    assert BlockOrder(10, 3).indices(13, 7) == run[13:20]  # resuming at position 13 needs no replay
    assert BlockOrder(10, 4).indices(0, 10) != run[:10]
