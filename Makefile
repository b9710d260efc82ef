# Two commands on a fresh machine (each installs what it needs into .venv, saying what it installs):
#   make demo       the P2R demo: pseudo stage -> delink -> real stage on the Python standard library's sources
#   make test       the fast tier of the test suite: every test that runs in one process (tiny models, no launcher, no
#                   compiled op), on every core (pytest-xdist); minutes
#   make test-all   the whole suite: the fast tier, then the tests marked `processes` (spawned workers, `accelerate
#                   launch`, scripts, DeepSpeed) or `slow` (end-to-end runs, the README's commands), two at a time
# tests/tiers.py marks the tiers as it collects (and fails a test that starts a process unmarked).
PYTHON ?= python3
VENV   ?= .venv
# torch at the tested version, from wherever pip is configured to look: from PyPI that is its default build (with CUDA
# on Linux x86-64). To choose the build (CPU-only, another CUDA), install it into .venv first (see README): make keeps
# the torch it finds there.
TORCH  ?= torch==2.13.0
# The tested set of every other package (pip constraints); regenerate on purpose with `make lock`.
LOCK   ?= requirements/tested.txt
# pytest-xdist workers for the in-process tests (auto: one per core).
WORKERS ?= auto
# And for the tests that start processes: two at a time. About half of them start one process (a script, a command
# line) and leave a second core idle when run alone; the others start 2-4 with one intra-op thread each. Measured on
# 2 cores: the tier in 25 min this way (2026-11-28, load 1-5), both cores busy. More than two would multiply the
# processes (and memory) of the 4-process tests.
REST_WORKERS ?= 2
# Each test's time limit is its tier's (tests/tiers.py) times this factor: raise it on a slow or busy machine.
export P2R_TEST_TIME_FACTOR ?= 1
FAST   = -m "not processes and not slow"
REST   = -m "processes or slow"
# The version-dependent tests, run by `make compat` on the declared floors and on the newest releases: the in-process
# tests of the code that meets each dependency's API (the model families and Auto classes, the Trainer/TRL integration,
# the Hub client, the private reads of hf_p2r/compat.py, the trainer's loop, DCP, compile, Muon, streaming data and
# offload's hooks), and the multi-process tests marked `versions` in those files and beside them (the import order,
# compat's multi-process reads, FSDP2, DeepSpeed's engine and import, transformers' remote code, TRL's SFTTrainer).
# The rest (launchers, signals, end-to-end runs, the other multi-process layouts, DeepSpeed under Accelerate's ZeRO-3
# offload plugin, which compiles DeepSpeed's CPU Adam) runs once, on the tested set, in `make test-all`.
COMPAT_TESTS ?= -m "(not processes and not slow) or versions" \
	tests/models tests/integrations tests/test_hub.py tests/test_compat.py tests/test_import_order.py \
	tests/training/test_train.py tests/training/test_dcp.py tests/training/test_dcp_async.py tests/training/test_compile.py \
	tests/training/test_muon.py tests/training/test_streaming.py tests/training/test_data.py tests/training/test_offload.py \
	tests/distributed/test_fsdp2.py tests/distributed/test_deepspeed.py tests/distributed/test_deepspeed_import.py

.PHONY: install demo test test-all test-rest compat compat-install compat-floors compat-newest lock lint clean gpu-report

$(VENV)/.installed: pyproject.toml $(LOCK)
	@echo "make: creating $(VENV) with $(PYTHON) and upgrading its pip"
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	@$(VENV)/bin/python -c "import torch" 2>/dev/null \
		&& echo "make: keeping the torch $(VENV) has: $$($(VENV)/bin/python -c 'import torch; print(torch.__version__)')" \
		|| echo "make: installing $(TORCH) (the largest download: from PyPI with its CUDA libraries, a few minutes)"
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(VENV)/bin/python -m pip install --quiet "$(TORCH)"
	@echo "make: installing hf-p2r (editable) and its dev tools at the versions in $(LOCK) (a minute or two)"
	$(VENV)/bin/python -m pip install --quiet -c $(LOCK) -e ".[dev]"
	@echo "make: $(VENV) is ready"
	touch $@

