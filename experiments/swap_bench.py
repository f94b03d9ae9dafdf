"""`adaflash experiment swap`: what a registry hot-swap costs the requests being generated.

A real `adaflash serve` app (FastAPI + uvicorn on loopback, EngineRunner, HotSwapper polling a real
MLflow registry) serves `clients` streaming chat completions in a closed loop. After a warm-up and one
`window_s` of steady traffic, a second drafter version is registered and `champion` moved to it; the
server's hot-swapper downloads, checks and stages it, and the engine makes it live between two steps.

Measured from the clients' side (one stream chunk per engine step, carrying that step's tokens):
  - failed requests (HTTP errors, error events, a stream without [DONE], finish reason error/cancelled)
  - inter-token latency = gap between consecutive content chunks of a request, p50/p95, in the window
    before the trigger vs the window from the trigger until the swap is live plus `window_s`
  - swap duration: champion moved -> version staged by the swapper -> version live in the engine
    (polled on /v1/status; includes up to one registry poll interval)
Gate: zero failures and p95 during / p95 before <= max_ratio. Writes swap.json and swap.md.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from adaflash.config import to_dict


@dataclass
class SwapConfig:
    target: str = "smollm2"
    dtype: str = "float32"
    drafter: str = "models/drafter-smollm2"  # version 1, serving at the start
    second_drafter: str | None = None  # version 2; null: the same files registered again (a new version)
    drafter_dtype: str = "auto"
    policy: str = "fixed"  # server model.policy
    max_batch: int = 8
    token_budget: int = 512
    prompt_sets: str = "runs/pretrain-smollm2/prompts"
    domains: list[str] = field(default_factory=lambda: ["gsm8k", "humaneval"])  # eval split, interleaved, cycled
    max_prompt_chars: int = 1200  # longer prompts are skipped (keeps them within the server's token budget)
    clients: int = 4  # concurrent streaming clients (closed loop)
    max_tokens: int = 64
    warmup_s: float = 10.0  # traffic before the "before" window opens
    window_s: float = 30.0  # length of the before window, and of the during window after the swap is live
    poll_interval_s: float = 1.0  # the server's registry poll period
    tracking_uri: str | None = None  # MLflow server; null: a private one under OUT/mlflow
    max_ratio: float = 1.5  # gate on p95 inter-token latency during / before

    def __post_init__(self):
        if self.clients < 1 or self.max_tokens < 1:
            raise ValueError("clients and max_tokens must be >= 1")
        if self.window_s <= 0 or self.poll_interval_s <= 0 or self.warmup_s < 0:
            raise ValueError("window_s and poll_interval_s must be > 0, warmup_s >= 0")


class Client(threading.Thread):
    """Sends streaming chat completions one after another until stopped; records chunk times."""

    def __init__(self, url: str, model: str, prompts: list[list[dict]], offset: int, max_tokens: int, stop: threading.Event):
        super().__init__(daemon=True)
        self.url, self.model, self.prompts, self.i, self.max_tokens, self.halt = url, model, prompts, offset, max_tokens, stop
        self.requests: list[dict] = []

    def run(self) -> None:
        with httpx.Client(timeout=httpx.Timeout(120.0)) as http:
            while not self.halt.is_set():
                self.requests.append(self.one(http, self.prompts[self.i % len(self.prompts)]))
                self.i += 1

    def one(self, http: httpx.Client, messages: list[dict]) -> dict:
        rec = {"t_start": time.monotonic(), "chunks": [], "error": None, "finish": None, "version": None}
        body = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens, "temperature": 0, "stream": True}
        try:
            with http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    rec["error"] = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                    return rec
                done = False
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        rec["error"] = obj["error"].get("message", str(obj["error"]))
                        continue
                    choice = obj["choices"][0] if obj.get("choices") else {}
                    if choice.get("delta", {}).get("content"):
                        rec["chunks"].append(time.monotonic())
                    if choice.get("finish_reason"):
                        rec["finish"] = choice["finish_reason"]
                        rec["version"] = (obj.get("adaflash") or {}).get("drafter_version")
                if not done and rec["error"] is None:
                    rec["error"] = "stream ended without [DONE]"
        except httpx.HTTPError as e:
            rec["error"] = f"{type(e).__name__}: {e}"
        if rec["error"] is None and rec["finish"] not in ("stop", "length"):
            rec["error"] = f"finish reason {rec['finish']!r}"
        rec["t_end"] = time.monotonic()
        return rec


def load_messages(sets: Path, domains: list[str], max_chars: int) -> list[list[dict]]:
    """Chat messages of the eval split's prompts of `domains`, round robin over the domains."""
    from adaflash.experiments.online_experiment import interleave
    from adaflash.pipelines.prompts import build_prompt_sets, read_prompts

    if not (sets / "eval.parquet").exists():
        build_prompt_sets(sets)
    per = [
        [r.messages for r in read_prompts(sets / "eval.parquet", [d]) if sum(len(m["content"]) for m in r.messages) <= max_chars]
        for d in domains
    ]
    out = interleave(per)
    if not out:
        raise ValueError(f"no eval prompts of {domains} under {max_chars} characters in {sets}")
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def gaps_in(requests: list[dict], t0: float, t1: float) -> list[float]:
    """Inter-chunk gaps (s) whose later chunk arrived in [t0, t1)."""
    return [b - a for r in requests for a, b in zip(r["chunks"], r["chunks"][1:]) if t0 <= b < t1]


