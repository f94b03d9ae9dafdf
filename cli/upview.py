"""The live view of `adaflash up`: a few lines refreshed in place (or appended when not a terminal).

Sources, each read with short timeouts so a slow or restarting process never freezes the view:
the server's Prometheus /metrics (throughput, tau, queue, drafter version, swaps), MLflow's REST API
(update rounds = runs, registered versions and the champion alias) and the load generator's JSONL
results (current phase and domain, client-side tau).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

LOG_EVERY_S = 30.0  # when stdout is not a terminal, print the view this often


def scrape(url: str, timeout: float = 2.0) -> dict[str, float | dict]:
    """Prometheus text at `url` -> {sample name: value}; info metrics -> {name: labels}."""
    out: dict[str, float | dict] = {}
    text = requests.get(url, timeout=timeout).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = dict(s.labels) if s.name.endswith("_info") else s.value
    return out


def mlflow_state(tracking_uri: str, model_name: str, experiment: str, timeout: float = 2.0) -> dict:
    """Update rounds (runs of the trainer's experiment) and registered versions, via MLflow's REST API."""
    api = tracking_uri.rstrip("/") + "/api/2.0/mlflow"
    exp = requests.get(f"{api}/experiments/get-by-name", params={"experiment_name": experiment}, timeout=timeout)
    runs = []
    if exp.status_code == 200:  # 404 until the trainer's first round creates it
        runs = (
            requests.post(
                f"{api}/runs/search",
                json={
                    "experiment_ids": [exp.json()["experiment"]["experiment_id"]],
                    "max_results": 1000,
                    "order_by": ["attributes.start_time DESC"],
                },
                timeout=timeout,
            )
            .json()
            .get("runs", [])
        )
    mv = (
        requests.get(f"{api}/model-versions/search", params={"filter": f"name='{model_name}'", "max_results": 1000}, timeout=timeout)
        .json()
        .get("model_versions", [])
    )
    rm = requests.get(f"{api}/registered-models/get", params={"name": model_name}, timeout=timeout).json()
    aliases = {a["alias"]: a["version"] for a in rm.get("registered_model", {}).get("aliases", [])}
    newest = max(mv, key=lambda v: int(v["version"]), default=None)
    newest_tags = {t["key"]: t["value"] for t in (newest or {}).get("tags", [])}
    finished = [r for r in runs if r["info"]["status"] == "FINISHED"]
    last = finished[0] if finished else {}
    return {
        "runs": len(runs),
        "running": sum(r["info"]["status"] == "RUNNING" for r in runs),
        "versions": sorted(int(v["version"]) for v in mv),
        "champion": aliases.get("champion"),
        "newest_verdict": _verdict(newest_tags),
        "last_round": last.get("info", {}).get("run_name"),
        "last_metrics": {m["key"]: m["value"] for m in last.get("data", {}).get("metrics", [])},
    }


def _verdict(tags: dict) -> str:
    """What happened to a version, from its registry tags: the gate's verdict and reason, a rollback."""
    if "rolled_back" in tags:
        return f"rolled back ({tags['rolled_back']})"
    if tags.get("gate") == "rejected":
        return f"rejected by the gate ({tags.get('reason', '?')})"
    if tags.get("gate") == "promoted":
        return "promoted by the gate"
    return f"registered by {tags['source']}" if "source" in tags else ""


class LoadTail:
    """Reads the load generator's JSONL results incrementally; keeps the last `window_s` of them."""

    def __init__(self, path: Path, window_s: float = 30.0):
        self.path, self.window_s, self.offset = path, window_s, 0
        self.rows: list[dict] = []
        self.total_ok = self.total_failed = 0

    def update(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
        done = chunk[: chunk.rfind("\n") + 1]  # a line still being written waits for the next read
        self.offset += len(done.encode())
        for line in done.splitlines():
            row = json.loads(line)
            self.rows.append(row)
            self.total_ok += bool(row["ok"])
            self.total_failed += not row["ok"]
        if self.rows:
            newest = max(r["t_start"] + r["latency_s"] for r in self.rows)
            self.rows = [r for r in self.rows if r["t_start"] + r["latency_s"] >= newest - self.window_s]

    def line(self) -> str:
        if not self.rows:
            return "no results yet"
        last = max(self.rows, key=lambda r: r["t_start"])
        by_dom: dict[str, list[float]] = {}
        for r in self.rows:
            if r["ok"] and r.get("tau") is not None:
                by_dom.setdefault(r["domain"], []).append(r["tau"])
        taus = ", ".join(f"{d} {statistics.fmean(v):.2f}" for d, v in sorted(by_dom.items()))
        return f"phase {last['phase'] + 1}, sending {last['domain']} | {self.total_ok} ok {self.total_failed} failed" + (
            f" | tau last {self.window_s:.0f}s: {taus}" if taus else ""
        )


def _num(v, fmt: str) -> str:
    return "-" if v is None or v != v else format(v, fmt)


class LiveView:
    """Renders the state of the loop every refresh; redraws in place on a terminal."""

    def __init__(self, cfg, loadgen_out: Path, children: list, tty: bool):
        self.cfg, self.children, self.tty = cfg, children, tty
        self.load = LoadTail(loadgen_out)
        self.t0 = time.monotonic()
        self.drawn = 0  # lines on screen from the previous draw
        self.last_print = -LOG_EVERY_S

    def lines(self) -> list[str]:
        cfg = self.cfg
        up_s = time.monotonic() - self.t0
        out = [
            f"adaflash up  {time.strftime('%H:%M:%S')}  up {int(up_s // 60)}m{int(up_s % 60):02d}s  "
            f"MLflow UI {cfg.tracking_uri}  API {cfg.server_url}/v1  logs {cfg.run_dir}/logs/"
        ]
        try:
            m = scrape(f"{cfg.server_url}/metrics")
            drafter = m.get("adaflash_drafter_info") or {}
            out.append(
                f"server   {_num(m.get('adaflash_tokens_per_second'), '.1f')} tok/s  tau {_num(m.get('adaflash_tau'), '.2f')}"
                f"  drafted {_num(m.get('adaflash_drafted_round_share'), '.0%')}"
                f"  drafter v{drafter.get('version', '?')} ({drafter.get('policy', '?')})"
                f"  swaps {_num(m.get('adaflash_drafter_swaps_total'), '.0f')}"
                f"  running {_num(m.get('adaflash_running_requests'), '.0f')}  queue {_num(m.get('adaflash_queue_depth'), '.0f')}"
                f"  trajectories {_num(m.get('adaflash_trajectory_rows_total'), '.0f')}"
            )
        except (requests.RequestException, ValueError) as e:
            out.append(f"server   unreachable ({type(e).__name__})")
        try:
            s = mlflow_state(cfg.tracking_uri, cfg.model_name, cfg.experiment)
            m = s["last_metrics"]
            tau = (
                f": held-out tau {m['heldout_tau_before']:.2f} -> {m['heldout_tau_after']:.2f}"
                if "heldout_tau_before" in m and "heldout_tau_after" in m
                else ""
            )
            versions = s["versions"]
            out.append(
                f"trainer  {s['runs']} update rounds ({s['running']} running)"
                + (f", last finished {s['last_round']}{tau}" if s["last_round"] else "")
            )
            out.append(
                f"registry {cfg.model_name}: {len(versions)} versions"
                + (f" (v{versions[0]}..v{versions[-1]})" if versions else "")
                + f", champion v{s['champion'] or '-'}"
                + (f"; v{versions[-1]} {s['newest_verdict']}" if versions and s["newest_verdict"] else "")
            )
        except (requests.RequestException, ValueError, KeyError) as e:
            out.append(f"trainer  MLflow unreachable ({type(e).__name__})")
        if cfg.loadgen is not None:
            try:
                self.load.update()
                out.append(f"loadgen  {self.load.line()}")
            except (OSError, ValueError, KeyError) as e:
                out.append(f"loadgen  results unreadable ({e})")
        out.append("procs    " + "  ".join(f"{c.name}:{'up' if c.poll() is None else f'exit {c.poll()}'}" for c in self.children))
        return out

    def refresh(self) -> None:
        now = time.monotonic()
        if not self.tty and now - self.last_print < LOG_EVERY_S:
            return
        lines = self.lines()
        if self.tty and self.drawn:
            sys.stdout.write(f"\x1b[{self.drawn}F\x1b[J")  # back to the first line of the last draw, clear below
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
        self.drawn, self.last_print = len(lines), now

    def close(self) -> None:
        self.drawn = 0  # later output goes below the last view
