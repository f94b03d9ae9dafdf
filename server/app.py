"""The OpenAI-compatible HTTP app (FastAPI) on the batched speculative engine.

`create_app(cfg)` returns an app whose lifespan loads the models in a background thread (/health
answers at once, /ready says 503 until the engine runs), starts the EngineRunner, the trajectory
writer and, with a registry configured, the HotSwapper; on shutdown it cancels what is still in
flight, flushes the trajectory writer and stops the swapper. `GracefulServer` is the uvicorn server
that marks the app draining as soon as SIGINT/SIGTERM arrive, so no new request starts while
in-flight ones get `shutdown_grace_s` to finish.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager, contextmanager

import uvicorn
from adaflash.server import protocol as P
from adaflash.server.config import ServeConfig
from adaflash.server.metrics import ServerMetrics
from adaflash.server.runner import EngineRunner, Handle, NotAccepting, Outcome, QueueFull
from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from adaflash.engine import Engine
from adaflash.policies import make_policy
from adaflash.request import Request

log = logging.getLogger("adaflash.server")


def default_writer_id() -> str:
    host = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in socket.gethostname()) or "host"
    return f"{host.lstrip('._-') or 'host'}-{os.getpid()}"


def build_engine(cfg: ServeConfig, target):
    """Drafter (+ its length head) + verify policy + Engine for `target` as the config says."""
    from adaflash.drafter import load_drafter_and_head

    m, e = cfg.model, cfg.engine
    drafter, head = (None, None) if m.policy == "ar" else load_drafter_and_head(m.drafter, target, m.drafter_dtype)
    return Engine(
        target.model,
        drafter,
        make_policy(m.policy, head, target.model, drafter),
        target.eos_ids,
        e.max_batch,
        e.token_budget,
        head=head,
        version=m.drafter_version,
        lookup=e.lookup,
        lookup_min=e.lookup_min_ngram,
        tree=e.tree,
    )


class ServerState:
    """What the handlers share; filled in by the loader thread."""

    def __init__(self, cfg: ServeConfig, api_key: str | None):
        self.cfg, self.api_key = cfg, api_key
        self.ready = self.draining = False
        self.load_error: str | None = None
        self.target = self.runner = self.swapper = self.limits = None
        self.stock_engine = None  # the engine holding the vLLM / SGLang child server (stock backends)
        self.guard = None  # LiveGuard: live tau per version and automatic rollback (with a registry)
        self.started = time.time()
        self.metrics = ServerMetrics(self)
        self._loader: threading.Thread | None = None
        self._closed = False

    def load(self, target=None) -> None:
        """Load models, start the engine thread (and the hot-swapper); sets `ready`."""
        from adaflash.buffer import ShardWriter
        from adaflash.target import load_target

        cfg = self.cfg
        t0 = time.perf_counter()
        if callable(target):  # a custom loader
            target = target()
        target = target or load_target(cfg.model.target, cfg.model.dtype)
        if target.tokenizer is None:
            raise ValueError(f"target {cfg.model.target} has no tokenizer files; the server needs them")
        if cfg.backend == "vllm":
            from adaflash.server.vllm_backend import build_vllm_engine

            engine = build_vllm_engine(cfg, target)
            self.stock_engine = engine
        elif cfg.backend == "sglang":
            from adaflash.server.sglang_backend import build_sglang_engine

            engine = build_sglang_engine(cfg, target)
            self.stock_engine = engine
        else:
            engine = build_engine(cfg, target)
        ctx, e = target.model.config.max_position_embeddings, cfg.engine
        self.limits = P.Limits(
            cfg.model.name,
            cfg.model.aliases,
            min(e.max_model_len or ctx, ctx),
            e.token_budget,
            engine.k_blk,
            e.default_max_tokens,
            e.max_tokens_limit,
            target.model.config.vocab_size,
        )
        tr = cfg.trajectories
        writer = ShardWriter(tr.buffer_dir, tr.writer_id or default_writer_id(), tr.rows_per_shard, tr.max_age_s) if tr.enabled else None
        self.target = target
        self.runner = EngineRunner(engine, writer, cfg.engine.max_queued, on_finish=self._finished)
        self.runner.start()
        if cfg.registry.tracking_uri and engine.drafter is not None:
            from adaflash.server.swap import HotSwapper

            from adaflash.registry import Registry

            reg = cfg.registry
            registry = Registry(reg.tracking_uri, reg.model_name, retries=reg.retries)
            if reg.rollback:
                from adaflash.server.guard import LiveGuard

                node = writer.writer_id if writer is not None else default_writer_id()
                self.guard = LiveGuard(
                    registry, engine.version, reg.rollback_window, reg.rollback_z, reg.rollback_min_drop, node, reg.interval_s
                ).start()
            self.swapper = HotSwapper(
                registry, engine, target, reg.cache_dir, reg.interval_s, on_event=self.guard.on_event if self.guard else None
            ).start()
        self.ready = True
        log.info(
            "ready in %.1f s: %s on the %s backend, policy %s, drafter version %s, block %d, trajectories %s",
            time.perf_counter() - t0,
            cfg.model.name,
            cfg.backend,
            engine.policy.name,
            engine.version,
            engine.k_blk,
            f"-> {tr.buffer_dir} as {writer.writer_id}" if writer else "off",
        )

    def _finished(self, reason: str, stats: dict) -> None:
        """Runner callback (engine thread) for every finished request."""
        self.metrics.observe(reason, stats)
        if self.guard is not None:
            self.guard.observe(reason, stats)

    def start_loading(self, target=None, on_error=None) -> None:
        def run():
            try:
                self.load(target)
            except Exception as e:
                self.load_error = f"{type(e).__name__}: {e}"
                log.exception("loading the models failed")
                if on_error is not None:
                    on_error(self.load_error)

        self._loader = threading.Thread(target=run, name="adaflash-load", daemon=True)
        self._loader.start()

    def shutdown(self) -> None:
        """Cancel what is still in flight, flush trajectories, stop the swapper (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.draining = True
        if self._loader is not None:
            self._loader.join()
        if self.swapper is not None:
            self.swapper.stop(timeout=10)
        if self.guard is not None:
            self.guard.stop(timeout=10)
        if self.runner is not None:
            self.runner.close(timeout=30)
        if self.stock_engine is not None:
            self.stock_engine.server.stop()  # the current child (an SGLang restart replaces it)
        log.info("shut down")


def create_app(cfg: ServeConfig, api_key: str | None = None, target=None, on_load_error=None) -> FastAPI:
    """`target`: a loaded Target, or a function returning one, to serve instead of loading the config's.
    `on_load_error(reason)` is called (on the loader thread) if loading fails."""
    state = ServerState(cfg, api_key if api_key is not None else cfg.api_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start_loading(target, on_load_error)
        yield
        await asyncio.to_thread(state.shutdown)

    app = FastAPI(title="AdaFlash", lifespan=lifespan)
    app.state.adaflash = state

    @app.exception_handler(P.APIError)
    async def api_error(request, exc: P.APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    def auth(request: HTTPRequest) -> None:
        if not state.api_key:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), state.api_key.encode()):
            raise P.APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def serving() -> EngineRunner:
        if state.draining:
            raise P.APIError(503, "the server is shutting down", code="shutting_down", type_="server_error")
        if not state.ready:
            why = f"loading failed: {state.load_error}" if state.load_error else "the model is still loading"
            raise P.APIError(
                503, f"{why}; retry when GET /ready returns 200", code="not_ready", type_="server_error", headers={"Retry-After": "5"}
            )
        return state.runner

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if state.ready and not state.draining:
            return {"status": "ready", "model": cfg.model.name, "drafter_version": state.runner.engine.version}
        status = "draining" if state.draining else "failed" if state.load_error else "loading"
        return JSONResponse({"status": status, "error": state.load_error}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models():
        return {
            "object": "list",
            "data": [{"id": cfg.model.name, "object": "model", "created": int(state.started), "owned_by": "adaflash"}],
        }

    @app.get("/v1/status", dependencies=[Depends(auth)])
    async def status():
        out = {
            "model": cfg.model.name,
            "ready": state.ready,
            "draining": state.draining,
            "load_error": state.load_error,
            "uptime_s": round(time.time() - state.started, 1),
        }
        r = state.runner
        if r is not None:
            c, e = r.counters, r.engine
            out.update(
                drafter_version=e.version,
                policy=e.policy.name,
                policy_state={name: value if value == value else None for name, _, _, value in e.policy.state()},  # NaN: none yet
                block_size=e.k_blk,
                queue_depth=r.queue_depth,
                max_queued=r.max_queued,
                running=r.running,
                max_batch=e.max_batch,
                token_budget=e.token_budget,
                max_model_len=state.limits.max_model_len,
                requests=dict(c.requests),
                generated_tokens=c.generated_tokens,
                recent=r.recent(),
                trajectories=None
                if r.writer is None
                else {
                    "buffer_dir": str(r.writer.root),
                    "writer_id": r.writer.writer_id,
                    "rows_written": c.rows_written,
                    "buffered_rows": r.writer.buffered_rows,
                    "shards_written": len(r.writer.shards_written),
                },
                registry=None if state.swapper is None else state.swapper.metrics(),
            )
        return out

    @app.post("/v1/completions", dependencies=[Depends(auth)], openapi_extra=P.openapi_body(chat=False))
    async def completions(request: HTTPRequest):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)], openapi_extra=P.openapi_body(chat=True))
    async def chat_completions(request: HTTPRequest):
        return await generate(request, chat=True)

    def decode(ids: list[int]) -> str:
        return state.target.tokenizer.decode(ids, skip_special_tokens=True)

    async def generate(request: HTTPRequest, chat: bool):
        runner = serving()
        tok = state.target.tokenizer
        params = P.parse_request(P.parse_body(await read_body(request)), chat, state.limits, state.target.encode_chat, tok.encode)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        req = Request(
            rid,
            params.prompt_ids,
            params.max_tokens,
            params.temperature,
            params.seed,
            params.domain,
            stop=P.stop_rule(decode, params.stop) if params.stop else None,
            ignore_eos=params.ignore_eos,
        )
        handle = Handle(req, asyncio.get_running_loop(), params.stream)
        try:
            runner.submit(handle)
        except QueueFull as e:
            raise P.APIError(
                429, f"server busy: {e}; retry after a second", code="queue_full", type_="rate_limit_error", headers={"Retry-After": "1"}
            ) from None
        except NotAccepting as e:
            raise P.APIError(503, str(e), code="shutting_down", type_="server_error") from None
        if params.stream:
            return StreamingResponse(
                stream(runner, handle, params, rid),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": rid},
            )
        outcome = await wait(runner, handle, request)
        if outcome is None:  # the client left; nobody reads this
            return Response(status_code=499)
        failed(outcome)
        text = P.TextStream(decode, params.stop)
        body = text.push(outcome.output_ids) + text.finish()
        finish = "stop" if text.stopped else outcome.finish_reason
        return P.response(rid, cfg.model.name, chat, body, finish, P.usage(len(params.prompt_ids), len(outcome.output_ids)), outcome.stats)

    async def read_body(request: HTTPRequest) -> bytes:
        """The body; 413 past P.body_limit (the rest is read and dropped, so the client still gets the answer)."""
        cap, size, parts = P.body_limit(state.limits), 0, []
        async for chunk in request.stream():
            size += len(chunk)
            if size <= cap:
                parts.append(chunk)
        if size > cap:
            raise P.APIError(
                413,
                f"the request body has {size} bytes; this server takes at most {cap} (room for a prompt of engine.token_budget tokens)",
                code="body_too_large",
            )
        return b"".join(parts)

    def failed(outcome: Outcome) -> None:
        if outcome.finish_reason == "error":
            raise P.APIError(500, outcome.error or "engine error", code="engine_error", type_="server_error")
        if outcome.finish_reason == "cancelled":
            raise P.APIError(503, "request cancelled: the server is shutting down", code="cancelled", type_="server_error")

    async def wait(runner: EngineRunner, handle: Handle, request: HTTPRequest) -> Outcome | None:
        """The final Outcome of a non-streaming request; None (and cancelled) if the client disconnects."""
        get = asyncio.ensure_future(handle.events.get())
        try:
            while True:
                done, _ = await asyncio.wait({get}, timeout=0.5)
                if done:
                    return get.result()
                if await request.is_disconnected():
                    runner.cancel(handle)
                    return None
        finally:
            get.cancel()
            runner.cancel(handle)  # a no-op once the request finished

    async def stream(runner: EngineRunner, handle: Handle, params: P.GenParams, rid: str):
        name, chat = cfg.model.name, params.chat
        text = P.TextStream(decode, params.stop)
        try:
            if chat:
                yield P.sse(P.chunk(rid, name, True, None, role=True))
            while not isinstance(item := await handle.events.get(), Outcome):
                if delta := text.push(item):
                    yield P.sse(P.chunk(rid, name, chat, delta))
            try:
                failed(item)
            except P.APIError as e:
                yield P.sse(e.body())
                yield P.sse("[DONE]")
                return
            if tail := text.finish():
                yield P.sse(P.chunk(rid, name, chat, tail))
            finish = "stop" if text.stopped else item.finish_reason
            yield P.sse(P.chunk(rid, name, chat, None, finish, adaflash=item.stats))
            if params.include_usage:
                yield P.sse(P.chunk(rid, name, chat, None, usage=P.usage(len(params.prompt_ids), len(item.output_ids))))
            yield P.sse("[DONE]")
        finally:  # client disconnect or server shutdown cancels the generator here
            runner.cancel(handle)

    return app


