"""Single-request evaluation: plain decoding vs DFlash, side by side on the same prompts.

Every method runs through the engine at batch 1 (`single_request_engine`, what `adaflash generate`
runs). For every prompt plain decoding and each DFlash variant run back to back (interleaved, so
machine noise hits all alike); greedy outputs are checked token for token. Variants: chains (verify
lengths) and greedy token trees (`trees`, node counts; each also with a prompt-lookup branch of every
length in `lookup` > 0). Reports tau, acceptance by block position (a tree's: along the path its
verification walked) and the wall-clock speedup per domain. The pretraining pipeline's `eval` stage
and `adaflash eval --drafter DIR` both run `run_eval`; its `gate` stage (pipelines/gate.py) runs two
drafters side by side in one `evaluate`.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from adaflash.buffer import Round
from adaflash.drafter import Drafter
from adaflash.engine import single_request_engine
from adaflash.target import Target


@dataclass
class EvalSection:
    domains: list[str] = field(default_factory=lambda: ["gsm8k", "humaneval", "aime"])
    per_domain: int = 16
    max_new_tokens: int = 128
    verify_lens: list[int] = field(default_factory=lambda: [16])  # tokens verified per round, anchor included
    trees: list[int] = field(default_factory=list)  # greedy token trees to compare, by node count (spec.build_tree)
    lookup: list[int] = field(default_factory=lambda: [0])  # each tree also with a prompt-lookup branch of these lengths (0 = none)
    drafter_dtype: str = "auto"  # q4 or bf16 where fast (drafter.resolve_drafter_dtype): drafts need not be exact, verification is

    def __post_init__(self):
        if not self.verify_lens and not self.trees:
            raise ValueError("eval needs at least one of verify_lens (chains) or trees")
        if any(v < 1 for v in self.verify_lens) or any(n < 1 for n in self.trees):
            raise ValueError("eval.verify_lens and eval.trees must be >= 1")
        if not self.lookup or any(n < 0 for n in self.lookup):
            raise ValueError("eval.lookup lists prompt-lookup branch lengths >= 0 for the trees (0 = none), e.g. [0, 8]")
        if self.per_domain < 1 or self.max_new_tokens < 1:
            raise ValueError(f"eval.per_domain and eval.max_new_tokens must be >= 1, got {self.per_domain} and {self.max_new_tokens}")


def variants_of(verify_lens: list[int], trees: list[int], lookup: list[int] = (0,)) -> dict[str, dict]:
    """DFlash variants by name -> single_request_engine keyword arguments: chains (verify lengths), then
    trees (`dflash-treeN`, and `dflash-treeN-lookupL` for every lookup length L > 0)."""
    out = {f"dflash-v{v}": {"verify_len": v} for v in verify_lens}
    for n in trees:
        out.update({f"dflash-tree{n}" + (f"-lookup{lk}" if lk else ""): {"tree": n, **({"lookup": lk} if lk else {})} for lk in lookup})
    return out


def acceptance(rounds: list[Round], k: int) -> tuple[list[int], list[int]]:
    """Rounds -> (drafted [k], accepted [k]): how many rounds verified, and accepted, block position j + 1."""
    drafted, accepted = [0] * k, [0] * k
    for r in rounds:
        for j in range(min(len(r.draft), k)):
            drafted[j] += 1
            accepted[j] += j < r.accepted
    return drafted, accepted


def evaluate(
    target: Target,
    drafters: dict[str, Drafter],
    records: list,
    max_new_tokens: int,
    verify_lens: list[int],
    trees: list[int] = (),
    lookup: list[int] = (0,),
) -> dict:
    """-> {"domains": {domain: {"ar_tokens_per_s", "variants": {"dflash-v16": {...}, "dflash-tree8": ...}}}}.
    `drafters` by label: label "" names its variants as above; several drafters (the pretraining gate's
    current and candidate) run on the same prompts in the same run, as "current/dflash-v16", ...."""
    variants = {
        f"{label}/{name}" if label else name: (drafter, kw)
        for label, drafter in drafters.items()
        for name, kw in variants_of(verify_lens, list(trees), list(lookup)).items()
    }
    plain = single_request_engine(target.model, None, target.eos_ids)
    engines = {name: single_request_engine(target.model, d, target.eos_ids, **kw) for name, (d, kw) in variants.items()}
    runs: dict[str, list] = {}
    for rec in tqdm(records, desc="eval", unit="prompt"):
        ids = target.encode_chat(rec.messages)
        ar = plain.generate(ids, max_new_tokens)
        sds = {name: engine.generate(ids, max_new_tokens) for name, engine in engines.items()}
        runs.setdefault(rec.domain, []).append((rec.prompt_id, ar, sds))
    report = {"max_new_tokens": max_new_tokens, "verify_lens": verify_lens, "trees": list(trees), "lookup": list(lookup), "domains": {}}
    for domain, rows in runs.items():
        ar_tps = sum(len(a.out) for _, a, _ in rows) / sum(a.wall_s for _, a, _ in rows)
        out = {}
        for name, (d, kw) in variants.items():
            sd = [s[name] for _, _, s in rows]
            tps = sum(len(s.out) for s in sd) / sum(s.wall_s for s in sd)
            drafted, accepted = acceptance([r for s in sd for r in s.rounds], d.block_size - 1)
            rounds = max(1, sum(len(s.rounds) for s in sd))
            out[name] = {
                **kw,
                "identical_greedy": sum(a.out == s[name].out for _, a, s in rows),
                "tau": sum(len(s.out) - 1 for s in sd) / rounds,
                "tau_median_prompt": statistics.median(s.tau for s in sd),
                "tokens_per_s": tps,
                "speedup": tps / ar_tps,
                "accept_by_position": [round(a / d, 3) if d else None for a, d in zip(accepted, drafted)],
                # share of all rounds that accepted at least j drafts: comparable between chains and trees
                # (a tree's per-position rate above is conditioned on its walk reaching that position)
                "accepted_at_least": [round(a / rounds, 3) for a in accepted],
                "mismatched_prompts": [pid for pid, a, s in rows if a.out != s[name].out],
            }
        report["domains"][domain] = {
            "prompts": len(rows),
            "tokens": sum(len(a.out) for _, a, _ in rows),
            "ar_tokens_per_s": ar_tps,
            "variants": out,
        }
    return report


def run_eval(
    cfg: EvalSection, drafter_dir: str | Path, prompts_dir: str | Path, out_dir: str | Path, target: str = "smollm2", dtype: str = "float32"
) -> dict:
    """Evaluate the drafter in `drafter_dir` (AdaFlash's format or DFlash's) on the eval split in
    `prompts_dir` (built there if missing) against `target`; writes eval.json, eval.md and the
    acceptance plot into `out_dir` and returns the report."""
    from adaflash.pipelines.prompts import available_domains, build_prompt_sets, read_prompts

    from adaflash.drafter import load_drafter
    from adaflash.target import load_target

    split = Path(prompts_dir) / "eval.parquet"
    if not split.exists():
        build_prompt_sets(Path(prompts_dir), available_domains())
    tgt = load_target(target, dtype)
    drafter = load_drafter(drafter_dir, tgt.model, tgt.identity, cfg.drafter_dtype)
    records = read_prompts(split, cfg.domains, cfg.per_domain)
    report = evaluate(tgt, {"": drafter}, records, cfg.max_new_tokens, cfg.verify_lens, cfg.trees, cfg.lookup)
    write_report(report, Path(out_dir))
    return report


def eval_command(args) -> int:
    """`adaflash eval`: the single-request eval of any drafter directory, report into --out."""
    cfg = EvalSection(args.domains, args.per_domain, args.max_new_tokens, args.verify_lens, args.trees, args.lookup, args.drafter_dtype)
    report = run_eval(cfg, args.drafter, args.prompt_sets, args.out, args.target, args.dtype)
    print(markdown(report))
    print(f"[eval] {Path(args.out) / 'eval.json'}, eval.md, accept_by_position.png")
    return 0


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
