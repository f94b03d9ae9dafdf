"""`adaflash loadgen`: replay prompt sets through the OpenAI-compatible API, with a domain shift.

Open-loop arrivals at `--rate` requests/s (0 = closed loop: send whenever a slot is free), at most
`--concurrency` in flight. Each request draws its domain from the mix in force at that moment: a
fixed mix (`--domains gsm8k:0.5,humaneval:0.5`) or a schedule of phases (`--schedule "gsm8k for 5m,
then humaneval"`), so a user can watch tau drop at the shift and recover as the trainer adapts.
Prompts come from the built prompt sets (train or eval split) or a JSONL file, cycled in a seeded
shuffled order per domain. 429/502/503/504 and connection errors are retried, honouring Retry-After.

Every finished request can be written as one JSON line (`--out`); a progress line goes to stderr
every `--report-every` seconds, and a summary (overall, per phase, per domain) to stdout at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import requests

RETRY_STATUS = (429, 502, 503, 504)
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass
class Phase:
    """One stretch of the schedule: a domain mix, for `duration_s` seconds (None = until the end)."""

    mix: dict[str, float]  # domain -> probability, sums to 1
    duration_s: float | None

    def describe(self) -> str:
        return ",".join(d if len(self.mix) == 1 else f"{d}:{w:.2f}" for d, w in self.mix.items())


def parse_duration(text: str) -> float:
    """'90' / '90s' / '5m' / '1.5h' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"bad duration {text!r}: use a positive number with an optional unit s, m or h (e.g. 90s, 5m)")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def parse_mix(text: str) -> dict[str, float]:
    """'gsm8k:0.7,humaneval:0.3' or 'gsm8k,humaneval' (equal weights) -> normalised weights."""
    weights: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, _, w = part.partition(":")
        name = name.strip()
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f"bad domain {name!r} in mix {text!r}")
        try:
            weight = float(w) if w.strip() else 1.0
        except ValueError:
            raise ValueError(f"bad weight {w!r} for domain {name!r} in mix {text!r}") from None
        if weight < 0 or name in weights:
            raise ValueError(f"mix {text!r}: weights must be >= 0 and each domain given once")
        weights[name] = weight
    total = sum(weights.values())
    if not weights or total <= 0:
        raise ValueError(f"mix {text!r} names no domain with a positive weight")
    return {d: w / total for d, w in weights.items() if w > 0}


def parse_schedule(text: str) -> list[Phase]:
    """'gsm8k for 5m, then humaneval:0.5,gsm8k:0.5 for 2m, then humaneval' -> phases.

    Phases are separated by 'then' (optionally after a comma) or ';'. Every phase but the last needs
    'for DURATION'; the last one without it runs until the load stops.
    """
    parts = [p.strip() for p in re.split(r"\s*(?:,?\s*\bthen\b|;)\s*", text.strip()) if p.strip()]
    if not parts:
        raise ValueError("empty --schedule")
    phases = []
    for i, part in enumerate(parts):
        m = re.fullmatch(r"(?P<mix>.+?)(?:\s+for\s+(?P<dur>\S+))?", part)
        duration = parse_duration(m.group("dur")) if m.group("dur") else None
        if duration is None and i < len(parts) - 1:
            raise ValueError(f"schedule phase {i + 1} ({part!r}) needs 'for DURATION' since another phase follows")
        phases.append(Phase(parse_mix(m.group("mix")), duration))
    return phases


def phase_at(phases: list[Phase], t: float) -> int:
    """Index of the phase in force t seconds after the start (the last one once all have elapsed)."""
    end = 0.0
    for i, ph in enumerate(phases):
        if ph.duration_s is None:
            return i
        end += ph.duration_s
        if t < end:
            return i
    return len(phases) - 1


