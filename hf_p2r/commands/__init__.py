"""Subcommands of the `hf-p2r` command line (see `hf_p2r/cli.py`)."""
