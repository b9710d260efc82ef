"""Data: the byte-level tokenizer, the built-in corpus, JSON files with a tokenizer of one's own, packing, the
validation split and the block order."""

import hashlib
import json
import os
import subprocess
import sysconfig
from functools import partial
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from hf_p2r.errors import InputError
from hf_p2r.training import DataArguments, parse_config, train
from hf_p2r.training.data import BlockOrder, build_blocks, byte_level_tokenizer, load_tokenizer, stdlib_corpus
from hf_p2r.training.data.documents import python_sources

from .helpers import PYTHON, REPO, subprocess_env, tiny_argv

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


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


def _candidates_as_before(root: Path) -> list[str | None]:
    """The corpus's files before it skipped folders and unfitting files unread: every `.py` file under `root` listed
    with `Path.rglob`, in the hash order, read whole (None: unreadable)."""
    files = [
        path
        for path in root.rglob("*.py")
        if not {"site-packages", "dist-packages", "test", "tests", "idle_test"} & set(path.relative_to(root).parts)
    ]
    files.sort(key=lambda path: hashlib.sha256(path.relative_to(root).as_posix().encode()).hexdigest())
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            texts.append(None)
    return texts


def _selected_as_before(candidates: list[str | None], max_bytes: int) -> list[str]:
    texts, total = [], 0
    for text in candidates:
        if text is not None and total + len(text.encode()) <= max_bytes:
            texts.append(text)
            total += len(text.encode())
    return texts


