"""EngineRunner: the one thread that steps the engine, between HTTP handlers and the trajectory buffer.

Handlers (on the asyncio loop) `submit` a Handle into a thread-safe inbox and await events on the
handle's asyncio queue. The engine thread drains the inbox into `Engine.submit`, steps, and after
each step diffs every running request's output against what it has already passed on, pushing
the new tokens with `loop.call_soon_threadsafe` (streaming handles only) and a final Outcome when
the request finishes. Finished requests go to the ShardWriter as trajectories. The engine is only
ever touched from this thread, apart from its thread-safe `cancel` and `swap`.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import ctypes.util
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from adaflash.buffer import ShardWriter
from adaflash.engine import Engine
from adaflash.request import Request, RequestState

log = logging.getLogger("adaflash.server")


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's malloc_trim(0), or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _malloc_trim()

KERNEL_CACHE_ENTRIES = 128  # per cache; ~0.3 MB an entry


def cap_kernel_caches() -> None:
    """Bound oneDNN's primitive cache and ideep's LRU cache (1,024 entries each by default, ~0.3 MB an
    entry: JIT code and buffers for one problem shape) to KERNEL_CACHE_ENTRIES, unless the environment
    sets them. A serving step's packed linears have a new row count whenever the batch's verify tokens
    change, so with the defaults the caches filled for hours (the soak's ~10 MB/min). Read once, at the
    first oneDNN call: call this before any model runs (`adaflash serve` does, first thing)."""
    for var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(var, str(KERNEL_CACHE_ENTRIES))


class QueueFull(Exception):
    """More requests wait for a batch slot than engine.max_queued allows (-> 429)."""


class NotAccepting(Exception):
    """The server is shutting down (-> 503)."""


@dataclass
class Outcome:
    output_ids: list[int]
    finish_reason: str  # stop | length | cancelled | error
    stats: dict  # the response's "adaflash" object
    error: str | None = None


@dataclass
class Handle:
    """One in-flight request as both threads see it."""

    req: Request
    loop: asyncio.AbstractEventLoop
    stream: bool
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # list[int] token deltas, then one Outcome
    t_submit: float = field(default_factory=time.perf_counter)
    seen: int = 0  # output tokens already accounted for (and pushed, when streaming)
    rounds_seen: int = 0
    admitted: bool = False
    cancelled: bool = False
    done: bool = False

    def push(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


@dataclass
class Counters:
    """Totals for /metrics and /v1/status (written by the engine thread only)."""

    requests: collections.Counter = field(default_factory=collections.Counter)  # finish reason -> count
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    rounds: int = 0
    drafted_rounds: int = 0  # rounds that verified a draft or a lookup token (the rest decoded plainly)
    verify_tokens: int = 0
    spec_tokens: int = 0  # tokens committed by verification rounds (tau's numerator)
    rows_written: int = 0
    trajectory_errors: int = 0
    step_errors: int = 0


def request_stats(st: RequestState, policy: str, k_blk: int, handle: Handle) -> dict:
    acc = [r.accepted for r in st.rounds]
    hist = [0] * k_blk
    for a in acc:
        hist[min(a, k_blk - 1)] += 1
    admitted = st.admitted
    return {
        "drafter_version": st.slot.version,
        "policy": policy,
        "tau": round(st.tau, 3) if acc else None,
        "rounds": len(acc),
        "target_forwards": len(acc) + int(admitted),
        "verify_tokens": sum(r.verify_len for r in st.rounds),
        "accepted": {"mean": round(sum(acc) / len(acc), 3) if acc else None, "max": max(acc, default=None), "histogram": hist},
        "ttft_s": round(st.t_first - handle.t_submit, 4) if admitted else None,
        "latency_s": round(time.perf_counter() - handle.t_submit, 4),
    }


class EngineRunner:
    WINDOW_S = 10.0  # window of the recent rates (tokens/s, tau, verify tokens per step)
    TRIM_EVERY_S = 30.0  # hand free heap pages back to the OS at most this often (and when the engine goes idle)

    def __init__(self, engine: Engine, writer: ShardWriter | None, max_queued: int, on_finish: Callable[[str, dict], None] | None = None):
        """on_finish(finish_reason, adaflash stats) is called on the engine thread for every finished request."""
        self.engine, self.writer, self.max_queued, self.on_finish = engine, writer, max_queued, on_finish
        self.counters = Counters()
        self._inbox: queue.Queue = queue.Queue()
        self._handles: dict[str, Handle] = {}  # engine thread only
        self._lock = threading.Lock()
        self._queued = 0  # accepted, not yet in the running batch
        self._inflight = 0  # accepted, not yet finished
        self._accepting = True
        self._closing = threading.Event()
        self._recent: collections.deque = collections.deque()  # (t, generated, rounds, spec tokens, verify tokens, drafted rounds)
        self._t0 = self._trimmed = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="adaflash-engine", daemon=True)

    # ------------------------------------------------------------------ any thread

    def start(self) -> None:
        self._thread.start()

    def submit(self, handle: Handle) -> None:
        with self._lock:
            if not self._accepting:
                raise NotAccepting("the server is shutting down")
            if self._queued >= self.max_queued:
                raise QueueFull(f"{self._queued} requests already wait for a batch slot (engine.max_queued)")
            self._queued += 1
            self._inflight += 1
        self._inbox.put(handle)

    def cancel(self, handle: Handle) -> None:
        """Client gone: drop the request wherever it is (inbox, waiting or running)."""
        if handle.done:
            return
        handle.cancelled = True
        self.engine.cancel(handle.req.request_id)
        self._inbox.put(None)  # wake an idle engine thread

    @property
    def queue_depth(self) -> int:
        return self._queued

    @property
    def running(self) -> int:
        return len(self.engine.running)

    @property
    def in_flight(self) -> int:
        return self._inflight

    def recent(self) -> dict:
        """Rates over the last WINDOW_S seconds."""
        now = time.monotonic()
        rows = [r for r in list(self._recent) if r[0] >= now - self.WINDOW_S]
        span = min(self.WINDOW_S, max(now - self._t0, 1e-3))
        gen, rounds, spec, verify, drafted = (sum(r[i] for r in rows) for i in range(1, 6))
        steps = sum(1 for r in rows if r[2])
        return {
            "tokens_per_s": gen / span,
            "tau": spec / rounds if rounds else None,
            "verify_tokens_per_step": verify / steps if steps else None,
            "drafted_share": drafted / rounds if rounds else None,
        }

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def cancel_all(self) -> None:
        """Stop accepting and cancel every request in flight; the engine thread exits once they are retired."""
        self.stop_accepting()
        self._closing.set()
        self._inbox.put(None)

    def close(self, timeout: float = 10.0) -> None:
        """cancel_all, wait for the engine thread, then flush and close the trajectory writer."""
        self.cancel_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("engine thread did not stop within %.0f s; flushing trajectories anyway", timeout)
        else:  # a submit that raced the shutdown never reached the thread: answer it here
            self._take_inbox(block=False)
        if self.writer is not None:
            name = self.writer.close()
            log.info("trajectory writer closed (%d rows written%s)", self.counters.rows_written, f", last shard {name}" if name else "")

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while True:
            self._take_inbox(block=self.engine.idle)
            if self._closing.is_set():
                for rid in self._handles:
                    self.engine.cancel(rid)
                if self.engine.idle and not self._handles:
                    return
            if not self.engine.idle:
                self._step()
                if self.engine.idle or time.monotonic() - self._trimmed > self.TRIM_EVERY_S:
                    self._trim()
            else:
                self.engine.apply_swap()  # an idle server still goes live with a new drafter
            if self.writer is not None:
                try:
                    self.writer.flush_if_due()
                except Exception:
                    log.exception("flushing a trajectory shard failed; rows stay buffered")

    def _trim(self) -> None:
        """Return the heap's free pages to the OS. glibc keeps what a finished request's KV caches, a
        step's activations and a swapped-out drafter freed inside its per-thread arenas, fragmented, so
        the process RSS only ever grew (the soak: ~150 MB per hot-swap); malloc_trim hands the free
        pages back (a few ms; what is reused later is faulted in again)."""
        self._trimmed = time.monotonic()
        if MALLOC_TRIM is not None:
            MALLOC_TRIM(0)

    def _take_inbox(self, block: bool) -> None:
        items = []
        try:
            items.append(self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait())
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        for h in items:
            if h is None:
                continue
            if h.cancelled or self._closing.is_set():
                self._drop(h, "cancelled")
                continue
            try:
                self.engine.submit(h.req)
            except ValueError as e:  # the handler validates first; this is a last line of defence
                self._drop(h, "error", str(e))
                continue
            self._handles[h.req.request_id] = h
            self.counters.prompt_tokens += len(h.req.prompt_ids)

    def _drop(self, h: Handle, reason: str, error: str | None = None) -> None:
        """Finish a request that never reached the engine."""
        with self._lock:
            self._queued -= 1
            self._inflight -= 1
        h.done = True
        self.counters.requests[reason] += 1
        h.push(Outcome([], reason, {"drafter_version": self.engine.version}, error))

    def _step(self) -> None:
        try:
            done = self.engine.step()
        except Exception as e:  # keep serving: fail what was in flight, start from an empty batch
            log.exception("engine step failed; failing %d in-flight requests", len(self._handles))
            self.counters.step_errors += 1
            self.engine.running.clear()
            self.engine.waiting.clear()
            for h in list(self._handles.values()):
                self._handles.pop(h.req.request_id)
                with self._lock:
                    self._queued -= not h.admitted
                    self._inflight -= 1
                h.done = True
                self.counters.requests["error"] += 1
                h.push(Outcome([], "error", {}, f"engine error: {e}"))
            return
        c = self.counters
        before = (c.generated_tokens, c.rounds, c.spec_tokens, c.verify_tokens, c.drafted_rounds)
        for st in self.engine.running:
            self._progress(st)
        for st in done:
            self._finish(st)
        c.steps += 1
        c.verify_tokens = self.engine.stats["verify_tokens"]
        self._recent.append(
            (
                time.monotonic(),
                c.generated_tokens - before[0],
                c.rounds - before[1],
                c.spec_tokens - before[2],
                c.verify_tokens - before[3],
                c.drafted_rounds - before[4],
            )
        )
        while self._recent and self._recent[0][0] < time.monotonic() - self.WINDOW_S:
            self._recent.popleft()

    def _progress(self, st: RequestState) -> Handle | None:
        h = self._handles.get(st.req.request_id)
        if h is None:
            return None
        if not h.admitted and st.admitted:
            h.admitted = True
            with self._lock:
                self._queued -= 1
        new_rounds = st.rounds[h.rounds_seen :]
        self.counters.rounds += len(new_rounds)
        self.counters.drafted_rounds += sum(r.verify_len > 1 for r in new_rounds)
        self.counters.spec_tokens += sum(r.accepted + 1 for r in new_rounds)
        h.rounds_seen = len(st.rounds)
        if len(st.out) > h.seen:
            if h.stream:
                h.push(st.out[h.seen :])
            self.counters.generated_tokens += len(st.out) - h.seen
            h.seen = len(st.out)
        return h

    def _finish(self, st: RequestState) -> None:
        h = self._progress(st)
        if h is None:
            return
        self._handles.pop(st.req.request_id)
        with self._lock:
            self._queued -= not h.admitted
            self._inflight -= 1
        h.done = True
        reason = st.finish_reason or "stop"
        self.counters.requests[reason] += 1
        stats = request_stats(st, self.engine.policy.name, self.engine.k_blk, h)
        if self.on_finish is not None:
            self.on_finish(reason, stats)
        if self.writer is not None and st.out:  # durable (journal) before the client hears the request is done
            try:
                self.writer.append(self.engine.trajectory(st, self.writer.writer_id))
                self.counters.rows_written += 1
            except Exception:
                self.counters.trajectory_errors += 1
                log.exception("could not record the trajectory of %s", st.req.request_id)
        h.push(Outcome(list(st.out), reason, stats))
