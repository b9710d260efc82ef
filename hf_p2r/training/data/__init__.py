"""Data: text -> documents -> tokens -> fixed-length blocks, with a validation split held out by document, all through
`datasets`.

Two kinds of source:

- map-style (the default): the corpus is read, split into documents, shuffled, split into training and validation
  documents (`validation_fraction` of the text, whole documents), tokenized and packed once, by the main process (the
  others wait, then read its cache files under the datasets cache: `build_blocks`), and training visits its blocks in
  a seeded order that is a pure function of the position (`BlockOrder`).
- streaming (`streaming: true`): a `datasets` `IterableDataset` over local JSON lines / Parquet / text shards or a Hub
  dataset, split per process with `split_dataset_by_node` and tokenized and packed on the fly (`stream_blocks`); its
  position is the dataset's `state_dict()`, saved with every checkpoint, so a resumed run reads exactly the blocks an
  uninterrupted one would have read. Validation reads a fixed held-out stream (`validation_files`, or the Hub
  dataset's validation split): its first `eval_blocks` blocks, the same for every evaluation and process count.

Documents: a JSON / Parquet / Hub record is one; a text file is split at blank lines (.txt, .md, .rst: a line holding
only whitespace ends a document) or kept whole (.py), or at `text_document_separator` when it is given ('' keeps every
file whole). A document is tokenized in pieces of at most `CHUNK_CHARS` characters, cut before a space or at a line
start (`cut_point`: the same tokens as the whole document's for the byte-level and GPT-2/Llama-3-style BPE tokenizers,
where a piece holds such a place; a SentencePiece-style one may differ by a token at a cut), so the memory a run needs
does not grow with the size of a document.

What a run's data position refers to (`data_source`: the files with their sizes and modification times, the Hub
dataset, or the built-in corpus's digest) is kept with the position in every checkpoint (`BlockOrder.state_dict`,
`BlockStream.state_dict`); a resume on other data is refused in one line, or warned about with `allow_data_change`.

The default corpus needs no download: a deterministic subset of the Python standard library's `.py` files, which
every Python installation ships. The default tokenizer is built here: byte-level, 256 byte tokens (id = byte value)
plus two specials, saved next to every model as a plain `tokenizer.json`, so `AutoTokenizer.from_pretrained(folder)`
loads it with transformers alone.

The modules, by job: `tokenizer` (the built-in byte-level tokenizer, `load_tokenizer`), `documents` (text -> documents:
the built-in corpus, local files, a Hub dataset), `packing` (documents -> tokens -> blocks), `source` (what a data
position refers to, and the check of a resume against it), `blocks` (map-style: `build_blocks`, `BlockOrder`),
`streaming` (`stream_blocks`, `BlockStream`). This package's names are theirs.
"""

from ...config import DataArguments
from .blocks import BlockOrder, Blocks, blocks_cache_file, build_blocks
from .documents import (
    BLANK_LINES,
    DATA_SUFFIXES,
    JSON_SUFFIXES,
    KINDS,
    PARQUET_SUFFIXES,
    PROSE_SUFFIXES,
    READ_CHARS,
    TEXT_SUFFIXES,
    document_separator,
    load_documents,
    split_documents,
    stdlib_corpus,
    text_documents,
)
from .packing import CHUNK_CHARS, PACK_CHUNKS, chunker, cut_point, packer, tokenized_blocks
from .source import check_data_change, check_output_dir_outside_data, data_changes, data_source
from .streaming import BlockStream, EmptyStreamError, stream_blocks
from .tokenizer import END_OF_TEXT, PAD, byte_level_tokenizer, load_tokenizer

__all__ = [
    "BLANK_LINES",
    "BlockOrder",
    "BlockStream",
    "Blocks",
    "CHUNK_CHARS",
    "DATA_SUFFIXES",
    "DataArguments",
    "END_OF_TEXT",
    "EmptyStreamError",
    "JSON_SUFFIXES",
    "KINDS",
    "PACK_CHUNKS",
    "PAD",
    "PARQUET_SUFFIXES",
    "PROSE_SUFFIXES",
    "READ_CHARS",
    "TEXT_SUFFIXES",
    "blocks_cache_file",
    "build_blocks",
    "byte_level_tokenizer",
    "check_data_change",
    "check_output_dir_outside_data",
    "chunker",
    "cut_point",
    "data_changes",
    "data_source",
    "document_separator",
    "load_documents",
    "load_tokenizer",
    "packer",
    "split_documents",
    "stdlib_corpus",
    "stream_blocks",
    "text_documents",
    "tokenized_blocks",
]