install: $(VENV)/.installed

# Every value the launcher would otherwise default (and list in a notice) is given. ARGS: trainer overrides, e.g.
# make demo ARGS="--pseudo_steps 50 --output_dir runs/demo-50"
ARGS ?=
demo: $(VENV)/.installed
	$(VENV)/bin/accelerate launch -q --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
		scripts/train.py --config configs/demo.yaml $(ARGS)

# Every run lists its slowest tests (--durations), so a log keeps where the time went.
test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -n $(WORKERS) $(FAST) --durations=20

test-all: $(VENV)/.installed
	$(MAKE) test
	$(MAKE) test-rest

# The tests `make test` leaves out (what `make test-all` runs after `make test`), REST_WORKERS at a time; worksteal:
# a worker that runs out of tests takes queued ones from the other, so one long test does not hold a queue behind it.
test-rest: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -n $(REST_WORKERS) --dist worksteal $(REST) --durations=30

# One GPU, at most eighteen minutes: the GPU tests, throughput and MFU (eager and compiled), the loss path's memory, offload
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
# editable install's metadata into this folder). They skip pip's byte-compilation of every installed file (--no-compile:
# Python compiles what the tests import, a fraction of torch's and transformers' files).
compat: compat-floors compat-newest

compat-install: .venv-floors/.installed .venv-newest/.installed

compat-floors: .venv-floors/.installed
	.venv-floors/bin/python -m pytest -q -p no:xdist $(COMPAT_TESTS) --durations=15

compat-newest: .venv-newest/.installed
	.venv-newest/bin/python -m pytest -q -p no:xdist $(COMPAT_TESTS) --durations=15

.venv-floors/.installed: pyproject.toml requirements/floors.txt
	@echo "make: installing the declared floors (requirements/floors.txt) into .venv-floors (torch from PyPI: minutes)"
	rm -rf .venv-floors && $(PYTHON) -m venv .venv-floors
	.venv-floors/bin/python -m pip install --quiet --no-compile -c requirements/floors.txt -e ".[dev]"
	@echo "make: .venv-floors is ready"
	touch $@

# PIP_CONSTRAINT=/dev/null lifts a site-wide pip cap (some machines cap torch at the wheels on their disk).
.venv-newest/.installed: pyproject.toml | .venv-floors/.installed
	@echo "make: installing the newest releases pyproject allows into .venv-newest (torch from PyPI: minutes)"
	rm -rf .venv-newest && $(PYTHON) -m venv .venv-newest
	PIP_CONSTRAINT=/dev/null .venv-newest/bin/python -m pip install --quiet --no-compile --upgrade --upgrade-strategy eager -e ".[dev]"
	@echo "make: .venv-newest is ready: $$(.venv-newest/bin/python -m pip list --format=freeze 2>/dev/null | grep -iE '^(torch|transformers|accelerate|deepspeed)==' | tr '\n' ' ')"
	touch $@

# A fresh resolution of pyproject's ranges, written to $(LOCK); run `make test` on it before committing.
lock:
	@echo "make: installing $(TORCH) and the newest releases pyproject allows into .venv-lock, to write $(LOCK)"
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet "$(TORCH)" -e ".[dev]"
	{ sed -n '1,2p' $(LOCK); .venv-lock/bin/python -m pip freeze --exclude-editable | grep -viE '^(torch|hf-p2r)=='; } > $(LOCK).new
	mv $(LOCK).new $(LOCK) && rm -rf .venv-lock

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check hf_p2r benchmarks scripts tests

clean:
	rm -rf $(VENV) .venv-floors .venv-newest .venv-lock runs
