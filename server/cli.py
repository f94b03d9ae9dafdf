"""`adaflash serve`: the OpenAI-compatible HTTP server (registered into the `adaflash` CLI)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server on the batched speculative engine",
        description="Serves POST /v1/chat/completions and /v1/completions (streaming over SSE or not), GET /v1/models, "
        "/v1/status, /health, /ready and /metrics (Prometheus). Every finished request is recorded in the "
        "trajectory buffer; with registry.tracking_uri set, new drafter versions are hot-swapped in. "
        "SIGINT/SIGTERM: stop accepting, give in-flight requests shutdown_grace_s, flush trajectories.",
    )
    p.add_argument("--config", help="YAML, e.g. configs/serve_smollm2.yaml (default: SmolLM2 fp32 + models/drafter-smollm2)")
    p.add_argument("--host", help="bind address (default: the config's, 127.0.0.1); use 0.0.0.0 only with an API key")
    p.add_argument("--port", type=int, help="port (default: the config's, 8000)")
    p.add_argument(
        "--backend",
        choices=["builtin", "vllm", "sglang"],
        help="what runs the models (default: the config's, builtin): AdaFlash's engine, stock vLLM or stock SGLang (a GPU)",
    )
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (also $ADAFLASH_API_KEY or the config)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from adaflash.server.runner import cap_kernel_caches

    cap_kernel_caches()  # before any model runs
    from adaflash.server.app import GracefulServer, create_app
    from adaflash.server.config import ServeConfig

    from adaflash.config import ConfigError, UsageError, load_config

    try:
        cfg = load_config(args.config, ServeConfig) if args.config else ServeConfig()
        port = cfg.port if args.port is None else args.port
        cfg = dataclasses.replace(cfg, host=args.host or cfg.host, port=port, backend=args.backend or cfg.backend)
    except (ConfigError, ValueError) as e:
        raise UsageError(str(e)) from None
    api_key = args.api_key or os.environ.get("ADAFLASH_API_KEY") or cfg.api_key
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("adaflash.server")
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("binding %s without an API key: anyone who can reach this port can use the server", cfg.host)
    failure: list[str] = []
    server = None

    def load_failed(reason: str) -> None:
        failure.append(reason)
        server.should_exit = True

    app = create_app(cfg, api_key, on_load_error=load_failed)
    server = GracefulServer(app, cfg.host, cfg.port, cfg.shutdown_grace_s, cfg.log_level)
    server.run()
    if failure:
        log.error("exiting: %s", failure[0])
        return 1
    return 0
