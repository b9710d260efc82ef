"""Documents (issues 36 and 37): text files split into documents at blank lines or a separator, read a bounded piece at
a time; long documents tokenized in bounded pieces to the same tokens; the data a run resumes on is the data it saved
(refused in one line, or a one-line warning with allow_data_change); an output_dir inside the data is refused; the
run's first lines say what each split holds."""

import json
import os
import subprocess
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from hf_p2r.errors import InputError
from hf_p2r.training import DataArguments
from hf_p2r.training.data import (
    BLANK_LINES,
    BlockOrder,
    byte_level_tokenizer,
    check_data_change,
    check_output_dir_outside_data,
    chunker,
    data_source,
    packer,
    text_documents,
)
from hf_p2r.training.data import documents as documents_module

from .helpers import PYTHON, REPO, subprocess_env, tiny_argv

PROSE = "The first paragraph,\nwrapped.\n\nThe second one.\n \t\n\n\nThird: after blank lines of spaces.\n"


def _documents(path, separator=None, read_chars=None) -> list[str]:
    with mock.patch.object(documents_module, "READ_CHARS", read_chars or documents_module.READ_CHARS):
        return [row["text"] for row in text_documents([str(path)], [None], separator=separator)]


def test_text_files_split_at_blank_lines_by_default_and_py_files_stay_whole(tmp_path):
    (tmp_path / "a.txt").write_bytes(PROSE.replace("\n", "\r\n").encode())  # (Windows line ends read as \n)
    assert _documents(tmp_path / "a.txt") == [
        "The first paragraph,\nwrapped.",
        "The second one.",
        "Third: after blank lines of spaces.\n",
    ]
    (tmp_path / "b.py").write_text("def f():\n    pass\n\n\ndef g():\n    pass\n")
    assert _documents(tmp_path / "b.py") == ["def f():\n    pass\n\n\ndef g():\n    pass\n"]
    assert _documents(tmp_path / "a.txt", separator="") == [PROSE]  # '' : one document per file
    (tmp_path / "c.md").write_text("one\n\ntwo\n\n\nthree")
    assert _documents(tmp_path / "c.md", separator="\\n\\n\\n") == ["one\n\ntwo", "three"]  # escapes as typed
    assert _documents(tmp_path / "c.md", separator="<doc>") == ["one\n\ntwo\n\n\nthree"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    parts=st.lists(st.text(alphabet="ab \t\n<|>", max_size=12), max_size=12),
    separator=st.sampled_from([None, "<|>", "\n\n\n", "\t"]),
    read_chars=st.integers(1, 9),
)
def test_documents_read_a_piece_at_a_time_are_the_documents_of_the_whole_text(tmp_path, parts, separator, read_chars):
    """Read `read_chars` characters at a time (a separator may straddle two reads), a file gives the documents of
    splitting its whole text: at blank lines (None), or at the separator; blank ones skipped."""
    text = "".join(parts)
    path = tmp_path / "doc.txt"
    path.write_text(text)
    expected = BLANK_LINES.split(text) if separator is None else text.split(separator)
    expected = [document for document in expected if document.strip()]
    found = _documents(path, separator.replace("\n", "\\n").replace("\t", "\\t") if separator else None, read_chars)
    if separator is None:  # a document's leading blank lines stay with the separator before it
        found, expected = [d.lstrip("\n \t") for d in found], [d.lstrip("\n \t") for d in expected]
    assert found == expected


def _bpe_tokenizer(corpus: list[str], bos: bool = False) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE (regex pre-tokenizer, merges) trained here on `corpus`; with `bos`, one that puts
    <s> before every text (Llama-style)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(corpus, trainer)
    if bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


TEXTS = [
    "def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 6,
    "The quick brown fox jumps over the lazy dog. " * 12,
    "short",
    "line one\nline two\n  indented\nback to the start " * 5,
    "Tab\tseparated\n \nthen a line\nafter spaces \nand (brackets) or 'quotes', 123 456.\n" * 4,
]
NO_SPACE = "x" * 300  # no line break, no space: cut anywhere (the byte-level tokenizer's tokens stay the same)


