"""Moved to `hf_p2r.training.resume.checkpoints` (the resume state in one package); this name stays for code written
against it: it is that module itself, so that its names, and a patch of them, are the same."""

import sys

from .resume import checkpoints

sys.modules[__name__] = checkpoints
