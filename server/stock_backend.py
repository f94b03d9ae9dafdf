"""What the stock-engine backends (vLLM, SGLang) share: a child server process and the engine surface.

`ChildServer` runs a stock engine's HTTP server as a child process on a loopback port (its own venv's
python, its log beside the exported drafters) and waits for its health endpoint. `StockEngine` gives
the EngineRunner the surface of adaflash.engine.Engine (submit / step / cancel / swap / trajectory)
over such a server: one reader thread per request streams it from the child and records its tokens;
subclasses say how one request is sent and read (`_request`, over the shared `_events` stream) and how a
drafter is swapped in.
`hold()` / `release()` let a subclass restart its child without dropping a request: new requests
wait (they count as running) while those in flight finish, then go out to the new child.
"""

from __future__ import annotations

import abc
import json
import logging
import os
import socket
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import httpx

from adaflash.engine import Engine
from adaflash.request import DrafterSlot, Request, RequestState

log = logging.getLogger("adaflash.server")
logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per streamed request and health poll otherwise


class ChildServer:
    """A stock engine's HTTP server (`cmd`, environment `env`) as a child process on 127.0.0.1:`port`."""

    name = "child"
    health_path = "/health"

    def __init__(self, cmd: list[str], env: dict, port: int, log_path: Path):
        self.cmd, self.env, self.port = cmd, env, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> None:
        """Start the child and wait until its health endpoint answers 200."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting %s (log %s): %s", self.name, self.log_path, " ".join(self.cmd))
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise RuntimeError(f"{self.name} exited with code {code} while starting; see {self.log_path}:\n" + self.tail())
            try:
                if httpx.get(self.url + self.health_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"{self.name} did not become healthy within {timeout_s:.0f} s; see {self.log_path}:\n" + self.tail())

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _Policy:
    name: str

    def state(self) -> list:
        """What the policy learnt (`VerifyPolicy.state`): the stock engine chooses, nothing to report."""
        return []


class StockEngine(abc.ABC):
    """The EngineRunner's engine surface over a ChildServer (one streaming HTTP request per request)."""

    def __init__(
        self, server: ChildServer, drafter, version: str, policy: str, k_blk: int, max_batch: int, token_budget: int, max_model_len: int
    ):
        self.server = server
        self.slot = DrafterSlot(drafter, None, version)
        self.policy = _Policy(policy)
        self.k_blk = k_blk
        self.max_batch, self.token_budget, self.max_model_len = max_batch, token_budget, max_model_len
        self.waiting: deque = deque()  # the child queues internally; kept for the runner's error path
        # rows_inexact: rows whose rounds the child's reports could not place (`_request` gave None), written without
        self.stats = {"steps": 0, "verify_tokens": 0, "committed": 0, "swaps": 0, "last_swap_s": None, "rows_inexact": 0}
        self._live: dict[str, RequestState] = {}
        self._done: list[RequestState] = []
        self._cancel: set[str] = set()
        self._responses: dict[str, httpx.Response] = {}  # open streams, closed by cancel()
        self._held: list[RequestState] | None = None  # requests waiting for a restarted child (None: not holding)
        self._streaming = 0  # reader threads running
        self._cond = threading.Condition()
        self._client = httpx.Client(
            timeout=httpx.Timeout(None, connect=10.0), limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)
        )

    # ----------------------------------------------------------------- the Engine surface

    @property
    def drafter(self):
        return self.slot.drafter

    @property
    def version(self) -> str:
        return self.slot.version

    @property
    def running(self) -> list[RequestState]:
        with self._cond:
            return list(self._live.values())

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._live and not self._done

    def submit(self, req: Request) -> None:
        if len(req.prompt_ids) + req.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"request {req.request_id}: prompt of {len(req.prompt_ids)} tokens + max_new_tokens "
                f"{req.max_new_tokens} exceeds the {self.server.name} context of {self.max_model_len}"
            )
        st = RequestState(req, self.slot, None, None, None, t_start=time.perf_counter())
        with self._cond:
            self._live[req.request_id] = st
            if self._held is not None:  # a restart is under way: it goes out to the new child
                self._held.append(st)
                return
            self._streaming += 1
        self._spawn(st)

    def cancel(self, request_id: str) -> None:
        """Leave the request's stream (the child aborts a request whose client is gone), even before its first token."""
        with self._cond:
            self._cancel.add(request_id)
            resp = self._responses.get(request_id)
            held = next((s for s in self._held or [] if s.req.request_id == request_id), None)
            if held is not None:
                self._held.remove(held)
        if held is not None:
            self._finish(held, "cancelled", [])
        if resp is not None:
            try:
                resp.close()
            except Exception:  # the reader thread sees the closed stream and finishes the request
                pass

    def step(self, wait_s: float = 0.05) -> list[RequestState]:
        """Wait briefly for progress; -> the requests that finished since the last step."""
        with self._cond:
            if not self._done:
                self._cond.wait(wait_s)
            done, self._done = self._done, []
        self.stats["steps"] += 1
        return done

    def apply_swap(self) -> bool:
        return False  # swaps go live in the child as soon as `swap` returns

    trajectory = staticmethod(Engine.trajectory)  # the same row as the built-in engine's

    # ----------------------------------------------------------------- holding requests across a restart

    def hold(self, timeout_s: float | None = None) -> None:
        """New requests wait from now on; returns once every request in flight has finished."""
        with self._cond:
            self._held = []
            if not self._cond.wait_for(lambda: self._streaming == 0, timeout_s):
                raise TimeoutError(f"{self._streaming} requests still in flight after {timeout_s} s")

    def release(self) -> None:
        """Send the held requests (to the current child) and stop holding."""
        with self._cond:
            held, self._held = self._held or [], None
            self._streaming += len(held)
        for st in held:
            self._spawn(st)

    # ----------------------------------------------------------------- one request

    def _spawn(self, st: RequestState) -> None:
        name = f"{self.server.name}-{st.req.request_id[-8:]}"
        threading.Thread(target=self._stream, args=(st,), name=name, daemon=True).start()

    @abc.abstractmethod
    def _request(self, st: RequestState) -> tuple[str | None, list | None]:
        """Stream one request from the child into st.out; -> (finish reason or None, its rounds, or None where
        the child's reports cannot place them exactly: the row is then written without rounds)."""

    def _events(self, st: RequestState, path: str, body: dict):
        """POST `body` to the child's `path` as a server-sent-event stream; yields each `data:` event's
        JSON. The stream is registered so that cancel() can close it; a non-200 answer raises, and so does
        a cancelled request (at its next line: _stream then finishes it as cancelled). Leaving the loop
        early closes the stream, and the child aborts the request."""
        rid = st.req.request_id
        with _Registered(self, rid, self._client.stream("POST", self.server.url + path, json=body)) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{self.server.name} answered {r.status_code}: {r.read().decode(errors='replace')[:300]}")
            for line in r.iter_lines():
                if rid in self._cancel:
                    raise RuntimeError(f"request {rid} cancelled")
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[6:])

    def _stream(self, st: RequestState) -> None:
        req, rounds = st.req, []
        try:
            finish, rounds = self._request(st)
        except Exception as e:  # the child gone or refusing: this request fails, the server keeps serving
            if req.request_id in self._cancel:
                finish = "cancelled"
            else:
                log.error("%s request %s failed: %s", self.server.name, req.request_id, e)
                finish = "error"
        with self._cond:
            self._streaming -= 1
        self._finish(st, finish, rounds)

    def _finish(self, st: RequestState, finish: str | None, rounds: list | None) -> None:
        if rounds is None:
            self.stats["rows_inexact"] += 1
            rounds = []
        st.rounds = rounds
        self.stats["verify_tokens"] += sum(r.verify_len for r in rounds)
        self.stats["committed"] += len(st.out)
        st.finish_reason = finish or "stop"
        with self._cond:
            rid = st.req.request_id
            self._live.pop(rid, None)
            self._responses.pop(rid, None)
            self._cancel.discard(rid)
            self._done.append(st)
            self._cond.notify_all()

    def _progress(self, st: RequestState, tokens: list[int]) -> None:
        """New output tokens of a request arrived."""
        if tokens and not st.admitted:
            st.admitted, st.t_first = True, time.perf_counter()  # the first token is out
        st.out.extend(tokens)
        with self._cond:
            self._cond.notify_all()


class _Registered:
    """Context manager around a streamed response: registered for cancel() while open."""

    def __init__(self, engine: StockEngine, request_id: str, cm):
        self.engine, self.request_id, self.cm = engine, request_id, cm

    def __enter__(self) -> httpx.Response:
        r = self.cm.__enter__()
        with self.engine._cond:
            self.engine._responses[self.request_id] = r
        return r

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)