def _token_stream(tokenizer, texts: list[str], chunk_chars: int) -> tuple[list[int], int]:
    """The packed token stream of `texts` chunked at `chunk_chars` (block size 1: nothing dropped), and the longest
    piece tokenized at once."""
    chunks = chunker("text", chunk_chars)({"text": texts})
    longest = max(len(piece) for pieces in chunks["segments"] for piece in pieces)
    assert all(sum(map(len, pieces)) <= chunk_chars for pieces in chunks["segments"]), "a chunk over its bound"
    blocks = packer(tokenizer, 1)(chunks)["input_ids"]
    return blocks.flatten().tolist(), longest


@pytest.mark.parametrize("kind", ["byte-level", "BPE", "BPE with <s>"])
@pytest.mark.parametrize("chunk_chars", [16, 50, 97])
def test_long_documents_are_tokenized_in_bounded_pieces_to_the_tokens_of_the_whole(kind, chunk_chars):
    """Cut into pieces of at most `chunk_chars` characters (at line starts, else between words, else anywhere), the
    documents give the token stream of tokenizing each whole (special tokens where the tokenizer puts them, then
    <|endoftext|>), for the built-in byte-level tokenizer and GPT-2-style BPEs."""
    tokenizer = {
        "byte-level": byte_level_tokenizer,
        "BPE": lambda: _bpe_tokenizer(TEXTS),
        "BPE with <s>": lambda: _bpe_tokenizer(TEXTS, bos=True),
    }[kind]()
    texts = TEXTS + [NO_SPACE] if kind == "byte-level" else TEXTS
    whole, longest = _token_stream(tokenizer, texts, chunk_chars=10**6)
    assert longest == max(map(len, texts))
    pieces, longest = _token_stream(tokenizer, texts, chunk_chars=chunk_chars)
    assert longest <= chunk_chars
    assert pieces == whole
    expected = [t for text in texts for t in (*tokenizer(text)["input_ids"], tokenizer.eos_token_id)]
    assert whole == expected


WORDS = st.text(alphabet="ab1.(')", min_size=1, max_size=3)
# Each ends where a cut may go (`cut_point`: before a space or at a line start, a word on both sides). Not a blank
# line ("\n\n"): a line start after one is no place to cut (a piece ending in "\n\n" pre-tokenizes it as one
# whitespace run, the whole text as two), and blank lines split plain text into documents anyway; a window with no
# place to cut is cut at its end, where the tokens may differ (docs/training.md: "Long documents").
GAPS = st.sampled_from([" ", "  ", "\n", " \n ", "\t ", "\n  "])


@settings(max_examples=300, deadline=None)
@given(
    documents=st.lists(st.lists(st.tuples(WORDS, GAPS), min_size=1, max_size=30), min_size=1, max_size=4),
    chunk_chars=st.integers(8, 40),
)
def test_pieces_give_the_same_tokens_for_any_text_with_room_to_cut(documents, chunk_chars):
    """Words of up to 3 characters between gaps of whitespace (each window of 8 characters holds a place to cut):
    the GPT-2-style BPE's tokens of the pieces are those of the whole documents."""
    texts = ["".join(word + gap for word, gap in words) for words in documents]
    tokenizer = _BPE[0]
    assert _token_stream(tokenizer, texts, chunk_chars)[0] == _token_stream(tokenizer, texts, 10**6)[0]


_BPE = [_bpe_tokenizer(TEXTS + ["ab1 .\n\tba 11 a.b (a) 'b' \n\n  a1"] * 3)]


def test_a_resume_on_other_data_is_refused_in_one_line_or_warned_about(tmp_path):
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for path in files:
        path.write_text("some text\n")
    args = DataArguments(train_files=[str(tmp_path)])
    saved = json.loads(json.dumps(BlockOrder(10, 0, data_source(args)).state_dict()))  # as a checkpoint keeps it
    checkpoint = tmp_path / "checkpoint-4"
    assert BlockOrder(10, 0, data_source(args)).resume([saved], 0, 1, checkpoint) is None
    assert BlockOrder(10, 0, data_source(args)).resume([], 0, 1, checkpoint) is None  # (saved by an earlier hf-p2r)
    files[0].write_text("some other text\n")
    os.utime(files[1], ns=(0, 0))
    (tmp_path / "c.txt").write_text("new")
    with pytest.raises(InputError) as refused:
        BlockOrder(10, 0, data_source(args)).resume([saved], 0, 1, checkpoint)
    assert str(refused.value) == (
        f"resume_from_checkpoint: the training data changed since {checkpoint} was saved ({tmp_path}/c.txt is new; "
        f"{tmp_path}/a.txt: 10 bytes then, 16 now; {tmp_path}/b.txt: modified (same size)): the data position it "
        "holds would point into other data; restore the data, or pass --allow_data_change to resume on it"
    )
    warning = BlockOrder(10, 0, data_source(args), allow_change=True).resume([saved], 0, 1, checkpoint)
    assert (
        warning.startswith(f"warning: the training data changed since {checkpoint} was saved (") and "\n" not in warning
    )
    assert check_data_change({"dataset_name": "a/b", "dataset_config_name": None}, data_source(args), checkpoint, True)