def run_swap_bench(cfg: SwapConfig, out: Path, log=print) -> dict:
    from adaflash.experiments.online_experiment import free_port, tracking_server
    from adaflash.server.app import GracefulServer, create_app
    from adaflash.server.config import ServeConfig

    from adaflash.config import from_dict
    from adaflash.registry import Registry

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tag = time.strftime("%Y%m%d-%H%M%S") + f"-{random.randrange(16**4):04x}"  # unique registry name per run
    prompts = load_messages(Path(cfg.prompt_sets), cfg.domains, cfg.max_prompt_chars)
    with tracking_server(cfg.tracking_uri, out / "mlflow") as uri:
        registry = Registry(uri, f"swap-bench-{tag}")
        v1 = registry.register(cfg.drafter, tags={"source": "swap-bench v1"})
        registry.set_champion(v1)
        serve_cfg = from_dict(
            ServeConfig,
            {
                "port": free_port(),
                "log_level": "warning",
                "shutdown_grace_s": 30,
                "model": {
                    "name": "swap-bench",
                    "target": cfg.target,
                    "dtype": cfg.dtype,
                    "drafter": cfg.drafter,
                    "drafter_dtype": cfg.drafter_dtype,
                    "drafter_version": v1,
                    "policy": cfg.policy,
                },
                "engine": {"max_batch": cfg.max_batch, "token_budget": cfg.token_budget, "max_queued": 4 * cfg.clients},
                "trajectories": {"enabled": False},
                "registry": {
                    "tracking_uri": uri,
                    "model_name": registry.model_name,
                    "cache_dir": str(out / "registry-cache"),
                    "interval_s": cfg.poll_interval_s,
                    # this measures what a swap costs: a live-guard rollback would swap back mid-measurement (it
                    # rolled back a copy of v1 in CI on noise: tau before and after a swap comes from other prompts)
                    "rollback": False,
                },
            },
        )
        app = create_app(serve_cfg)
        server = GracefulServer(app, "127.0.0.1", serve_cfg.port, serve_cfg.shutdown_grace_s, "warning")
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{serve_cfg.port}"
        try:
            result = measure(cfg, url, registry, prompts, log)
        finally:
            server.should_exit = True
            thread.join(60)
    result.update(run_tag=tag, v1=v1)
    write_swap_report(result, cfg, out, log)
    return result


