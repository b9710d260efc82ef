# Two commands on a fresh machine (each installs what it needs into .venv):
#   make demo   the P2R demo: pseudo stage -> delink -> real stage on the Python standard library's sources
#   make test   the test suite: make install, then .venv/bin/python -m pytest
PYTHON ?= python3
VENV   ?= .venv
# The CPU wheel of torch; on a GPU machine install your CUDA build of torch into .venv first (see README).
TORCH  ?= torch==2.13.0
# The tested set of every other package (pip constraints); regenerate on purpose with `make lock`.
LOCK   ?= requirements/tested.txt
# The model-family and trainer tests, run by `make compat` on the declared floors and on the newest releases.
# Process and signal tests, subprocess start-ups that call no version-dependent API, run in `make test` only: the
# launcher's (test_launch.py); the train script's exit code in a subprocess (its messages come from parse_config,
# which test_bad_values_raise_one_line_naming_the_field checks in-process for the same three bad values, and its
# main() from test_script_prints_one_line_and_exits_2); the trainer's signal handler (_StopOnSignal: Python's signal
# module only); and the end-to-end runs marked slow (make test runs them once: the compatibility pass keeps CI near
# 20 minutes).
COMPAT_TESTS ?= -m "not slow" tests/models tests/training tests/test_compat.py tests/test_import_order.py tests/distributed/test_fsdp2.py \
	tests/distributed/test_deepspeed.py tests/distributed/test_deepspeed_zero_init.py tests/distributed/test_deepspeed_dcp.py \
	--ignore=tests/training/test_launch.py \
	--deselect=tests/training/test_config.py::test_cli_prints_one_line_without_a_traceback_and_exits_2 \
	--deselect=tests/training/test_train.py::test_repeated_sigterm_is_one_stop_request_and_a_second_ctrl_c_stops_at_once

.PHONY: install demo test compat compat-floors compat-newest lock lint clean gpu-report

$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(VENV)/bin/python -m pip install --quiet "$(TORCH)"
	$(VENV)/bin/python -m pip install --quiet -c $(LOCK) -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# Every value the launcher would otherwise default (and list in a notice) is given. ARGS: trainer overrides, e.g.
# make demo ARGS="--pseudo_steps 50 --output_dir runs/demo-50"
ARGS ?=
demo: $(VENV)/.installed
	$(VENV)/bin/accelerate launch -q --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
		scripts/train.py --config configs/demo.yaml $(ARGS)

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest --durations=15

# One GPU, under fifteen minutes: the GPU tests, throughput and MFU (eager and compiled), the loss path's memory, offload
# by ratio and design against FSDP2, a bf16 trainer run with offload: auto, the trainer under Accelerate's FSDP2 with
# DCP checkpoints, a resume and hf-p2r export; writes benchmarks/gpu/ (report.md names the device). BUDGET=540: every
# part within 540 s, in order (those left out are recorded as skipped). On a GPU machine without .venv: `source .gpu/device-setup.sh && make gpu-report` (its python3).
# DRY=1: every part at tiny size on CPU into a temporary folder (tests/test_gpu_report.py runs it).
DRY ?=
BUDGET ?=
REPORT_PYTHON ?= $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,$(PYTHON))
gpu-report:
	$(REPORT_PYTHON) scripts/gpu_report.py $(if $(DRY),--dry-run) $(if $(BUDGET),--budget $(BUDGET))

# Declared = tested: the floors pyproject declares (requirements/floors.txt), then the newest releases it allows.
# `make -j2 compat` runs the two test passes side by side; the installs stay one after the other (each writes the
# editable install's metadata into this folder).
compat: compat-floors compat-newest

compat-floors: .venv-floors/.installed
	.venv-floors/bin/python -m pytest -q $(COMPAT_TESTS)

compat-newest: .venv-newest/.installed
	.venv-newest/bin/python -m pytest -q $(COMPAT_TESTS)

.venv-floors/.installed: pyproject.toml requirements/floors.txt
	rm -rf .venv-floors && $(PYTHON) -m venv .venv-floors
	.venv-floors/bin/python -m pip install --quiet -c requirements/floors.txt -e ".[dev]"
	touch $@

# PIP_CONSTRAINT=/dev/null lifts a site-wide pip cap (some machines cap torch at the wheels on their disk).
.venv-newest/.installed: pyproject.toml | .venv-floors/.installed
	rm -rf .venv-newest && $(PYTHON) -m venv .venv-newest
	PIP_CONSTRAINT=/dev/null .venv-newest/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -e ".[dev]"
	touch $@

# A fresh resolution of pyproject's ranges, written to $(LOCK); run `make test` on it before committing.
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet "$(TORCH)" -e ".[dev]"
	{ sed -n '1,2p' $(LOCK); .venv-lock/bin/python -m pip freeze --exclude-editable | grep -viE '^(torch|hf-p2r)=='; } > $(LOCK).new
	mv $(LOCK).new $(LOCK) && rm -rf .venv-lock

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check hf_p2r benchmarks scripts tests

clean:
	rm -rf $(VENV) .venv-floors .venv-newest .venv-lock runs