def test_an_output_dir_inside_a_data_folder_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    args = DataArguments(train_files=[str(tmp_path / "data")])
    with pytest.raises(InputError, match=r"^output_dir: \S*data/run is inside \S*/data, a folder of train_files: "):
        check_output_dir_outside_data(args, tmp_path / "data" / "run")
    check_output_dir_outside_data(args, tmp_path / "run")  # beside it: fine
    check_output_dir_outside_data(DataArguments(train_files=[str(tmp_path / "data")]), tmp_path)  # above it: fine


def _script(argv: list[str], cwd) -> subprocess.CompletedProcess:
    command = [PYTHON, str(REPO / "scripts/train.py"), *argv]
    return subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), cwd=cwd, timeout=600)


def _errors(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if "error" in line.lower() or "warning: the" in line]


def test_a_run_says_what_its_splits_hold_and_resumes_only_on_its_own_data(tmp_path):
    """As users run it (fresh processes): the first lines count each split's documents and tokens; changed data is
    refused at resume in one line (exit 2, the run's outputs unchanged), resumed on with a one-line warning under
    --allow_data_change; an output_dir inside the data folder is refused before anything is written."""
    data = tmp_path / "corpus"
    data.mkdir()
    paragraphs = [f"Paragraph {i}: " + "some words and more words " * (3 + i % 5) for i in range(60)]
    (data / "corpus.txt").write_text("\n\n".join(paragraphs))
    argv = tiny_argv(tmp_path / "run", pseudo_steps=2, real_steps=2, eval_steps=2, save_steps=2, warmup_steps=1)
    argv += ["--train_files", str(data), "--cache_dir", str(tmp_path / "cache")]
    first = _script([*argv, "--real_steps", "1"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    printed = (first.stdout + first.stderr).splitlines()
    report = [line for line in printed if line.startswith("data: ")]
    assert (
        report[0] == f"data: train_files: 1 file, {(data / 'corpus.txt').stat().st_size:,} bytes; text files split "
        "into documents at blank lines (.py files: one document each)"
    )
    counts = [int(line.split()[2]) for line in report[1:]]
    assert report[1].startswith("data: train ") and report[2].startswith("data: validation ")
    assert sum(counts) == 60 and counts[1] >= 3  # 5% of the text, by whole documents
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()

    size = (data / "corpus.txt").stat().st_size
    with (data / "corpus.txt").open("a") as corpus:
        corpus.write("\n\nOne paragraph more.")
    resume = [*argv, "--resume_from_checkpoint", "latest"]
    refused = _script(resume, tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert _errors(refused) == [
        f"train.py: error: resume_from_checkpoint: the training data changed since "
        f"{tmp_path / 'run/checkpoints/checkpoint-3'} was saved ({data / 'corpus.txt'}: "
        f"{size:,} bytes then, {size + 21:,} now): the "
        "data position it holds would point into other data; restore the data, or pass --allow_data_change to "
        "resume on it"
    ], refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr and (tmp_path / "run" / "metrics.jsonl").read_text() == metrics

    allowed = _script([*resume, "--allow_data_change", "true"], tmp_path)
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    warnings = [line for line in (allowed.stdout + allowed.stderr).splitlines() if line.startswith("warning: the")]
    assert len(warnings) == 1 and "corpus.txt: " in warnings[0] and "resuming on it anyway" in warnings[0]

    inside = _script([*tiny_argv(data / "run", pseudo_steps=1, real_steps=1), "--train_files", str(data)], tmp_path)
    assert inside.returncode == 2 and not (data / "run").exists()
    assert _errors(inside) == [
        f"train.py: error: output_dir: {data / 'run'} is inside {data}, a folder of train_files: the next run would "
        "read this run's files as data; write the run elsewhere"
    ], inside.stderr[-3000:]
