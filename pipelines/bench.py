"""`adaflash bench`: methods side by side in ONE run, on the same prompts, interleaved.

Methods: `ar` (plain decoding through our engine), `fixed` (DFlash, verify the whole block),
`fixedK` (verify K), `ema` (one verify length per batch from an EMA of acceptance, SGLang's
approach), `head` (AdaFlash length head, per request), and the transformers peers `hf`
(`generate`, batched with left padding) and `hf-pld` (prompt-lookup assisted generation, which
transformers runs one request at a time, so it is measured at concurrency 1 only). A drafting method
with the suffix `-fullvocab` (`fixed3-fullvocab`) runs with the drafter's draft vocabulary switched
off, i.e. drafting from the target's whole vocabulary, to measure what the reduced draft LM head buys
in the same run. The suffix `-lookup` (`head-lookup`, `ar-lookup`) turns on prompt lookup in the
engine (`Engine.lookup`): a request whose text ends in an n-gram seen earlier verifies the tokens
that followed it instead of drafting; `ar-lookup` is prompt lookup alone, with no drafter. For every
domain x concurrency cell the methods run in an order rotated per cell, so machine noise hits all
alike. Each cell keeps `concurrency` requests in
flight until its prompts are done (a closed loop). With `repeats` > 1 each cell runs every method
that many times, the order rotated again per repeat: a row reports the median run's throughput and
the median of the per-repeat speedups (one slow stretch of the machine hits one method in one
repeat, and a single run's ratio moved by 10-20% at concurrency 32 on two cores).
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from adaflash.engine import POLICIES, Engine, Request, known_policy, make_policy
from adaflash.layers import prepack

ENGINE_METHODS = tuple(POLICIES)  # the engine's verify policies (plus fixedK)
HF_METHODS = ("hf", "hf-pld")
FULL_VOCAB = "-fullvocab"  # suffix: the same method drafting from the whole vocabulary
LOOKUP = "-lookup"  # suffix: the same method with prompt lookup in the engine


def split_method(method: str) -> tuple[str, bool, bool]:
    """'head-lookup-fullvocab' -> (verify policy 'head', lookup on, whole vocabulary)."""
    full = method.endswith(FULL_VOCAB)
    base = method.removesuffix(FULL_VOCAB)
    return base.removesuffix(LOOKUP), base.endswith(LOOKUP), full


def known_method(method: str) -> bool:
    if method in HF_METHODS:
        return True
    base, _, full = split_method(method)
    if full and base == "ar":
        return False  # only drafting methods have a draft vocabulary
    return base != "auto" and known_policy(base)


@dataclass
class BenchPrompt:
    domain: str
    ids: list[int]


def run_engine(
    method: str,
    target,
    drafter,
    head,
    prompts: list[BenchPrompt],
    concurrency: int,
    max_new: int,
    eos: list[int],
    token_budget: int,
    lookup: tuple[int, int] = (4, 2),
) -> dict:
    """`lookup`: (longest chain, shortest n-gram match) for `-lookup` methods."""
    base, with_lookup, full_vocab = split_method(method)
    engine = Engine(
        target,
        drafter if base != "ar" else None,
        make_policy(base, head),
        eos,
        max_batch=concurrency,
        token_budget=token_budget,
        lookup=lookup[0] if with_lookup else 0,
        lookup_min=lookup[1],
    )
    reqs = [Request(f"{method}-{i}", p.ids, max_new) for i, p in enumerate(prompts)]
    vocab = drafter.vocab if drafter is not None else None
    if full_vocab:
        drafter.set_vocab(None)  # draft from the whole vocabulary (the shared, packed LM head)
    try:
        t0 = time.perf_counter()
        states = engine.run(reqs)
        wall = time.perf_counter() - t0
    finally:
        if full_vocab:
            drafter.set_vocab(vocab)
            prepack(drafter.draft_head)  # packed outside the timed runs
    tokens = sum(len(s.out) for s in states)
    rounds = sum(len(s.rounds) for s in states)
    per_tok = [(s.t_done - s.t_start) / len(s.out) for s in states]
    drafted, accepted = [0] * 15, [0] * 15
    true_rate, pred_rate = [], []
    for s in states:
        for r in [r for r in s.rounds if r.source == "drafter"]:
            for j in range(len(r.draft)):
                drafted[j] += 1
                accepted[j] += j < r.accepted
            if r.pred == r.pred:  # a head prediction was made
                pred_rate.append(r.pred)
                true_rate.append(min(1.0, (r.accepted + 1) / drafter.block_size))
    return {
        "tokens_per_s": tokens / wall,
        "tau": (tokens - len(states)) / max(1, rounds),
        "verify_tokens_per_step": engine.stats["verify_tokens"] / max(1, engine.stats["steps"]),
        "max_step_tokens": engine.stats["max_step_tokens"],
        "committed_tokens": tokens,
        "wall_s": wall,
        "latency_per_token_p50": statistics.median(per_tok),
        "latency_per_token_p95": sorted(per_tok)[int(0.95 * (len(per_tok) - 1))],
        "n_requests": len(states),
        "accept_by_position": [a / d if d else None for a, d in zip(accepted, drafted)],
        "head_pred": pred_rate,
        "head_true": true_rate,
        "lookup_rounds": sum(r.source == "lookup" for s in states for r in s.rounds) / max(1, rounds),
    }


def run_hf(method: str, hf_model, prompts: list[BenchPrompt], concurrency: int, max_new: int, eos: list[int], pad_id: int) -> dict:
    """transformers' own generate (greedy); hf-pld uses prompt_lookup_num_tokens (batch 1 only)."""
    kw = dict(max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=pad_id)
    batch = 1 if method == "hf-pld" else concurrency
    if method == "hf-pld":
        kw["prompt_lookup_num_tokens"] = 10
    t0, tokens, per_tok = time.perf_counter(), 0, []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        width = max(len(p.ids) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p.ids)) + p.ids for p in chunk])
        mask = torch.tensor([[0] * (width - len(p.ids)) + [1] * len(p.ids) for p in chunk])
        t1 = time.perf_counter()
        with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=mask, **kw)[:, width:]
        dt = time.perf_counter() - t1
        for row in out.tolist():
            n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            tokens += n
            per_tok.append(dt / n)
    wall = time.perf_counter() - t0
    return {
        "tokens_per_s": tokens / wall,
        "tau": None,
        "verify_tokens_per_step": None,
        "committed_tokens": tokens,
        "wall_s": wall,
        "latency_per_token_p50": statistics.median(per_tok),
        "latency_per_token_p95": sorted(per_tok)[int(0.95 * (len(per_tok) - 1))],
        "n_requests": len(prompts),
        "effective_concurrency": batch,
    }


