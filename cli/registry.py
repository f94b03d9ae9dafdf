"""`adaflash mlflow` (the tracking server) and `adaflash registry ...` (drafter versions, rollback).

adaflash mlflow                      MLflow server on 127.0.0.1:5000, SQLite + local artifacts in runs/mlflow/
adaflash registry bootstrap --drafter DIR   first drafter -> version 1 + champion (idempotent)
adaflash registry register --drafter DIR    a new version (not champion until promoted)
adaflash registry status             versions, aliases, tags
adaflash registry promote VERSION    move `champion` (an older version = rollback); servers swap on their next poll
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import datetime

from adaflash.config import UsageError


def cmd_mlflow(args: argparse.Namespace) -> int:
    from adaflash.pipelines.mlflow_server import start_mlflow_server, stop_mlflow_server, wait_ready

    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    proc = start_mlflow_server(
        args.host, args.port, args.backend_store_uri, args.artifacts_destination, None, args.workers, args.allowed_hosts
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stop the server on `kill` too
    try:
        ui_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        url = f"http://{ui_host}:{args.port}"
        wait_ready(url, args.start_timeout, proc)
        print(
            f"MLflow UI: {url}  (runs: experiment 'adaflash'; drafter versions: Models > adaflash-drafter; "
            f"set MLFLOW_TRACKING_URI={url} for adaflash clients). Ctrl-C stops it.",
            flush=True,
        )
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        stop_mlflow_server(proc)


def _registry(args: argparse.Namespace):
    from adaflash.registry import Registry

    return Registry(args.tracking_uri, args.model_name)


def cmd_status(args: argparse.Namespace) -> int:
    reg = _registry(args)
    rows = reg.versions()
    if not rows:
        print(f"no versions of {args.model_name} at {args.tracking_uri}: run `adaflash registry bootstrap --drafter DIR`")
        return 0
    print(f"{args.model_name} at {args.tracking_uri} (UI: Models > {args.model_name})")
    print(f"{'version':>7}  {'aliases':<10} {'created':<19}  tags")
    for r in rows:
        created = datetime.fromtimestamp(r["created_ms"] / 1000).strftime("%Y-%m-%d %H:%M:%S") if r["created_ms"] else "?"
        tags = " ".join(f"{k}={v}" for k, v in sorted(r["tags"].items()))
        print(f"{r['version']:>7}  {','.join(r['aliases']) or '-':<10} {created:<19}  {tags}")
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    reg = _registry(args)
    known = [r["version"] for r in reg.versions()]
    if args.version not in known:
        raise UsageError(f"{args.model_name} has no version {args.version!r}; versions: {', '.join(known) or 'none'}")
    before = reg.champion()
    reg.set_champion(args.version)
    print(f"champion: {before} -> {args.version}; servers polling the registry swap on their next poll")
    return 0


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from adaflash.registry import bootstrap

    print(f"champion: {bootstrap(_registry(args), args.drafter)}")
    return 0


def cmd_register(args: argparse.Namespace) -> int:
    tags = {}
    for item in args.tag or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise UsageError(f"--tag takes KEY=VALUE, got {item!r}")
        tags[k] = v
    version = _registry(args).register(args.drafter, tags=tags)
    print(f"registered version {version} (promote it with `adaflash registry promote {version}`)")
    return 0


def _unavailable_is_error(func):
    """RegistryUnavailable -> one line and exit code 1 (not a traceback)."""

    def run(args: argparse.Namespace) -> int:
        from adaflash.registry import RegistryUnavailable

        try:
            return func(args)
        except RegistryUnavailable as e:
            print(f"adaflash: error: {e}", file=sys.stderr)
            return 1

    return run


def register(subparsers) -> None:
    m = subparsers.add_parser(
        "mlflow",
        help="start the MLflow tracking server (runs, metrics, drafter registry, UI)",
        description="Starts `mlflow server` with a SQLite store and local artifacts under "
        "runs/mlflow/ (or $MLFLOW_BACKEND_STORE_URI / $MLFLOW_ARTIFACTS_DESTINATION, "
        "e.g. postgresql://... and s3://...). Artifacts go through the server, so "
        "clients need no shared filesystem. See mlflow/README.md.",
    )
    m.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 for other machines; then set --allowed-hosts)")
    m.add_argument("--port", type=int, default=5000)
    m.add_argument(
        "--backend-store-uri",
        default=None,
        help="runs + registry database (default: $MLFLOW_BACKEND_STORE_URI or sqlite:///runs/mlflow/mlflow.db)",
    )
    m.add_argument(
        "--artifacts-destination",
        default=None,
        help="where the server stores artifacts (default: $MLFLOW_ARTIFACTS_DESTINATION or runs/mlflow/artifacts)",
    )
    m.add_argument("--workers", type=int, default=2, help="uvicorn worker processes")
    m.add_argument("--allowed-hosts", default=None, help="Host headers accepted besides localhost/private IPs")
    m.add_argument("--start-timeout", type=float, default=180.0, help="seconds to wait for /health")
    m.set_defaults(func=cmd_mlflow)

    r = subparsers.add_parser(
        "registry",
        help="drafter versions in the MLflow registry: bootstrap, status, promote (rollback)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--tracking-uri",
        default=os.environ.get("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000"),
        help="MLflow server (default: $MLFLOW_TRACKING_URI or http://127.0.0.1:5000)",
    )
    common.add_argument("--model-name", default="adaflash-drafter", help="registered model name")
    rs = r.add_subparsers(dest="registry_command", required=True)
    b = rs.add_parser("bootstrap", parents=[common], help="register the first drafter as version 1 + champion (idempotent)")
    b.add_argument("--drafter", required=True, help="drafter directory (config.json + model.safetensors [+ length head])")
    b.set_defaults(func=_unavailable_is_error(cmd_bootstrap))
    g = rs.add_parser("register", parents=[common], help="register a drafter directory as a new version")
    g.add_argument("--drafter", required=True, help="drafter directory (config.json + model.safetensors [+ length head])")
    g.add_argument("--tag", action="append", help="KEY=VALUE tag on the version (repeatable)")
    g.set_defaults(func=_unavailable_is_error(cmd_register))
    s = rs.add_parser("status", parents=[common], help="table of versions, aliases and tags")
    s.set_defaults(func=_unavailable_is_error(cmd_status))
    p = rs.add_parser("promote", parents=[common], help="point `champion` at VERSION (rollback = an older version)")
    p.add_argument("version", help="model version number, e.g. 3")
    p.set_defaults(func=_unavailable_is_error(cmd_promote))
