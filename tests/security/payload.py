"""A crafted pickle, as the safety tests plant one: what a malicious file would hold."""

import os
from pathlib import Path


class CraftedPickle:
    """Pickled, it loads as a call that touches `marker`: a test checks that the file `marker` never appears (the
    pickle was refused, or loaded with `weights_only=True`, before anything ran)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)
