"""A real `mlflow server` for the registry: SQLite store and local artifacts by default (Postgres / S3 by
URI), proxying artifacts so that clients share no disk. Used by `adaflash up`, `adaflash registry
serve`, the experiments and the tests; compose runs the same server from mlflow/start.sh."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

log = logging.getLogger("adaflash.mlflow_server")


def default_store_uri() -> str:
    """MLFLOW_BACKEND_STORE_URI (e.g. postgresql://...) or SQLite under runs/mlflow/ of the cwd."""
    return os.environ.get("MLFLOW_BACKEND_STORE_URI") or f"sqlite:///{Path('runs/mlflow/mlflow.db').resolve()}"


def default_artifacts_destination() -> str:
    """MLFLOW_ARTIFACTS_DESTINATION (e.g. s3://bucket/prefix) or runs/mlflow/artifacts of the cwd."""
    return os.environ.get("MLFLOW_ARTIFACTS_DESTINATION") or str(Path("runs/mlflow/artifacts").resolve())


def _mlflow_cli() -> list[str]:
    """The mlflow CLI of this interpreter's environment (the venv's), not whatever is on PATH."""
    script = Path(sys.executable).parent / "mlflow"
    return [str(script)] if script.exists() else [sys.executable, "-m", "mlflow"]


def start_mlflow_server(
    host: str = "127.0.0.1",
    port: int = 5000,
    store_uri: str | None = None,
    artifacts_dir: str | None = None,
    log_path: str | Path | None = None,
    workers: int = 1,
    allowed_hosts: str | None = None,
) -> subprocess.Popen:
    """Start `mlflow server` serving artifacts itself (--serve-artifacts: clients upload/download through
    it). It runs in its own process group, so `stop_mlflow_server` ends its uvicorn workers too.
    log_path: server output goes there (None: inherit this process's stdout/stderr)."""
    store_uri = store_uri or default_store_uri()
    artifacts_dir = artifacts_dir or default_artifacts_destination()
    if store_uri.startswith("sqlite:///"):
        Path(store_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    if "://" not in artifacts_dir:
        Path(artifacts_dir).mkdir(parents=True, exist_ok=True)
    cmd = _mlflow_cli() + [
        "server",
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--backend-store-uri",
        store_uri,
        "--serve-artifacts",
        "--artifacts-destination",
        artifacts_dir,
    ]
    if allowed_hosts:
        cmd += ["--allowed-hosts", allowed_hosts]
    env = dict(os.environ)
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")  # GenAI job runners: not used, 5 processes less
    out = open(log_path, "ab") if log_path else None
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=env, start_new_session=True)
    finally:
        if out:
            out.close()
    log.info("mlflow server starting (pid %d): store %s, artifacts %s", proc.pid, store_uri, artifacts_dir)
    return proc


def wait_ready(url: str, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    """Poll `<url>/health` until it answers 200; raises TimeoutError (or RuntimeError if `proc` exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with code {proc.returncode} before it was ready (see its log)")
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"mlflow server at {url} not ready after {timeout:.0f} s (see its log)")


def stop_mlflow_server(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM the server's whole process group (mlflow + its uvicorn workers); SIGKILL what is left
    after `timeout`. Returns once every process of the group is gone."""

    def group_alive() -> bool:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    if not group_alive():
        proc.poll()
        return
    os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, or the group stays alive as a zombie
        if not group_alive():
            return
        time.sleep(0.1)
    log.warning("mlflow server (pid %d) ignored SIGTERM for %.0f s: killing it", proc.pid, timeout)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
