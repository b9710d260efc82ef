"""Documents -> tokens -> fixed-length blocks: documents grouped into chunks of at most `CHUNK_CHARS` characters (a long
one cut at `cut_point`), tokenized and packed with an end-of-text token after each, cut into `block_size` tokens."""

from collections.abc import Callable

import numpy as np
from datasets import Dataset, IterableDataset
from transformers import PreTrainedTokenizerBase

from ...config import DataArguments

CHUNK_CHARS = 1 << 16  # the most characters tokenized as one piece of a document
PACK_CHUNKS = 16  # chunks (of at most CHUNK_CHARS) per packed batch: 1 MiB of text, whose tail (< 1 block) is dropped


def chunker(column: str, chunk_chars: int = CHUNK_CHARS) -> Callable[[dict], dict]:
    """The batched map that groups a batch of documents into chunks of at most `chunk_chars` characters: a chunk is
    consecutive documents, or pieces of them (`segments`, with `starts` / `ends`: whether a segment starts or ends its
    document). A document longer than `chunk_chars` is cut into pieces (`cut_point`); blank documents are skipped."""

    def chunk(batch: dict) -> dict:
        rows = {"segments": [], "starts": [], "ends": []}
        current = {"segments": [], "starts": [], "ends": []}
        size = 0

        def close():
            nonlocal size
            if current["segments"]:
                for key, values in current.items():
                    rows[key].append(values.copy())
                    values.clear()
            size = 0

        for text in batch[column]:
            if not text or text.isspace():  # e.g. WikiText's blank lines
                continue
            if size + len(text) > chunk_chars:
                close()
            start = 0
            while len(text) - start > chunk_chars:
                cut = cut_point(text, start, start + chunk_chars)
                for key, value in zip(current, (text[start:cut], start == 0, False)):
                    current[key].append(value)
                close()
                start = cut
            for key, value in zip(current, (text[start:], start == 0, True)):
                current[key].append(value)
            size += len(text) - start
        close()
        return rows

    return chunk


def cut_point(text: str, start: int, end: int) -> int:
    """Where to end a piece of `text` that starts at `start` and may not reach `end`: before the last space in
    (start, end) that a character other than whitespace follows, else at the start of the last line that begins with
    one after one (a line break between two such characters), else at `end`. No pre-tokenizer of the byte-level,
    GPT-2/Llama-3 (regex) or whitespace kinds joins across the first two: the pieces' tokens are the whole text's."""
    space = text.rfind(" ", start + 1, end)
    while space > start:
        if space + 1 < len(text) and not text[space + 1].isspace():
            return space
        space = text.rfind(" ", start + 1, space)
    newline = text.rfind("\n", start + 1, end - 1)
    while newline > start:
        if not text[newline + 1].isspace() and not text[newline - 1].isspace():
            return newline + 1
        newline = text.rfind("\n", start + 1, newline)
    return end


def packer(tokenizer: PreTrainedTokenizerBase, block_size: int) -> Callable[[dict], dict]:
    """The batched map that turns a batch of chunks (`chunker`'s) into blocks: each document's tokens then
    end-of-text, concatenated and cut into `block_size` tokens; the tail of each batch is dropped (less than one
    block). A whole document is tokenized as the tokenizer does (special tokens included); the pieces of a long one
    without its special tokens, which are put where the tokenizer puts them (before its first piece, after its last)."""
    eos = tokenizer.eos_token_id
    specials: list[tuple[list[int], list[int]]] = []  # (before, after) a document's tokens: found when first needed

    def special_tokens() -> tuple[list[int], list[int]]:
        if not specials:
            bare = tokenizer("a", add_special_tokens=False)["input_ids"]
            full = tokenizer("a")["input_ids"]
            at = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), None)
            specials.append((full[:at], full[at + len(bare) :]) if at is not None else ([], []))
        return specials[0]

    def tokenize_and_pack(batch: dict) -> dict:
        segments = [
            (text, starts, ends)
            for texts, starts_row, ends_row in zip(batch["segments"], batch["starts"], batch["ends"])
            for text, starts, ends in zip(texts, starts_row, ends_row)
        ]
        whole = [text for text, first, last in segments if first and last]
        pieces = [text for text, first, last in segments if not (first and last)]
        whole_ids = iter(tokenizer(whole, return_attention_mask=False)["input_ids"] if whole else [])
        piece_ids = iter(
            tokenizer(pieces, add_special_tokens=False, return_attention_mask=False)["input_ids"] if pieces else []
        )
        ids = []
        for _, first, last in segments:
            if first and last:
                ids += next(whole_ids)
            else:
                before, after = special_tokens()
                ids += (before if first else []) + next(piece_ids) + (after if last else [])
            if last:
                ids.append(eos)
        usable = len(ids) // block_size * block_size
        return {"input_ids": np.array(ids[:usable], dtype=np.int64).reshape(-1, block_size)}

    return tokenize_and_pack


def tokenized_blocks(
    documents: Dataset | IterableDataset, tokenizer: PreTrainedTokenizerBase, args: DataArguments, **cache
) -> Dataset | IterableDataset:
    """The blocks of `documents` (`chunker`, then `packer`); `cache`: `cache_file` and `fingerprint` of a map-style
    dataset's two cache files (`chunks-*`, `blocks-*`), the tokenizing processes (`num_proc`)."""
    column = args.text_column
    documents = documents.select_columns([column])
    stages = [
        ("chunks", chunker(column), {"remove_columns": [column]}),
        ("blocks", packer(tokenizer, args.block_size), {"remove_columns": ["segments", "starts", "ends"]}),
    ]
    data = documents
    for name, function, options in stages:
        if name == "blocks":
            options["batch_size"] = PACK_CHUNKS
        if isinstance(data, Dataset):
            options |= {
                "cache_file_name": str(cache["cache_file"]).replace("blocks-", f"{name}-"),
                "new_fingerprint": f"{cache['fingerprint']}-{name}",
                "num_proc": cache.get("num_proc") if name == "blocks" else None,
                "desc": "Tokenizing and packing" if name == "blocks" else "Cutting documents into chunks",
            }
        data = data.map(function, batched=True, **options)
    return data
