"""The tokenizer: a Hub or local one, or the built-in byte-level one (256 byte tokens plus two specials, saved next
to every model as a plain `tokenizer.json`, so `AutoTokenizer.from_pretrained(folder)` loads it with transformers
alone)."""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

END_OF_TEXT, PAD = "<|endoftext|>", "<|pad|>"


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """Every text round-trips; token i < 256 is byte i, then `<|endoftext|>` (256, bos/eos) and `<|pad|>` (257)."""
    # ByteLevel maps each byte to a printable character; a BPE without merges then emits one token per byte.
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([END_OF_TEXT, PAD])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT, pad_token=PAD
    )


def load_tokenizer(name_or_path: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer at `name_or_path` (folder or Hub name), or the built-in byte-level one for None."""
    if name_or_path is None:
        return byte_level_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer_name: {name_or_path} has no eos token, needed to separate packed documents")
    return tokenizer