def bench(
    target,
    drafter,
    head,
    hf_model,
    pad_id: int,
    prompts_by_domain: dict[str, list[BenchPrompt]],
    methods: list[str],
    concurrency: list[int],
    max_new: int,
    token_budget: int,
    min_requests: int = 0,
    repeats: int = 1,
    lookup: tuple[int, int] = (4, 2),
) -> list[dict]:
    """-> one row per method x domain x concurrency. A cell runs the first max(min_requests, concurrency)
    prompts of its domain (all of them when min_requests is 0), so low concurrency stays affordable.
    `repeats`: runs per method and cell; rows carry every run's throughput in `tokens_per_s_runs`."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    rows = []
    cells = [(d, c) for d in prompts_by_domain for c in concurrency]
    bar = tqdm(total=len(cells) * len(methods) * repeats, desc="bench", unit="run")
    for ci, (domain, conc) in enumerate(cells):
        prompts = prompts_by_domain[domain]
        if min_requests:
            prompts = prompts[: max(min_requests, conc)]
        runs: dict[str, list[dict]] = {}
        for rep in range(repeats):
            k = (ci + rep) % len(methods)
            order = methods[k:] + methods[:k]  # rotate per cell and repeat: noise hits all alike
            for m in [m for m in order if not (m == "hf-pld" and conc > 1)]:  # transformers' PLD is batch-1 only
                bar.set_postfix(domain=domain, concurrency=conc, method=m, repeat=rep + 1)
                if m in HF_METHODS:
                    r = run_hf(m, hf_model, prompts, conc, max_new, target.eos_ids, pad_id)
                else:
                    r = run_engine(m, target.model, drafter, head, prompts, conc, max_new, target.eos_ids, token_budget, lookup)
                runs.setdefault(m, []).append(r)
                bar.update(1)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB, peak of the process so far
        for m in [m for m in methods if m in runs]:
            tps = [r["tokens_per_s"] for r in runs[m]]
            r = dict(runs[m][sorted(range(repeats), key=tps.__getitem__)[(repeats - 1) // 2]])  # the median run
            ratios = [x["tokens_per_s"] / a["tokens_per_s"] for x, a in zip(runs[m], runs["ar"])] if "ar" in runs else []
            r.update(
                method=m,
                domain=domain,
                concurrency=conc,
                tokens_per_s_runs=tps,
                speedup_vs_ar=statistics.median(ratios) if ratios else None,
                peak_rss_mib=round(rss),
            )
            rows.append(r)
    bar.close()
    return rows


def report_markdown(rows: list[dict], meta: dict) -> str:
    repeats = meta.get("repeats", 1)
    lines = [
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {meta['machine']}; max_new_tokens {meta['max_new_tokens']}; "
        f"token budget {meta['token_budget']}"
        + (f"; {repeats} repeats per cell: tok/s of the median run, speedup = median of per-repeat ratios" if repeats > 1 else ""),
        "",
        "| domain | concurrency | method | tok/s | speedup vs ar | tau | verify tok/step | max step tok "
        "| p50 ms/tok | p95 ms/tok | requests | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    for r in rows:
        lines.append(
            f"| {r['domain']} | {r['concurrency']} | {r['method']} | {r['tokens_per_s']:.1f} | "
            f"{fmt(r['speedup_vs_ar'], '.2f')}x | {fmt(r['tau'], '.2f')} | {fmt(r['verify_tokens_per_step'], '.1f')} | "
            f"{fmt(r.get('max_step_tokens'), 'd')} | {1000 * r['latency_per_token_p50']:.0f} | "
            f"{1000 * r['latency_per_token_p95']:.0f} | {r['n_requests']} | {r['peak_rss_mib']} |"
        )
    return "\n".join(lines) + "\n"


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bench(rows: list[dict], out: Path) -> list[Path]:
    from adaflash.pipelines.plots import _pyplot

    plt = _pyplot()
    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for m in dict.fromkeys(r["method"] for r in rows):
        pts = {}
        for r in rows:
            if r["method"] == m:
                pts.setdefault(r["concurrency"], []).append(r["tokens_per_s"])
        xs = sorted(pts)
        ax.plot(xs, [sum(pts[x]) / len(pts[x]) for x in xs], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("tokens/s (mean over domains)")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(plt, fig, out / "throughput.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4))
    drafting = [r["method"] for r in rows if any(y is not None for y in r.get("accept_by_position") or [])]
    shown = "fixed" if "fixed" in drafting else (drafting[0] if drafting else None)  # fixed-16 verifies every position
    for r in rows:
        if r["method"] == shown and r["concurrency"] == min(x["concurrency"] for x in rows):
            ys = [y for y in r["accept_by_position"] if y is not None]
            ax.plot(range(1, len(ys) + 1), ys, marker="o", label=r["domain"])
    ax.set_title(f"acceptance by block position ({shown})" if shown else "no drafting method in this run")
    ax.set_xlabel("block position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if shown:
        ax.legend()
    paths.append(_save(plt, fig, out / "accept_by_position.png"))

    heads = [r for r in rows if r.get("head_pred")]
    if heads:
        fig, ax = plt.subplots(figsize=(5, 5))
        for r in heads:
            ax.scatter(r["head_true"], r["head_pred"], s=4, alpha=0.3, label=f"{r['domain']} c{r['concurrency']}")
        ax.plot([0, 1], [0, 1], color="gray", lw=1)
        ax.set_xlabel("true acceptance rate (accepted+1)/K")
        ax.set_ylabel("head prediction")
        ax.legend(markerscale=3, fontsize=7)
        paths.append(_save(plt, fig, out / "head_pred_vs_true.png"))
    return paths


def write_bench(rows: list[dict], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    slim = [{k: v for k, v in r.items() if k not in ("head_pred", "head_true")} for r in rows]
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": slim}, indent=2) + "\n")
    (out / "report.md").write_text(report_markdown(rows, meta))
    plot_bench(rows, out)
