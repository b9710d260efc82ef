"""Convert a pseudo checkpoint into a real one, or export a real one to Llama / Mixtral: the same as `hf-p2r convert`
(see `hf-p2r convert --help`).

python scripts/convert_pseudo_to_real.py SRC DST [--num-unique-layers K] [--max-shard-size 5GB]
    [--dtype bfloat16] [--target llama|mixtral] [--overwrite] [--verify]
"""

import sys

from hf_p2r.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
