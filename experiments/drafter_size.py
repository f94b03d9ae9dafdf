"""Drafter depth on this CPU: what extra layers cost per token and what tau they must buy (issue 23 item 6).

    python -m adaflash.experiments.drafter_size --out runs/drafter-size --layers 3,4,5

One run, two parts, from the committed drafter (3 layers) and its copies deepened to each `--layers`
depth (`drafter.deepen`: the new layers start as the identity, so every copy drafts exactly the same
tokens until trained):
  cost  the engine at concurrency 1 and 32 on GSM8K eval prompts, one engine per depth in lockstep
        (`pipelines.bench.lockstep`: one step each in turn, each timed over its own steps), the same
        verify policy (`--method`); drafts, rounds and outputs are identical across depths (checked),
        so the tok/s ratio is the price of the extra layers alone, and tau must rise by its inverse for
        a deeper drafter to break even.
  tau   the shallowest and deepest copies trained side by side on the same batches (pretraining's
        recipe, `experiments.train_speed.Arm`) on the target's greedy answers to GSM8K and HumanEval eval
        prompts, held-out teacher-forced tau before and after: the tau a CPU-sized budget buys.
Writes results.json and report.md into OUT.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from adaflash.drafter import DEFAULT_DRAFTER
from adaflash.request import Request
from adaflash.target import bf16_is_fast, load_target


def cost_part(target, drafter_dir: str, layers: list[int], method: str, cells: list[tuple[int, int]], max_new: int) -> dict:
    """tok/s per depth at each (concurrency, requests) cell, all depths in lockstep on the same prompts."""
    from adaflash.pipelines.bench import lockstep, make_engine
    from adaflash.pipelines.prompts import load_domain

    from adaflash.drafter import deepen, load_drafter_and_head
    from adaflash.layers import prepack

    base, _ = load_drafter_and_head(drafter_dir, target, "auto")
    drafters = {n: base if n == base.config.num_layers else deepen(base, target.model, n) for n in layers}
    for d in drafters.values():
        d.eval().requires_grad_(False)
        prepack(d)
    recs = [r for r in load_domain("gsm8k") if r.split == "eval"]
    out = {}
    for conc, n_req in cells:
        prompts = [target.encode_chat(r.messages) for r in recs[:n_req]]
        engines = {n: make_engine(method, target.model, d, None, conc, target.eos_ids, 512) for n, d in drafters.items()}
        reqs = {n: [Request(f"L{n}-{i}", p, max_new) for i, p in enumerate(prompts)] for n in drafters}
        states, wall, _ = lockstep(engines, reqs)
        outs = {n: [list(s.out) for s in states[n]] for n in drafters}
        rounds = {n: sum(len(s.rounds) for s in states[n]) for n in drafters}
        tokens = {n: sum(len(o) for o in outs[n]) for n in drafters}
        first = layers[0]
        out[f"c{conc}"] = {
            "requests": n_req,
            "same_outputs": all(outs[n] == outs[first] for n in drafters),
            "same_rounds": len(set(rounds.values())) == 1,
            "tau": (tokens[first] - n_req) / max(1, rounds[first]),
            "steps": {n: engines[n].stats["steps"] for n in drafters},
            "tokens_per_s": {n: tokens[n] / wall[n] for n in drafters},
            "wall_s": wall,
        }
        row = out[f"c{conc}"]
        print(f"c={conc}: " + ", ".join(f"{n} layers {row['tokens_per_s'][n]:.1f} tok/s" for n in drafters), flush=True)
    return out


def tau_part(drafter_dir: str, layers: list[int], steps: int, lr: float, per_domain: int, out: Path) -> dict:
    """Held-out tau before/after `steps` of pretraining's recipe for the shallowest and deepest depths."""
    from adaflash.experiments.train_speed import Arm, answers, sequences
    from adaflash.trainer.data import supervise

    from adaflash.distributed import init_distributed

    fast = bf16_is_fast()
    fp32 = load_target("smollm2", "float32")
    teacher = load_target("smollm2", "bfloat16") if fast else fp32  # the recipe's target head under autocast
    rows = answers(fp32, out, per_domain, 128)
    train, held = sequences(rows, 16)
    supervise(fp32.model, train + held, 8)
    init_distributed()
    depths = sorted({layers[0], layers[-1]})
    arms = {n: Arm("pretrain", "draft", teacher, drafter_dir, lr, (train, held), layers=n, autocast=fast) for n in depths}
    res = {"train_seqs": len(train), "held_seqs": len(held), "steps": steps, "lr": lr, "autocast_bf16": fast}
    before = {n: a.tau() for n, a in arms.items()}
    secs = {n: [] for n in arms}
    for i in range(steps):
        for n in arms if i % 2 == 0 else reversed(list(arms)):  # alternate who goes first: the same load on both
            secs[n].append(arms[n].step(i))
        if (i + 1) % 10 == 0:
            print(f"step {i + 1}/{steps} " + " ".join(f"{n} layers {secs[n][-1]:.2f}s" for n in arms), flush=True)
    res["arms"] = {n: {"tau_before": before[n], "tau_after": a.tau(), "s_per_step": statistics.median(secs[n])} for n, a in arms.items()}
    return res


