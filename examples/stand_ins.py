"""Stand-ins for your own data, tokenizer and model description, for the README's "Your own model and data" walkthrough:
a folder of plain-text files (Python's own documentation topics, paragraphs separated by blank lines), a byte-level
BPE tokenizer trained on them (`tokenizers`, saved as a transformers tokenizer folder) and a Llama-style config.json.
Swap in your own three things and the walkthrough's commands stay the same.

    python examples/stand_ins.py runs/own
"""

import argparse
import json
import pydoc_data.topics
from pathlib import Path

from tokenizers import ByteLevelBPETokenizer
from transformers import LlamaConfig, PreTrainedTokenizerFast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where corpus/, tokenizer/ and config.json go")
    parser.add_argument("--vocab_size", type=int, default=1024)
    args = parser.parse_args()

    corpus = args.folder / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    topics = sorted(pydoc_data.topics.topics.items())
    for start in range(0, len(topics), 20):  # a few files, each holding many blank-line-separated documents
        text = "\n\n".join(body.strip() for _, body in topics[start : start + 20])
        (corpus / f"topics-{start // 20:02d}.txt").write_text(text + "\n", encoding="utf-8")

    bpe = ByteLevelBPETokenizer()
    bpe.train([str(path) for path in sorted(corpus.glob("*.txt"))], vocab_size=args.vocab_size,
              special_tokens=["<|endoftext|>", "<|pad|>"], show_progress=False)  # fmt: skip
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|pad|>")
    tokenizer.save_pretrained(args.folder / "tokenizer")

    model = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
    )  # fmt: skip
    (args.folder / "config.json").write_text(json.dumps(model.to_diff_dict(), indent=2) + "\n", encoding="utf-8")
    print(f"{corpus}/ ({len(topics)} topics), {args.folder / 'tokenizer'}/ ({len(tokenizer)} tokens), ", end="")
    print(args.folder / "config.json")


if __name__ == "__main__":
    main()