def load_pools(prompt_sets: Path | None, split: str, prompts_file: Path | None, domains: set[str]) -> dict[str, list[list[dict]]]:
    """Chat messages per domain, for the domains the schedule uses."""
    pools: dict[str, list[list[dict]]] = {}
    if prompts_file is not None:
        from adaflash.pipelines.prompts import read_prompts_file

        for item in read_prompts_file(prompts_file):
            msgs = item["messages"]
            msgs = [{"role": "user", "content": msgs}] if isinstance(msgs, str) else msgs
            pools.setdefault(item["domain"] or "file", []).append(msgs)
        source = str(prompts_file)
    else:
        from adaflash.pipelines.prompts import available_domains, build_prompt_sets, load_domain, read_prompts

        unknown = sorted(domains - set(available_domains()))
        if unknown:
            raise ValueError(f"unknown domain(s) {unknown}; prompt sets have {', '.join(available_domains())}")
        path = prompt_sets / f"{split}.parquet"
        if not path.exists():
            print(f"loadgen: building prompt sets into {prompt_sets} (once)", file=sys.stderr, flush=True)
            build_prompt_sets(prompt_sets)
        for r in read_prompts(path, sorted(domains)):
            pools.setdefault(r.domain, []).append(r.messages)
        for d in sorted(domains - set(pools)):  # e.g. magpie_* in prompt sets built before it existed
            for r in load_domain(d):
                if r.split == split:
                    pools.setdefault(d, []).append(r.messages)
        source = str(path)
    missing = sorted(domains - set(pools))
    if missing:
        raise ValueError(
            f"no prompts for domain(s) {missing} in {source} (found: {sorted(pools)}); "
            f'for aime use --split eval, for a JSONL file set "domain" on its lines'
        )
    return {d: pools[d] for d in domains}


