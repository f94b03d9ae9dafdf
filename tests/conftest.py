"""Shared fixtures: tiny random targets and drafters (2 layers, 64 wide), and a tiny HF-format
target directory that carries SmolLM2's real tokenizer (so chat templates and the CLI work)."""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from adaflash.drafter import Drafter, DrafterConfig
from adaflash.target import TargetConfig, TargetModel

WATCHDOG_S = 2400  # the whole run takes ~14 min on two cores


_watchdog_out = None  # a copy of the terminal's stderr: pytest's capture redirects fd 2 while tests run


def pytest_configure(config):
    """A watchdog over the whole run: a hang that no test timeout reaches (collection, or C++ code that keeps
    the main thread) prints every thread's stack and ends the run, so CI says where it hung instead of
    only running out of time. It writes to a duplicate of stderr taken now (capture is suspended here): to
    fd 2 itself the stacks would land in the capture's temporary file and be lost with the process."""
    global _watchdog_out
    _watchdog_out = os.fdopen(os.dup(2), "w")
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True, file=_watchdog_out)


def tiny_target(seed: int = 0, vocab: int = 64, layers: int = 4, std: float = 0.3, head_dim: int = 16) -> TargetModel:
    """A random Llama-style target; a large init std gives peaked, seed-dependent distributions."""
    torch.manual_seed(seed)
    cfg = TargetConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        rope_theta=10000.0,
    )
    model = TargetModel(cfg, feature_layers=sorted({0, max(0, layers - 2)}))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=std)
    for n, p in model.named_parameters():
        if "norm" in n:
            torch.nn.init.ones_(p)
    return model.eval().requires_grad_(False)


def tiny_drafter(target: TargetModel, seed: int = 0, block_size: int = 6) -> Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target, {"name": "tiny"}, num_layers=2, block_size=block_size)
    return Drafter(cfg, target).eval()


@torch.no_grad()
def greedy_reference(target: TargetModel, prompt_ids: list[int], max_new_tokens: int, eos_ids: list[int]) -> list[int]:
    """Plain greedy decoding, one target forward per token, apart from the engine: the output every
    speculative method must reproduce token for token (stops after the first EOS, kept)."""
    dev = target.lm_head.weight.device
    cache = target.new_cache(1, len(prompt_ids) + max_new_tokens + 1)
    logits, _ = target(torch.tensor([prompt_ids], device=dev), cache, logits_last_only=True)
    out = [int(logits[0, -1].argmax())]
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        logits, _ = target(torch.tensor([out[-1:]], device=dev), cache, logits_last_only=True)
        out.append(int(logits[0, -1].argmax()))
    return out


@pytest.fixture
def tiny():
    target = tiny_target()
    return target, tiny_drafter(target)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The cached float copy of the packaged SmolLM2 (converted once, ~30 s on first use)."""
    from adaflash.target import gguf_to_hf_dir, packaged_gguf

    return gguf_to_hf_dir(packaged_gguf())


def write_tiny_hf(out: Path, smollm2_dir: Path, **dims) -> Path:
    """A random 64-wide Llama with SmolLM2's vocabulary and tokenizer, in HF format, in `out`;
    `dims` override config.json keys (4 layers, 4 heads, 2 KV heads of 16 by default)."""
    from safetensors.torch import save_file

    cfg = json.loads((smollm2_dir / "config.json").read_text())
    cfg.update(
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            **dims,
        }
    )
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg))
    model = TargetModel(TargetConfig.from_hf(cfg))
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"))
    for f in smollm2_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A 4-layer, 64-wide random Llama with SmolLM2's vocabulary and tokenizer, in HF format."""
    return write_tiny_hf(tmp_path_factory.mktemp("tiny-target"), smollm2_dir)


@pytest.fixture(scope="session")
def tiny_drafter_dir(tmp_path_factory, tiny_hf_dir) -> Path:
    """A random 1-layer drafter (block 4) saved for the tiny HF target."""
    from adaflash.target import load_target

    t = load_target(str(tiny_hf_dir), "float32")
    torch.manual_seed(0)
    d = Drafter(DrafterConfig.for_target(t.model, t.identity, num_layers=1, block_size=4), t.model)
    return d.save(tmp_path_factory.mktemp("drafter"), dtype=torch.float32)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> str:
    """A real `mlflow server` (started through `adaflash mlflow`) on a free loopback port, SQLite store and
    proxied artifacts in a temp folder, shared by the session; -> its URL. Teardown checks it really stopped."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    from adaflash.pipelines.mlflow_server import wait_ready

    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = root / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "adaflash.cli",
                "mlflow",
                "--port",
                str(port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{root / 'mlflow.db'}",
                "--artifacts-destination",
                str(root / "artifacts"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_ready(url, 180, proc)
        deadline = time.monotonic() + 10
        while f"MLflow UI: {url}" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert f"MLflow UI: {url}" in log.read_text(), f"`adaflash mlflow` printed no UI URL:\n{log.read_text()[-2000:]}"
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)  # `adaflash mlflow` stops its server process group on SIGTERM
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    try:
        urllib.request.urlopen(url + "/health", timeout=2)
    except OSError:
        return
    raise AssertionError(f"mlflow server at {url} still answers after `adaflash mlflow` was stopped")
