# Two commands on a fresh machine (each installs what it needs into .venv):
#   make demo   the P2R demo: pseudo stage -> delink -> real stage on the Python standard library's sources
#   make test   the test suite
PYTHON ?= python3
VENV   ?= .venv
# The CPU wheel of torch; on a GPU machine install your CUDA build of torch into .venv first (see README).
TORCH  ?= torch==2.13.0

.PHONY: demo test lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(VENV)/bin/python -m pip install --quiet "$(TORCH)"
	$(VENV)/bin/python -m pip install --quiet -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/accelerate launch -q --num_processes 1 scripts/train.py --config configs/demo.yaml

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check hf_p2r scripts tests

clean:
	rm -rf $(VENV) runs