def _wait_ready(url: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/ready", timeout=5)
            if r.status_code == 200:
                return
            if r.json().get("status") == "failed":
                raise RuntimeError(f"the server failed to load: {r.json().get('error')}")
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server at {url} not ready after {timeout:.0f} s")


def measure(cfg: SwapConfig, url: str, registry, prompts: list[list[dict]], log) -> dict:
    _wait_ready(url)
    stop = threading.Event()
    clients = [Client(url, "swap-bench", prompts, i * 7, cfg.max_tokens, stop) for i in range(cfg.clients)]
    t_begin = time.monotonic()
    for c in clients:
        c.start()
    log(f"[swap] {cfg.clients} streaming clients; warm-up {cfg.warmup_s:.0f} s, then a {cfg.window_s:.0f} s window")
    time.sleep(cfg.warmup_s + cfg.window_s)
    t_trigger = time.monotonic()
    v2 = registry.register(cfg.second_drafter or cfg.drafter, tags={"source": "swap-bench v2"})
    t_moved = time.monotonic()
    registry.set_champion(v2)
    log(f"[swap] registered v{v2} ({t_moved - t_trigger:.1f} s) and moved champion to it")
    t_staged = t_live = None
    deadline = t_moved + 120 + 10 * cfg.poll_interval_s
    with httpx.Client(timeout=10) as http:
        while t_live is None and time.monotonic() < deadline:
            st = http.get(f"{url}/v1/status").json()
            now = time.monotonic()
            if t_staged is None and (st.get("registry") or {}).get("version") == v2:
                t_staged = now
            if st.get("drafter_version") == v2:
                t_live, t_staged = now, t_staged or now
            time.sleep(0.02)
    t_end = (t_live or time.monotonic()) + cfg.window_s
    time.sleep(max(0.0, t_end - time.monotonic()))
    stop.set()
    for c in clients:
        c.join(300)
    status = httpx.get(f"{url}/v1/status", timeout=10).json()
    reqs = [r for c in clients for r in c.requests]
    before, during = gaps_in(reqs, t_trigger - cfg.window_s, t_trigger), gaps_in(reqs, t_trigger, t_end)
    stats = {
        w: {
            "p50_ms": _pct(g, 0.5) and 1000 * _pct(g, 0.5),
            "p95_ms": _pct(g, 0.95) and 1000 * _pct(g, 0.95),
            "max_ms": max(g) * 1000 if g else None,
            "gaps": len(g),
        }
        for w, g in (("before", before), ("during", during))
    }
    ratio = (stats["during"]["p95_ms"] / stats["before"]["p95_ms"]) if stats["before"]["p95_ms"] and stats["during"]["p95_ms"] else None
    failed = [r for r in reqs if r["error"]]
    by_version: dict[str, int] = {}
    for r in reqs:
        if not r["error"]:
            by_version[str(r["version"])] = by_version.get(str(r["version"]), 0) + 1
    return {
        "v2": v2,
        "requests": len(reqs),
        "failed": len(failed),
        "errors": [r["error"] for r in failed][:10],
        "requests_by_version": by_version,
        "swapped": t_live is not None and status.get("drafter_version") == v2,
        "server_registry": status.get("registry"),
        "register_s": t_moved - t_trigger,
        "swap_staged_s": t_staged and t_staged - t_moved,
        "swap_live_s": t_live and t_live - t_moved,
        "poll_interval_s": cfg.poll_interval_s,
        "itl": stats,
        "p95_ratio": ratio,
        "p50_ratio": (stats["during"]["p50_ms"] / stats["before"]["p50_ms"])
        if stats["before"]["p50_ms"] and stats["during"]["p50_ms"]
        else None,
        "windows_s": {
            "before": [t_trigger - cfg.window_s - t_begin, t_trigger - t_begin],
            "during": [t_trigger - t_begin, t_end - t_begin],
        },
    }


def write_swap_report(res: dict, cfg: SwapConfig, out: Path, log=print) -> None:
    res["gate"] = {
        "zero_failures": res["failed"] == 0,
        "ratio_ok": res["p95_ratio"] is not None and res["p95_ratio"] <= cfg.max_ratio,
        "max_ratio": cfg.max_ratio,
    }
    res["gate"]["met"] = res["gate"]["zero_failures"] and res["gate"]["ratio_ok"] and res["swapped"]
    res["config"] = to_dict(cfg)
    (out / "swap.json").write_text(json.dumps(res, indent=1))
    f = lambda v, s=".1f": "-" if v is None else format(v, s)  # noqa: E731
    i = res["itl"]
    lines = [
        f"# Hot-swap under load ({cfg.clients} streaming clients, {cfg.max_tokens} tokens each, policy {cfg.policy})",
        "",
        f"Swap v{res['v1']} -> v{res['v2']}: registered in {f(res['register_s'], '.2f')} s; after the champion moved, "
        f"staged in {f(res['swap_staged_s'], '.2f')} s and live in {f(res['swap_live_s'], '.2f')} s "
        f"(registry polled every {cfg.poll_interval_s} s). Swapped: {'yes' if res['swapped'] else 'NO'}.",
        "",
        f"Requests: {res['requests']}, failed: {res['failed']}; finished per drafter version: {res['requests_by_version']}",
        "",
        "| window | inter-token p50 (ms) | p95 (ms) | max (ms) | gaps |",
        "|---|---|---|---|---|",
    ]
    for w in ("before", "during"):
        lines.append(f"| {w} | {f(i[w]['p50_ms'])} | {f(i[w]['p95_ms'])} | {f(i[w]['max_ms'])} | {i[w]['gaps']} |")
    verdict = (
        f"Gate: failures {res['failed']} (must be 0), p95 ratio during/before {f(res['p95_ratio'], '.2f')} "
        f"(<= {cfg.max_ratio}): {'met' if res['gate']['met'] else 'NOT met'}"
    )
    lines += [
        "",
        "Inter-token latency = gap between consecutive stream chunks (one per engine step). "
        "'during' = from registering v2 until the swap is live + the window.",
        "",
        verdict,
    ]
    (out / "swap.md").write_text("\n".join(lines) + "\n")
    log(verdict)