@dataclass
class Result:
    t_start: float  # seconds since the load started
    latency_s: float
    domain: str
    phase: int
    ok: bool
    status: int | None
    retries: int
    completion_tokens: int = 0
    tau: float | None = None
    drafter_version: str | None = None
    error: str | None = None
    id: str | None = None  # the server's response id (= the request_id of its trajectory row)
    ttft_s: float | None = None  # time to the first streamed token (--stream only)
    t_unix: float = 0.0  # wall-clock start (to line results up with other logs)

    def record(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def _retry_after(resp: requests.Response | None, attempt: int) -> float:
    """Seconds to wait before the next try: the server's Retry-After if it gave one, else backoff."""
    if resp is not None:
        try:
            return max(0.0, min(60.0, float(resp.headers.get("Retry-After", ""))))
        except ValueError:
            pass
    return min(10.0, 0.5 * 2**attempt)


def served_model(base_url: str, headers: dict) -> str:
    """The first model id the server lists at /v1/models."""
    try:
        resp = requests.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (requests.RequestException, KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"cannot list models at {base_url}/v1/models ({type(e).__name__}: {e}); is `adaflash serve` running there? (or pass --model)"
        ) from None


def read_stream(resp: requests.Response) -> dict:
    """A streamed chat completion (server-sent events) -> the fields a non-streamed response has that
    the load generator reads: id, usage, adaflash stats (from the final chunks). Raises ValueError on an
    error event or a stream that ends without [DONE] (the server died mid-answer)."""
    out: dict = {"ttft_s": None}
    t0 = time.monotonic()
    for line in resp.iter_lines(decode_unicode=True):
        if not line or not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return out
        obj = json.loads(data)
        if "error" in obj:
            raise ValueError(f"error event: {obj['error'].get('message', obj['error'])}")
        out["id"] = obj.get("id", out.get("id"))
        for key in ("usage", "adaflash"):
            if obj.get(key):
                out[key] = obj[key]
        if out["ttft_s"] is None and any((c.get("delta") or {}).get("content") for c in obj.get("choices", [])):
            out["ttft_s"] = time.monotonic() - t0
    raise ValueError("stream ended without [DONE]")


def send_one(
    url: str, body: dict, headers: dict, timeout: float, max_retries: int, stop: threading.Event
) -> tuple[dict | None, int | None, int, str | None]:
    """POST one chat completion with retries -> (response JSON, HTTP status, retries, error). A streamed
    request (body["stream"]) is retried only before its first byte: after that, a broken stream is a failure."""
    attempt = 0
    stream = bool(body.get("stream"))
    while True:
        resp = None
        try:
            resp = requests.post(url, json=body, headers=headers, timeout=timeout, stream=stream)
            if resp.status_code == 200 and stream:
                try:
                    return read_stream(resp), 200, attempt, None
                except (ValueError, requests.RequestException) as e:
                    return None, 200, attempt, f"broken stream: {type(e).__name__}: {e}"
            if resp.status_code == 200:
                return resp.json(), 200, attempt, None
            error = f"HTTP {resp.status_code}: {resp.text[:200]}"
            retryable = resp.status_code in RETRY_STATUS
        except requests.RequestException as e:
            error, retryable = f"{type(e).__name__}: {e}", True
        if not retryable or attempt >= max_retries or stop.wait(_retry_after(resp, attempt)):
            return None, resp.status_code if resp is not None else None, attempt, error
        attempt += 1


class LoadGen:
    """Dispatches requests on a schedule from one thread; each request runs in its own thread."""

    def __init__(self, args: argparse.Namespace, phases: list[Phase], pools: dict[str, list[list[dict]]]):
        self.args, self.phases, self.pools = args, phases, pools
        self.url = args.url.rstrip("/") + "/v1/chat/completions"
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.rng = random.Random(args.seed)
        self.order = {d: self.rng.sample(range(len(p)), len(p)) for d, p in pools.items()}  # shuffled cycle
        self.next_idx = {d: 0 for d in pools}
        self.slots = threading.BoundedSemaphore(args.concurrency)
        self.lock = threading.Lock()
        self.results: list[Result] = []
        self.in_flight = 0
        self.sent = 0
        self.stop = threading.Event()
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        self.out = open(args.out, "a") if args.out else None
        self.t0 = time.monotonic()

    def _pick(self, t: float) -> tuple[int, str, list[dict]]:
        phase = phase_at(self.phases, t)
        mix = self.phases[phase].mix
        domain = self.rng.choices(list(mix), weights=list(mix.values()))[0]
        i = self.next_idx[domain]
        self.next_idx[domain] = i + 1
        order = self.order[domain]
        return phase, domain, self.pools[domain][order[i % len(order)]]

    def _request(self, t: float, phase: int, domain: str, messages: list[dict]) -> None:
        body = {
            "model": self.args.model,
            "messages": messages,
            "max_tokens": self.args.max_tokens,
            "temperature": self.args.temperature,
            "metadata": {"domain": domain},
        }
        if self.args.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        start, t_unix = time.monotonic(), time.time()
        data, status, retries, error = send_one(self.url, body, self.headers, self.args.timeout, self.args.max_retries, self.stop)
        res = Result(t, time.monotonic() - start, domain, phase, data is not None, status, retries, error=error, t_unix=t_unix)
        if data is not None:
            stats = data.get("adaflash") or {}
            res.id = data.get("id")
            res.ttft_s = data.get("ttft_s")
            res.completion_tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
            res.tau = float(stats["tau"]) if stats.get("tau") is not None else None
            version = stats.get("drafter_version", stats.get("version"))
            res.drafter_version = None if version is None else str(version)
        with self.lock:
            self.results.append(res)
            self.in_flight -= 1
            if self.out:
                self.out.write(json.dumps(res.record()) + "\n")
                self.out.flush()
        self.slots.release()

    def _report(self, t: float) -> None:
        with self.lock:
            recent = [r for r in self.results if r.t_start + r.latency_s >= t - self.args.report_every]
            ok = [r for r in recent if r.ok]
            taus = [r.tau for r in ok if r.tau is not None]
            versions = sorted({r.drafter_version for r in ok if r.drafter_version is not None})
            line = (
                f"loadgen t={t:.0f}s phase {phase_at(self.phases, t) + 1}/{len(self.phases)} "
                f"({self.phases[phase_at(self.phases, t)].describe()}) sent {self.sent} done {len(self.results)} "
                f"in-flight {self.in_flight} | last {self.args.report_every:.0f}s: {len(ok)} ok "
                f"{len(recent) - len(ok)} failed, {sum(r.completion_tokens for r in ok) / self.args.report_every:.1f} tok/s"
                + (f", tau {statistics.fmean(taus):.2f}" if taus else "")
                + (f", drafter {','.join(versions)}" if versions else "")
            )
        print(line, file=sys.stderr, flush=True)

    def run(self, duration_s: float | None, max_requests: int | None) -> float:
        """Dispatch until the duration, the request count or a stop signal; drain; return wall seconds."""
        next_at, next_report = 0.0, self.args.report_every
        while not self.stop.is_set():
            t = time.monotonic() - self.t0
            if (duration_s is not None and t >= duration_s) or (max_requests is not None and self.sent >= max_requests):
                break
            if t >= next_report:
                self._report(t)
                next_report += self.args.report_every
            if self.args.rate > 0 and t < next_at:
                self.stop.wait(min(next_at - t, 0.5))
                continue
            if not self.slots.acquire(timeout=0.5):
                continue
            t = time.monotonic() - self.t0
            phase, domain, messages = self._pick(t)
            with self.lock:
                self.in_flight += 1
                self.sent += 1
            threading.Thread(target=self._request, args=(t, phase, domain, messages), daemon=True).start()
            if self.args.rate > 0:
                gap = self.rng.expovariate(self.args.rate) if self.args.arrivals == "poisson" else 1.0 / self.args.rate
                next_at = max(next_at + gap, t - 1.0)  # never burst more than ~1 s of backlog
        deadline = time.monotonic() + self.args.drain_timeout
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.out:
            self.out.close()
        return time.monotonic() - self.t0


def _stats(rs: list[Result], wall_s: float) -> dict:
    ok = [r for r in rs if r.ok]
    taus = [r.tau for r in ok if r.tau is not None]
    lat = sorted(r.latency_s for r in ok)
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(rs),
        "ok": len(ok),
        "failed": len(rs) - len(ok),
        "retries": sum(r.retries for r in rs),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "mean_tau": round(statistics.fmean(taus), 3) if taus else None,
        "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
        "latency_p95_s": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 3) if lat else None,
        "drafter_versions": sorted({r.drafter_version for r in ok if r.drafter_version is not None}),
    }


