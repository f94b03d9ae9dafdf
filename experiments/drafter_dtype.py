"""The drafter's weight form on this CPU: each dtype (`--drafter-dtype`) beside the others, in lockstep.

    python -m adaflash.experiments.drafter_dtype --out runs/drafter-dtype --dtypes bfloat16,q4

One engine per (method, drafter dtype) over the same prompts, all stepped in turn (`pipelines.bench.lockstep`:
one step each, in a shuffled order, each timed over its own steps), so the machine's drift lands on every
form alike; `ar` (no drafter) is in each cell as the noise gauge (its two runs should agree). Every engine's
output is checked against `ar`'s (greedy: the target's tokens whatever the drafter). What differs between
forms is the drafter's pass (its weights read from memory every drafting step) and its drafts (a q4
drafter's weights are rounded to 4 bits): the table gives both, tok/s and tau. Writes results.json and report.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from adaflash.drafter import DEFAULT_DRAFTER, DRAFTER_DTYPES
from adaflash.target import TARGET_DTYPES, load_target


def cell_prompts(target, domain: str, n: int) -> list:
    """n prompts of `domain` (its eval split first, then the rest, repeated where it has fewer)."""
    from adaflash.pipelines.bench import BenchPrompt
    from adaflash.pipelines.prompts import load_domain

    recs = load_domain(domain)
    recs = [r for r in recs if r.split == "eval"] + [r for r in recs if r.split != "eval"]
    return [BenchPrompt(domain, target.encode_chat(recs[i % len(recs)].messages)) for i in range(n)]


def run(
    target, drafters: dict, methods: list[str], domains: list[str], cells: list[tuple[int, int]], max_new: int, budget: int
) -> list[dict]:
    """One lockstep run per (domain, concurrency cell) over every method x drafter dtype -> rows."""
    from adaflash.pipelines.bench import bench_requests, engine_row, lockstep, make_engine

    rows = []
    for domain in domains:
        for conc, n_req in cells:
            prompts = cell_prompts(target, domain, n_req)
            keys = [(m, dt) for m in methods for dt in drafters]
            engines = {f"{m}/{dt}": make_engine(m, target.model, drafters[dt], None, conc, target.eos_ids, budget) for m, dt in keys}
            reqs = {k: bench_requests(k, prompts, max_new) for k in engines}
            states, wall, _ = lockstep(engines, reqs)
            ref = [list(s.out) for s in states[f"ar/{next(iter(drafters))}"]] if "ar" in methods else None
            for m, dt in keys:
                k = f"{m}/{dt}"
                r = engine_row(engines[k], states[k], wall[k], next(iter(drafters.values())).block_size)
                same = None if ref is None else r.pop("outputs") == ref
                rows.append({"domain": domain, "concurrency": conc, "requests": n_req, "method": m, "drafter_dtype": dt,
                             "tokens_per_s": r["tokens_per_s"], "tau": r["tau"], "steps": r["steps"], "same_as_ar": same})  # fmt: skip
            done = [r for r in rows if r["domain"] == domain and r["concurrency"] == conc]
            speeds = ", ".join(f"{r['method']}/{r['drafter_dtype']} {r['tokens_per_s']:.1f}" for r in done)
            print(f"{domain} c={conc}: {speeds}", flush=True)
    return rows


def report(res: dict) -> str:
    dts = res["dtypes"]
    base = dts[0]
    head = "| domain | c | method | " + " | ".join(f"{d} tok/s" for d in dts) + " | " + " | ".join(f"{d} vs {base}" for d in dts[1:])
    head += " | tau " + " / ".join(dts) + " | same as `ar` |"
    lines = [head, "|---" * (3 + 2 * len(dts)) + "|---|"]
    by = {(r["domain"], r["concurrency"], r["method"], r["drafter_dtype"]): r for r in res["rows"]}
    for domain, conc, m in dict.fromkeys((r["domain"], r["concurrency"], r["method"]) for r in res["rows"]):
        rs = [by[(domain, conc, m, d)] for d in dts]
        tps = [r["tokens_per_s"] for r in rs]
        same = "-" if m == "ar" else "yes" if all(r["same_as_ar"] for r in rs) else "NO"
        lines.append(
            f"| {domain} | {conc} | {m} | " + " | ".join(f"{t:.1f}" for t in tps) + " | "
            + " | ".join(f"{t / tps[0]:.3f}x" for t in tps[1:]) + " | " + " / ".join(f"{r['tau']:.2f}" for r in rs) + f" | {same} |"
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from adaflash.experiments.drafter_size import write_results

    from adaflash.drafter import load_drafter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/drafter-dtype"), help="folder for results.json and report.md")
    p.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    names = ", ".join(DRAFTER_DTYPES)
    p.add_argument("--dtypes", default="bfloat16,q4", help=f"comma-separated drafter dtypes ({names}), the baseline first")
    p.add_argument("--dtype", default="float32", choices=TARGET_DTYPES, help="the target's dtype (every engine verifies in it)")
    p.add_argument("--methods", default="ar,fixed6,cost", help="bench engine methods; ar (no drafter) gauges the noise")
    p.add_argument("--domains", default="gsm8k,mtbench", help="prompt domains (`adaflash.pipelines.prompts`)")
    p.add_argument("--cells", default="1:16,8:32,32:64", help="concurrency:requests pairs")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--token-budget", type=int, default=512, help="tokens a step may verify (the engine's)")
    args = p.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    if any(d not in DRAFTER_DTYPES for d in dtypes) or len(set(dtypes)) != len(dtypes) or not dtypes:
        p.error(f"--dtypes: distinct names among {', '.join(DRAFTER_DTYPES)}; got {args.dtypes!r}")
    cells = [tuple(int(v) for v in c.split(":")) for c in args.cells.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    target = load_target("smollm2", args.dtype)
    drafters = {d: load_drafter(args.drafter, target.model, target.identity, d) for d in dtypes}
    res = {"dtypes": dtypes, "target_dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "methods": args.methods.split(",")}
    res["rows"] = run(target, drafters, res["methods"], args.domains.split(","), cells, args.max_new_tokens, args.token_budget)
    res["wall_s"] = time.perf_counter() - t0
    write_results(args.out, res, report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