class GracefulServer(uvicorn.Server):
    """uvicorn server that stops the app taking new requests the moment shutdown begins, and exits
    normally after a signal-initiated graceful shutdown (uvicorn re-raises the signal, exiting 128+sig)."""

    def __init__(self, app: FastAPI, host: str, port: int, grace_s: float, log_level: str = "info"):
        # uvicorn's own timeout only bounds delivering the cancellations once our grace period is over
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5))
        self.app_state: ServerState = app.state.adaflash
        self.grace_s = grace_s

    async def shutdown(self, sockets=None) -> None:
        """Stop listening, give in-flight requests the grace period, then cancel the rest in the engine
        so each client gets a proper end (an error event in a stream, 503 otherwise) before uvicorn closes."""
        state = self.app_state
        state.draining = True
        for server in self.servers:
            server.close()
        runner = state.runner
        if runner is not None:
            runner.stop_accepting()
            deadline = time.monotonic() + self.grace_s
            while runner.in_flight and time.monotonic() < deadline and not self.force_exit:
                await asyncio.sleep(0.05)
            if runner.in_flight:
                logging.getLogger("adaflash.server").warning(
                    "grace period of %.0f s over: cancelling %d requests", self.grace_s, runner.in_flight
                )
                runner.cancel_all()
        await super().shutdown(sockets)

    @contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
