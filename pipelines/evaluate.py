"""Single-request evaluation: plain decoding vs DFlash, side by side on the same prompts.

For every prompt plain decoding and each DFlash variant (verify length) run back to back
(interleaved, so machine noise hits all alike); greedy outputs are checked token for token.
Variants: chains (verify lengths) and greedy token trees (`eval.trees`, node counts; each also with a
prompt-lookup branch of every length in `eval.lookup` > 0). Reports tau,
acceptance by block position (a tree's: the depth its accepted path reached) and the wall-clock
speedup per domain.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from tqdm import tqdm

from adaflash.drafter import Drafter
from adaflash.generate import generate_ar, generate_dflash
from adaflash.target import Target


def variants_of(verify_lens: list[int], trees: list[int], lookup: list[int] = (0,)) -> dict[str, dict]:
    """DFlash variants by name -> generate_dflash keyword arguments: chains (verify lengths), then trees
    (`dflash-treeN`, and `dflash-treeN-lookupL` for every lookup length L > 0)."""
    out = {f"dflash-v{v}": {"verify_len": v} for v in verify_lens}
    for n in trees:
        out.update({f"dflash-tree{n}" + (f"-lookup{lk}" if lk else ""): {"tree": n, **({"lookup": lk} if lk else {})} for lk in lookup})
    return out


def evaluate(
    target: Target,
    drafter: Drafter,
    records: list,
    max_new_tokens: int,
    verify_lens: list[int],
    trees: list[int] = (),
    lookup: list[int] = (0,),
) -> dict:
    """-> {"domains": {domain: {"ar_tokens_per_s", "variants": {"dflash-v16": {...}, "dflash-tree8": ...}}}}."""
    variants = variants_of(verify_lens, list(trees), list(lookup))
    runs: dict[str, list] = {}
    for rec in tqdm(records, desc="eval", unit="prompt"):
        ids = target.encode_chat(rec.messages)
        ar = generate_ar(target.model, ids, max_new_tokens, target.eos_ids)
        sds = {name: generate_dflash(target.model, drafter, ids, max_new_tokens, target.eos_ids, **kw) for name, kw in variants.items()}
        runs.setdefault(rec.domain, []).append((rec.prompt_id, ar, sds))
    report = {"max_new_tokens": max_new_tokens, "verify_lens": verify_lens, "trees": list(trees), "lookup": list(lookup), "domains": {}}
    k = drafter.block_size - 1
    for domain, rows in runs.items():
        ar_tps = sum(len(a.output_ids) for _, a, _ in rows) / sum(a.wall_s for _, a, _ in rows)
        out = {}
        for name, kw in variants.items():
            sd = [s[name] for _, _, s in rows]
            tps = sum(len(s.output_ids) for s in sd) / sum(s.wall_s for s in sd)
            drafted = [sum(s.drafted_at[j] for s in sd) for j in range(k)]
            accepted = [sum(s.accepted_at[j] for s in sd) for j in range(k)]
            rounds = max(1, sum(s.rounds for s in sd))
            out[name] = {
                **kw,
                "identical_greedy": sum(a.output_ids == s[name].output_ids for _, a, s in rows),
                "tau": sum(s.committed for s in sd) / rounds,
                "tau_median_prompt": statistics.median(s.tau for s in sd),
                "tokens_per_s": tps,
                "speedup": tps / ar_tps,
                "accept_by_position": [round(a / d, 3) if d else None for a, d in zip(accepted, drafted)],
                # share of all rounds that accepted at least j drafts: comparable between chains and trees
                # (a tree's per-depth rate above is conditioned on the tree reaching that depth)
                "accepted_at_least": [round(a / rounds, 3) for a in accepted],
                "mismatched_prompts": [pid for pid, a, s in rows if a.output_ids != s[name].output_ids],
            }
        report["domains"][domain] = {
            "prompts": len(rows),
            "tokens": sum(len(a.output_ids) for _, a, _ in rows),
            "ar_tokens_per_s": ar_tps,
            "variants": out,
        }
    return report


def markdown(report: dict) -> str:
    lines = ["| domain | prompts | method | identical greedy | tau | tok/s | speedup vs AR |", "|---|---|---|---|---|---|---|"]
    for d, r in report["domains"].items():
        lines.append(f"| {d} | {r['prompts']} | ar | - | 1.00 | {r['ar_tokens_per_s']:.1f} | 1.00x |")
        for name, v in r["variants"].items():
            lines.append(
                f"| {d} | {r['prompts']} | {name} | {v['identical_greedy']}/{r['prompts']} | {v['tau']:.2f} | "
                f"{v['tokens_per_s']:.1f} | {v['speedup']:.2f}x |"
            )
    first = next(iter(next(iter(report["domains"].values()))["variants"]))
    lines += [
        "",
        f"Acceptance rate by block position ({first}; 1 = first drafted token):",
        "",
        "| domain | " + " | ".join(str(j + 1) for j in range(15)) + " |",
        "|---" * 16 + "|",
    ]
    for d, r in report["domains"].items():
        acc = r["variants"][first]["accept_by_position"]
        lines.append(f"| {d} | " + " | ".join(f"{x:.2f}" if x is not None else "-" for x in acc) + " |")
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: Path) -> None:
    from adaflash.pipelines.plots import plot_acceptance

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "eval.md").write_text(markdown(report))
    plot_acceptance(report, out_dir / "accept_by_position.png")