def summarize(results: list[Result], phases: list[Phase], wall_s: float, abandoned: int) -> dict:
    """Overall, per-phase and per-domain statistics of a finished run."""
    per_phase = {}
    for i, ph in enumerate(phases):
        rs = [r for r in results if r.phase == i]
        if rs:
            span = max(r.t_start + r.latency_s for r in rs) - min(r.t_start for r in rs)
            per_phase[f"{i + 1}: {ph.describe()}"] = _stats(rs, span)
    domains = sorted({r.domain for r in results})
    return {
        "wall_s": round(wall_s, 2),
        "abandoned_in_flight": abandoned,
        **_stats(results, wall_s),
        "per_phase": per_phase,
        "per_domain": {d: _stats([r for r in results if r.domain == d], wall_s) for d in domains},
    }


def _print_summary(s: dict) -> None:
    def line(name: str, st: dict) -> str:
        tau = f"{st['mean_tau']:.2f}" if st["mean_tau"] is not None else "-"
        p50 = f"{st['latency_p50_s']:.2f}s" if st["latency_p50_s"] is not None else "-"
        return (
            f"  {name:<28} {st['ok']:>5} ok {st['failed']:>4} failed {st['tokens_per_s']:>8.1f} tok/s "
            f"tau {tau:>5}  p50 {p50}  drafter {','.join(st['drafter_versions']) or '-'}"
        )

    print(
        f"loadgen: {s['requests']} requests in {s['wall_s']:.1f}s ({s['abandoned_in_flight']} abandoned in flight), {s['retries']} retries"
    )
    print(line("all", s))
    for name, st in s["per_phase"].items():
        print(line(f"phase {name}", st))
    for name, st in s["per_domain"].items():
        print(line(f"domain {name}", st))


