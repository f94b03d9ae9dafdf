"""Single-request evaluation: plain decoding vs DFlash, side by side on the same prompts.

For every prompt both methods run back to back (interleaved, so machine noise hits both alike);
greedy outputs are checked token for token. Reports tau, acceptance by block position and the
wall-clock speedup per domain.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from tqdm import tqdm

from adaflash.drafter import Drafter
from adaflash.generate import generate_ar, generate_dflash
from adaflash.target import Target


def evaluate(target: Target, drafter: Drafter, records: list, max_new_tokens: int, verify_len: int | None = None) -> dict:
    per_domain: dict[str, list] = {}
    for rec in tqdm(records, desc="eval", unit="prompt"):
        ids = target.encode_chat(rec.messages)
        ar = generate_ar(target.model, ids, max_new_tokens, target.eos_ids)
        sd = generate_dflash(target.model, drafter, ids, max_new_tokens, target.eos_ids, verify_len=verify_len)
        per_domain.setdefault(rec.domain, []).append((rec.prompt_id, ar, sd))
    report = {"max_new_tokens": max_new_tokens, "domains": {}}
    for domain, runs in per_domain.items():
        ar_tok = sum(len(a.output_ids) for _, a, _ in runs)
        sd_tok = sum(len(s.output_ids) for _, _, s in runs)
        ar_s = sum(a.wall_s for _, a, _ in runs)
        sd_s = sum(s.wall_s for _, _, s in runs)
        drafted = [sum(s.drafted_at[j] for _, _, s in runs) for j in range(drafter.block_size - 1)]
        accepted = [sum(s.accepted_at[j] for _, _, s in runs) for j in range(drafter.block_size - 1)]
        report["domains"][domain] = {
            "prompts": len(runs),
            "identical_greedy": sum(a.output_ids == s.output_ids for _, a, s in runs),
            "tau": sum(s.committed for _, _, s in runs) / max(1, sum(s.rounds for _, _, s in runs)),
            "tau_median_prompt": statistics.median(s.tau for _, _, s in runs),
            "ar_tokens_per_s": ar_tok / ar_s,
            "dflash_tokens_per_s": sd_tok / sd_s,
            "speedup": (sd_tok / sd_s) / (ar_tok / ar_s),
            "accept_by_position": [round(a / d, 3) if d else None for a, d in zip(accepted, drafted)],
            "mismatched_prompts": [pid for pid, a, s in runs if a.output_ids != s.output_ids],
        }
    return report


def markdown(report: dict) -> str:
    lines = ["| domain | prompts | identical greedy | tau | AR tok/s | DFlash tok/s | speedup |",
             "|---|---|---|---|---|---|---|"]
    for d, r in report["domains"].items():
        lines.append(f"| {d} | {r['prompts']} | {r['identical_greedy']}/{r['prompts']} | {r['tau']:.2f} | "
                     f"{r['ar_tokens_per_s']:.1f} | {r['dflash_tokens_per_s']:.1f} | {r['speedup']:.2f}x |")
    lines += ["", "Acceptance rate by block position (1 = first drafted token):", "",
              "| domain | " + " | ".join(str(j + 1) for j in range(15)) + " |", "|---" * 16 + "|"]
    for d, r in report["domains"].items():
        lines.append(f"| {d} | " + " | ".join(f"{x:.2f}" if x is not None else "-" for x in r["accept_by_position"]) + " |")
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "eval.md").write_text(markdown(report))
