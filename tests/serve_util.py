"""Shared by the server tests: a real uvicorn server on a free loopback port, in a thread."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import requests
from adaflash.server.app import GracefulServer, create_app
from adaflash.server.config import ServeConfig

from adaflash.config import from_dict


def serve_config(hf_dir: Path, drafter_dir: Path, buffer_dir: Path, **sections) -> ServeConfig:
    """A config for the tiny fixtures; `sections` override whole keys, e.g. engine={...}."""
    data = {
        "model": {"name": "tiny", "target": str(hf_dir), "drafter": str(drafter_dir), "drafter_dtype": "float32"},
        "engine": {"max_batch": 4, "token_budget": 256, "max_model_len": 512, "max_tokens_limit": 400},
        "trajectories": {"buffer_dir": str(buffer_dir), "writer_id": "test-node", "max_age_s": 600},
        "shutdown_grace_s": 5,
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return from_dict(ServeConfig, data)


@contextmanager
def running_server(cfg: ServeConfig, target=None, api_key: str | None = None, wait_ready: bool = True, ready_timeout: float = 60, **kw):
    """-> (base url, ServerState, uvicorn server); stops the server (lifespan shutdown) on exit."""
    app = create_app(cfg, api_key, target=target, **kw)
    server = GracefulServer(app, "127.0.0.1", 0, cfg.shutdown_grace_s, "warning")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + ready_timeout
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        while wait_ready and requests.get(f"{url}/ready", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, f"server not ready after {ready_timeout:.0f} s"
            time.sleep(0.05)
        yield url, app.state.adaflash, server
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


def wait_version(url: str, version: str, timeout: float, endpoint: str = "/v1/status") -> float:
    """Seconds until the server at `url` reports `version` as its live drafter (fails after `timeout`)."""
    t0 = time.monotonic()
    while (now := requests.get(f"{url}{endpoint}", timeout=5).json().get("drafter_version")) != version:
        assert time.monotonic() - t0 < timeout, f"server serves drafter version {now}, not {version}, after {timeout:.0f} s"
        time.sleep(0.05)
    return time.monotonic() - t0