def run(args: argparse.Namespace) -> int:
    from adaflash.config import UsageError

    try:
        phases = parse_schedule(args.schedule) if args.schedule else [Phase(parse_mix(args.domains), None)]
        duration = parse_duration(args.duration) if args.duration else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.concurrency < 1 or args.rate < 0 or args.max_tokens < 1 or (args.requests is not None and args.requests < 1):
        raise UsageError("--concurrency, --max-tokens and --requests must be >= 1 and --rate >= 0")
    if duration is None and args.requests is None:
        if any(p.duration_s is None for p in phases):
            raise UsageError("give --duration or --requests (or a --schedule whose every phase has 'for DURATION')")
        duration = sum(p.duration_s for p in phases)
    domains = {d for p in phases for d in p.mix}
    try:
        pools = load_pools(Path(args.prompt_sets), args.split, Path(args.prompts_file) if args.prompts_file else None, domains)
    except ValueError as e:
        raise UsageError(str(e)) from None
    gen = LoadGen(args, phases, pools)
    if args.model is None:
        try:
            args.model = served_model(args.url, gen.headers)
        except ValueError as e:
            raise UsageError(str(e)) from None

    def on_signal(signum, frame):  # first signal: stop sending and drain; the drain is bounded anyway
        print(
            f"loadgen: {signal.Signals(signum).name}, stopping (waiting up to {args.drain_timeout:.0f}s for {gen.in_flight} in flight)",
            file=sys.stderr,
            flush=True,
        )
        gen.stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
    print(
        f"loadgen: {gen.url}, rate {args.rate or 'closed-loop'}/s, concurrency {args.concurrency}, "
        f"phases: {'; then '.join(p.describe() + (f' for {p.duration_s:.0f}s' if p.duration_s else '') for p in phases)}",
        file=sys.stderr,
        flush=True,
    )
    wall = gen.run(duration, args.requests)
    with gen.lock:
        results, abandoned = list(gen.results), gen.in_flight
    summary = summarize(results, phases, wall, abandoned)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(summary)
    return 0 if summary["ok"] > 0 else 1


def register(sub) -> None:
    p = sub.add_parser(
        "loadgen",
        help="replay prompt sets through the HTTP API (rate, concurrency, domain shift)",
        description="Sends chat completions built from the prompt sets to an `adaflash serve` endpoint "
        "with a domain mix or a shift schedule, and prints ok/failed, tokens/s and mean tau.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (the /v1 API lives under it)")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (0 = closed loop: as fast as slots free)")
    p.add_argument("--arrivals", choices=["constant", "poisson"], default="constant", help="inter-arrival times")
    p.add_argument("--concurrency", type=int, default=4, help="most requests in flight at once")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--duration", help="stop sending after this long (e.g. 90s, 10m); default: the schedule's length")
    stop.add_argument("--requests", type=int, help="stop after sending this many requests")
    p.add_argument("--domains", default="gsm8k,humaneval", help="domain mix, e.g. gsm8k:0.5,humaneval:0.5 (equal weights when none given)")
    p.add_argument(
        "--schedule",
        help='phases instead of --domains, e.g. "gsm8k for 5m, then humaneval" '
        '(each phase a mix; every phase but the last needs "for DURATION")',
    )
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--stream", action="store_true", help="stream each answer (server-sent events); records time to first token")
    p.add_argument("--model", help="the request's model field (default: the first model the server lists)")
    p.add_argument(
        "--api-key", default=os.environ.get("ADAFLASH_API_KEY"), help="Bearer key, if the server wants one (default: $ADAFLASH_API_KEY)"
    )
    p.add_argument(
        "--prompt-sets",
        default="runs/pretrain-smollm2/prompts",
        help="folder of train/eval.parquet from the prompt-set builder (built if missing)",
    )
    p.add_argument("--split", default="train", choices=["train", "eval"], help="which split to replay")
    p.add_argument("--prompts-file", help='JSONL prompts instead (adaflash generate format, with "domain")')
    p.add_argument("--seed", type=int, default=0, help="seeds prompt order, domain draws and Poisson arrivals")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per HTTP request")
    p.add_argument("--max-retries", type=int, default=5, help="retries on 429/502/503/504 and connection errors")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="seconds to wait for in-flight requests at the end")
    p.add_argument("--report-every", type=float, default=10.0, help="seconds between progress lines on stderr")
    p.add_argument("--out", help="append one JSON line per finished request to this file")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)