def write_results(out: Path, res: dict, text: str) -> None:
    """results.json and report.md (`text`, also printed) into `out`."""
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "report.md").write_text(text)
    print(text)


def report(res: dict) -> str:
    layers = res["layers"]
    lines = ["| concurrency | requests | tau (all depths) | " + " | ".join(f"{n} layers tok/s" for n in layers)]
    lines[0] += " | " + " | ".join(f"{n} vs {layers[0]}" for n in layers[1:]) + " | same outputs |"
    lines.append("|---" * (4 + 2 * len(layers) - 1) + "|")
    for cell, c in res["cost"].items():
        tps = [c["tokens_per_s"][n] for n in layers]
        ratios = " | ".join(f"{t / tps[0]:.3f}x" for t in tps[1:])
        same = "yes" if c["same_outputs"] and c["same_rounds"] else "NO"
        speeds = " | ".join(f"{t:.1f}" for t in tps)
        lines.append(f"| {cell[1:]} | {c['requests']} | {c['tau']:.2f} | {speeds} | {ratios} | {same} |")
    if "tau" in res:
        t = res["tau"]
        lines += ["", f"Training: {t['steps']} steps at lr {t['lr']}, {t['train_seqs']} answers, {t['held_seqs']} held out", ""]
        lines += ["| layers | held-out tau before | after | s/step |", "|---|---|---|---|"]
        for n, a in t["arms"].items():
            lines.append(f"| {n} | {a['tau_before']:.3f} | {a['tau_after']:.3f} | {a['s_per_step']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/drafter-size"), help="folder for results.json, report.md (and answers.json)")
    p.add_argument("--drafter", default=str(DEFAULT_DRAFTER), help="the drafter every depth starts from")
    p.add_argument("--layers", default="3,4,5", help="comma-separated depths, the drafter's own first")
    p.add_argument("--method", default="fixed4", help="the bench engine method every depth runs (a fixed verify length keeps rounds equal)")
    p.add_argument("--cells", default="1:4,32:32", help="concurrency:requests pairs of the cost part")
    p.add_argument("--max-new-tokens", type=int, default=64, help="per request in the cost part")
    p.add_argument("--steps", type=int, default=100, help="training steps per arm in the tau part (0: cost part only)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--per-domain", type=int, default=32, help="GSM8K and HumanEval eval prompts answered for the tau part")
    args = p.parse_args(argv)
    layers = [int(x) for x in args.layers.split(",")]
    if layers != sorted(layers) or len(set(layers)) != len(layers):
        p.error(f"--layers must rise, the drafter's own depth first: got {args.layers}")
    cells = [tuple(int(v) for v in c.split(":")) for c in args.cells.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    target = load_target("smollm2", "auto")
    res = {"layers": layers, "method": args.method, "max_new_tokens": args.max_new_tokens, "dtype": str(target.model.dtype)}
    res["cost"] = cost_part(target, args.drafter, layers, args.method, cells, args.max_new_tokens)
    del target
    if args.steps:
        res["tau"] = tau_part(args.drafter, layers, args.steps, args.lr, args.per_domain, args.out)
    res["wall_s"] = time.perf_counter() - t0
    write_results(args.out, res, report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