def test_python_sources_selects_what_reading_every_file_selected(tmp_path):
    """The corpus reads only the files that may fit, and takes the same files, in the same order, with the same text,
    as reading every file did: on the standard library for budgets from nothing to all of it, and on a folder with
    the cases the shortcuts must get right (CRLF text shorter than its file, empty files, skipped folders at any
    depth, a non-UTF-8 file, a folder named like a source, links to a file, to a folder and to nothing)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    candidates = _candidates_as_before(stdlib)
    everything = sum(len(text.encode()) for text in candidates if text is not None)
    for max_bytes in (0, 1, 1_000, 40_000, 50_000, 1_000_000, everything):
        assert python_sources(stdlib, max_bytes) == _selected_as_before(candidates, max_bytes), max_bytes

    root = tmp_path / "src"
    files = {
        "crlf.py": b"x = 1\r\n" * 40,  # 280 bytes, 240 as text
        "lone_cr.py": b"y = 2\r" * 10,
        "empty.py": b"",
        "small.py": b"z = 3\n",
        "mid.py": b"# " + b"m" * 150 + b"\n",
        "latin1.py": "caf\xe9 = 4\n".encode("latin-1"),
        "pkg/inner.py": b"a = 5\n" * 20,
        "pkg/tests/skipped.py": b"b = 6\n",
        "site-packages/third.py": b"c = 7\n",
        "deep/er/test/skipped.py": b"d = 8\n",
        "folder.py/kept.py": b"e = 9\n",
        "notes.txt": b"not a source\n",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / "link.py").symlink_to(root / "small.py")
    (root / "broken.py").symlink_to(root / "missing.py")
    (root / "linked").symlink_to(root / "pkg", target_is_directory=True)
    candidates = _candidates_as_before(root)
    assert sum(text is not None for text in candidates) == 8  # (skipped folders, the bad file and links aside)
    sizes = range(0, sum(len(text.encode()) for text in candidates if text is not None) + 2)
    for max_bytes in sizes:
        assert python_sources(root, max_bytes) == _selected_as_before(candidates, max_bytes), max_bytes
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "crlf.py").write_bytes(files["crlf.py"])
    assert python_sources(alone, 240) == ["x = 1\n" * 40]  # 280 bytes on disk, 240 as text: it fits


def test_validation_is_held_out_by_document_and_the_report_counts_each_split(tmp_path):
    """Each document lands whole in one split (the seeded shuffle decides which), validation holds at least
    validation_fraction of the text and at most one document more; each split is its documents' bytes, each closed by
    <|endoftext|>, cut into blocks; the report's counts are the splits' own."""
    texts = [f"document {i:02d} " * (5 + i % 7) for i in range(20)]
    for i, text in enumerate(texts):
        (tmp_path / f"doc{i:02d}.txt").write_text(text)
    tokenizer = byte_level_tokenizer()
    args = DataArguments(
        train_files=[str(tmp_path)], block_size=16, validation_fraction=0.2, cache_dir=str(tmp_path.parent / "cache")
    )
    blocks = build_blocks(args, tokenizer, seed=0)
    train, validation = blocks
    assert train[0]["input_ids"].shape == (16,) and train[0]["input_ids"].dtype == torch.long
    split = {}
    for name, dataset in {"train": train, "validation": validation}.items():
        text = tokenizer.decode(dataset[:]["input_ids"].flatten().tolist())
        *whole, cut = text.split("<|endoftext|>")  # the last document of the split may be cut at its last block
        assert all(document in texts for document in whole) and any(t.startswith(cut) for t in texts), name
        split[name] = {texts.index(document) for document in whole}
        assert len(text) > sum(len(texts[i]) + 1 for i in split[name]) - 16
    assert not split["train"] & split["validation"], "no document in both splits"
    total, longest = sum(map(len, texts)), max(map(len, texts))
    outside_train = sum(len(texts[i]) for i in range(20) if i not in split["train"])  # (validation's, one cut)
    assert (
        outside_train / total >= 0.2 and sum(len(texts[i]) for i in split["validation"]) / total < 0.2 + longest / total
    )
    counts = [int(line.split()[2]) for line in blocks.report.splitlines()[1:]]
    assert sum(counts) == 20 and all(0 <= counts[k] - len(split[n]) <= 1 for k, n in enumerate(split)), counts
    assert blocks.report.splitlines() == [
        f"data: train_files: 20 files, {sum(map(len, texts)):,} bytes; text files split into documents at blank lines "
        "(.py files: one document each)",
        f"data: train {counts[0]} documents, {len(train) * 16:,} tokens in {len(train)} blocks of 16",
        f"data: validation {counts[1]} documents, {len(validation) * 16:,} tokens in {len(validation)} blocks of "
        "16 (held out by document: 20% of the text)",
    ]
    again = build_blocks(args, tokenizer, seed=0)
    assert torch.equal(again.train[:]["input_ids"], train[:]["input_ids"])
    other = build_blocks(args, tokenizer, seed=1)
    assert not torch.equal(other.train[:]["input_ids"], train[:]["input_ids"]), "the seed shuffles the documents"


def test_block_order_is_a_pure_function_of_the_position():
    order = BlockOrder(num_blocks=10, seed=3)
    run = order.indices(0, 25)
    assert sorted(run[:10]) == list(range(10)) and sorted(run[10:20]) == list(range(10))
    assert run[:10] != run[10:20], "each epoch has its own permutation"
    assert BlockOrder(10, 3).indices(13, 7) == run[13:20]  # resuming at position 13 needs no replay
    assert BlockOrder(10, 4).indices(0, 10) != run[:10]


def _word_tokenizer_folder(path) -> str:
    """A word-level tokenizer built here (no download), saved as a folder: one id per word of WORDS, `</s>` = 1."""
    vocab = {word: index for index, word in enumerate(["[UNK]", "</s>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>").save_pretrained(path)
    return str(path)


def _json_files(folder, documents: list[str]) -> list[str]:
    """The documents split over a JSON file (an array of records) and a JSON Lines file, in column "content"."""
    half = len(documents) // 2
    records = [{"content": text, "source": "web"} for text in documents]
    (folder / "part1.json").write_text(json.dumps(records[:half]))
    (folder / "part2.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records[half:]))
    return [str(folder / "part1.json"), str(folder / "part2.jsonl")]


def test_json_and_jsonl_files_with_a_local_tokenizer(tmp_path):
    tokenizer = load_tokenizer(_word_tokenizer_folder(tmp_path / "tokenizer"))
    assert (len(tokenizer), tokenizer.eos_token_id) == (len(WORDS) + 2, 1)
    # Eight documents of three words: with the end-of-text token each fills one block of 4 tokens exactly.
    documents = [" ".join(WORDS[i : i + 3]) for i in range(0, 12, 3)]
    documents += ["mu alpha beta", "gamma mu mu", "kappa kappa iota", "zeta eta alpha"]
    args = DataArguments(
        train_files=_json_files(tmp_path, documents),
        text_column="content",
        block_size=4,
        validation_fraction=0.25,
        cache_dir=str(tmp_path / "cache"),
    )
    train_blocks, validation = build_blocks(args, tokenizer, seed=0)
    assert (len(train_blocks), len(validation)) == (6, 2)  # 25% of the text: two of the eight documents
    blocks = sorted(tuple(block.tolist()) for block in [*train_blocks["input_ids"], *validation["input_ids"]])
    expected = sorted((*(WORDS.index(word) + 2 for word in text.split()), 1) for text in documents)
    assert blocks == expected  # every document once, in the tokenizer's ids (not bytes), each closed by </s>


def test_a_run_on_json_files_saves_the_given_tokenizer_with_the_models(tmp_path):
    folder = _word_tokenizer_folder(tmp_path / "tokenizer")
    documents = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(5 + i % 7)) for i in range(120)]
    output_dir = tmp_path / "run"
    argv = tiny_argv(output_dir, pseudo_steps=1, real_steps=1, eval_steps=0, corpus_max_bytes=1000)
    argv += ["--train_files", *_json_files(tmp_path, documents), "--text_column", "content", "--tokenizer_name", folder]
    assert train(parse_config(argv)) == 0
    given = load_tokenizer(folder)
    for stage in ("pseudo", "real"):
        saved = AutoTokenizer.from_pretrained(output_dir / stage)
        assert saved("kappa mu alpha")["input_ids"] == given("kappa mu alpha")["input_ids"] == [11, 13, 2]
        assert saved.eos_token == "</s>"
    config = AutoModelForCausalLM.from_pretrained(output_dir / "real").config
    assert (config.vocab_size, config.eos_token_id) == (64, 1)  # the tokenizer's 14 ids, rounded up to 64


TEXT = "def f(x):\n    return x + 1\n" * 40
BINARY = bytes(range(256)) * 4  # byte 0x80 at offset 128 is the first that is not UTF-8
BAD_DATA = {
    "binary text": ({"a.txt": BINARY}, r"a\.txt is not UTF-8 text \(byte 0x80 at offset 128\): a binary file\?"),
    "binary JSON lines": ({"a.jsonl": BINARY}, r"a\.jsonl is not UTF-8 text \(byte 0x80 at offset 128\)"),
    "a bad JSON line": ({"a.jsonl": '{"text": "ok"}\n{"text": \n'}, r"a\.jsonl line 2 is not valid JSON \(Expecting"),
    "empty text": ({"a.txt": ""}, r"/a\.txt is empty or whitespace only: no text to train on$"),
    "blank text": ({"a.txt": " \n\t\n\n"}, r"a\.txt is empty or whitespace only"),
    "empty JSON lines": ({"a.jsonl": ""}, r"a\.jsonl is empty or whitespace only"),
    "blank JSON lines": ({"a.jsonl": "\n \n"}, r"a\.jsonl is empty or whitespace only"),
    "two blank files": ({"a.txt": "", "b.txt": "\n"}, r"a\.txt, \S*b\.txt \(2 files\) are empty or whitespace only"),
}


def _write(folder, files: dict) -> list[str]:
    for name, content in files.items():
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return [str(folder / name) for name in files]


@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_data_is_one_line_naming_the_file(tmp_path, case):
    files, message = BAD_DATA[case]
    args = DataArguments(train_files=_write(tmp_path, files), block_size=16, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(InputError, match=f"^train_files: .*{message}") as raised:
        build_blocks(args, byte_level_tokenizer(), seed=0)
    assert "\n" not in str(raised.value)


def test_a_blank_file_beside_text_is_skipped(tmp_path):
    """A batch of documents that are all blank once stopped the tokenizer (IndexError); it gives no blocks now."""
    files = _write(tmp_path, {"blank.txt": "  \n", "code.py": TEXT, "empty.txt": "", "more.py": TEXT})
    args = DataArguments(train_files=files, block_size=16, cache_dir=str(tmp_path / "cache"))
    blocks = build_blocks(args, byte_level_tokenizer(), seed=0)
    assert [len(blocks.train), len(blocks.validation)] == [(len(TEXT.encode()) + 1) // 16] * 2
    assert "data: train 1 documents" in blocks.report and "data: validation 1 documents" in blocks.report


def test_one_document_is_refused_in_one_line_naming_the_way_out(tmp_path):
    files = _write(tmp_path, {"code.py": TEXT})
    args = DataArguments(train_files=files, block_size=16, cache_dir=str(tmp_path / "cache"))
    message = rf"^train_files: {files[0]} holds one document, and validation is held out by document: .*separator"
    with pytest.raises(InputError, match=message):
        build_blocks(args, byte_level_tokenizer(), seed=0)


def test_the_script_refuses_binary_data_in_one_line_and_keeps_the_earlier_run(tmp_path):
    """As users run it (no traceback, no log line of datasets'), with --overwrite_output_dir: the earlier run is
    removed only once the new one has its data and model."""
    data = _write(tmp_path, {"notes.jsonl": BINARY})
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    (output_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    argv = tiny_argv(output_dir, pseudo_steps=1, real_steps=1, warmup_steps=1, overwrite_output_dir="true")
    command = [PYTHON, str(REPO / "scripts/train.py"), *argv, "--train_files", *data]
    result = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), cwd=REPO, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "error" in line.lower() or "fail" in line.lower()]
    assert lines == [
        f"train.py: error: train_files: {data[0]} is not UTF-8 text (byte 0x80 at offset 128): a binary file? give "
        "text (.txt, .md, .py, .rst), JSON lines (.json, .jsonl) or Parquet (.parquet) files"
    ], result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert (output_dir / "metrics.jsonl").read_text() == '{"step": 0}\n'


class CountingTokenizer:
    """The byte-level tokenizer; each call appends the calling process's rank to `marker` (a file both share)."""

    def __init__(self, marker: str):
        self.tokenizer, self.marker = byte_level_tokenizer(), marker

    def __getattr__(self, name):
        return getattr(self.__dict__["tokenizer"], name)

    def __call__(self, texts, **options):
        with open(self.marker, "a") as marker:
            marker.write(os.environ["RANK"] + "\n")
        return self.tokenizer(texts, **options)


def tokenize_on_two_processes(folder: str, rank: int, world_size: int) -> dict:
    """Each source built by both processes, the main one first (as the trainer does): which ranks tokenized, and a
    digest of the blocks each process got."""
    from accelerate import PartialState

    state = PartialState(cpu=True)
    files = []
    for i in range(30):
        path = Path(folder) / f"doc{i}.txt"
        if rank == 0:
            path.write_text(f"document {i} " * 30)
        files.append(str(path))
    state.wait_for_everyone()
    out = {}
    sources = {
        "built-in corpus": dict(corpus_max_bytes=30_000),
        "built-in corpus, other block_size": dict(corpus_max_bytes=30_000, block_size=16),
        "text files": dict(train_files=files),
    }
    for name, fields in sources.items():
        marker = Path(folder) / f"{name}.calls"
        args = DataArguments(**{"block_size": 32, "cache_dir": f"{folder}/cache", **fields})
        with state.main_process_first():
            train_blocks, validation = build_blocks(args, CountingTokenizer(str(marker)), seed=0)
        blocks = torch.cat([train_blocks[:]["input_ids"], validation[:]["input_ids"]])
        digests = [None] * world_size
        torch.distributed.all_gather_object(digests, hashlib.sha256(blocks.numpy().tobytes()).hexdigest())
        state.wait_for_everyone()
        out[name] = {"callers": sorted(set(marker.read_text().split())), "digests": digests, "blocks": len(blocks)}
    return out


def test_a_map_style_corpus_is_tokenized_once_by_the_main_process(tmp_path):
    """Two gloo processes build the blocks of each source: only rank 0 ever calls the tokenizer (the built-in corpus,
    held in memory, once tokenized by every process), the other reads its cache file and gets the same blocks; a
    change of block_size names another cache file (tokenized again, by rank 0)."""
    from ..distributed import spawn

    built = spawn.run(partial(tokenize_on_two_processes, str(tmp_path)), 2, tmp_path)
    for name, result in built.items():
        assert result["callers"] == ["0"], name
        assert result["digests"][0] == result["digests"][1] and result["blocks"] > 10, name
