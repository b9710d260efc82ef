"""Moved to `hf_p2r.training.resume.export` (the resume state in one package); this name stays for code written
against it: it is that module itself, so that its names, and a patch of them, are the same."""

import sys

from .resume import export

sys.modules[__name__] = export
