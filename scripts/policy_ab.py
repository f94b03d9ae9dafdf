"""Where a verify policy loses against a fixed length: bench methods in lockstep, with seven diagnostic variants.

    python scripts/policy_ab.py --domain humaneval --concurrency 1 --requests 16 --methods fixed6,cost@fixed6,cost
    python scripts/policy_ab.py --domain code --concurrency 32 --requests 64 --methods ar,fixed3,cost,cost+fresh

Besides the bench's method names (`adaflash bench --help`):
  POLICY@fixedK   the policy does all its work (plans, lengths, labels, refits) but every request drafts a block of K
                  and verifies K tokens, as fixedK does: against fixedK, what the policy's own work costs; against
                  POLICY, what its choices cost
  POLICY@blockK   every request drafts a block of K (the plan's choice overridden), the policy picks the verify
                  lengths: against POLICY, what its plans (whether to draft, the block length) cost
  POLICY+slackN   the plans draft blocks N positions beyond their best instead of 1 (`CostPolicy.slack`) where
                  they read no recent rounds (see +prior)
  POLICY+prior    the plans as before session 56: the scan's drafting requests at its best block plus slack, from
                  the prior's mean acceptance alone, not priced over the requests' recent rounds (`CostPolicy._options`)
  POLICY+always   every request drafts every step (the plan's choice to draft overridden), the block and the verify
                  lengths the policy's: against POLICY, what its choices to skip drafting cost
  POLICY+whole    every request drafting again after plain steps priced as before session 57 (the margin kept): each drafter-cache
                  extension of a request that decoded plainly charged whole to the switch, not spread over its steps left
  POLICY+fresh    the policy on a step-cost calibration measured now instead of the cached one (`adaflash.cost`):
                  what a stale calibration costs
Variants combine (cost+prior+slack2; +fresh last). Each run builds fresh engines and runs them in lockstep
(`pipelines.bench.lockstep`, the bench's `--interleave`), each run after the first with the prompts in another order
(in one order runs differ by timing alone: `bench --shift`'s repeats, so served, probed the same requests at the
same steps), 48 new tokens a request, target float32, the committed drafter. Prints per run and method: tok/s of the
steady part, the ratio to the first method, drafts accepted per round, rounds undrafted, verify lengths, the blocks
drafted (`draft_len` calls: fixedK also calls it to verify, so its counts are doubled); then the mean ratios.
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
from pathlib import Path


def _as_fixed(policy, k: int, lengths_too: bool = True) -> None:
    """Let `policy` do all its work, then draft every request at a block of K (and verify K tokens, as fixedK does,
    where `lengths_too`)."""
    select, lengths = policy.select, policy.lengths

    def fixed_select(states, others=(0, 0)):
        select(states, others)
        policy._block = k
        return [True] * len(states)

    def fixed_lengths(states, hidden, k_blk, logits=None):
        _, preds = lengths(states, hidden, k_blk, logits)
        return [min(k, hidden.shape[1])] * len(states), preds

    policy.select = fixed_select
    if lengths_too:
        policy.lengths = fixed_lengths


class _Forgets(dict):
    """A `CostPolicy.recent` that keeps nothing: the plans see no recent rounds."""

    def __setitem__(self, key, value) -> None:
        pass


def _always_drafts(policy) -> None:
    """Let `policy` plan as usual, then draft every request (at the plan's block; where it drafted nobody, its last)."""
    select, last = policy.select, [policy.k_blk]

    def drafting(states, others=(0, 0)):
        if any(select(states, others)):
            last[0] = policy._block
        policy._block = last[0]
        return [True] * len(states)

    policy.select = drafting


def _switch_whole(policy) -> None:
    """Price the switch of a whole batch back to drafting with the plan's extension charges (idle requests' whole)."""
    charge = policy._extend_charge

    def whole(*args):
        charged, _ = charge(*args)
        return charged, charged

    policy._extend_charge = whole


def _count_blocks(policy) -> collections.Counter:
    """Count the block lengths the drafter runs (one `draft_len` call per drafting step)."""
    blocks, draft_len = collections.Counter(), policy.draft_len

    def counted(k_blk, head=None):
        b = draft_len(k_blk, head)
        blocks[b] += 1
        return b

    policy.draft_len = counted
    return blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--domain", default="humaneval", help="a prompt-set domain (mtbench and code read the train split)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--requests", type=int, default=16, help="requests a run (prompts repeated past 32)")
    ap.add_argument("--methods", default="fixed6,cost@fixed6,cost", help="comma-separated; ratios are to the first")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--prompt-sets", default="runs/prompt-sets", help="train/eval.parquet as `adaflash bench` builds them")
    args = ap.parse_args()

    from adaflash.pipelines.bench import BenchPrompt, bench_requests, lockstep, make_engine
    from adaflash.pipelines.prompts import read_prompts

    from adaflash.cost import calibrate
    from adaflash.drafter import DEFAULT_DRAFTER, load_drafter_and_head
    from adaflash.target import load_target

    methods = args.methods.split(",")
    split = "train" if args.domain in ("mtbench", "code") else "eval"
    target = load_target("smollm2", "float32")
    drafter, head = load_drafter_and_head(str(DEFAULT_DRAFTER), target, "auto")
    rows = read_prompts(Path(args.prompt_sets) / f"{split}.parquet", [args.domain], 32)
    prompts = [BenchPrompt(r.domain, target.encode_chat(r.messages)) for r in rows]
    prompts = [prompts[i % len(prompts)] for i in range(args.requests)]
    fresh = calibrate(target.model, drafter) if any(m.endswith("+fresh") for m in methods) else None
    ratios = collections.defaultdict(list)
    for run in range(args.runs):
        engines = {}
        for m in methods:
            name = m.removesuffix("+fresh")
            for flag in ("+prior", "+always", "+whole"):
                name = name.replace(flag, "")
            name, _, slack = name.partition("+slack")
            base, _, fixed = name.partition("@fixed")
            base, _, block = base.partition("@block")
            engines[m] = e = make_engine(base, target.model, drafter, head, args.concurrency, target.eos_ids, 512)
            if m.endswith("+fresh"):
                e.policy.cost = fresh
            if slack:
                e.policy.slack = int(slack)
            if "+whole" in m:
                _switch_whole(e.policy)
            if "+always" in m:
                _always_drafts(e.policy)
            if "+prior" in m:
                e.policy.recent = _Forgets()
            if fixed or block:
                _as_fixed(e.policy, int(fixed or block), lengths_too=bool(fixed))
        blocks = {m: _count_blocks(e.policy) for m, e in engines.items()}
        served = prompts if not run else random.Random(run).sample(prompts, len(prompts))  # another order each run after the first
        states, _, steady = lockstep(engines, {m: bench_requests(m, served, 48) for m in engines}, seed=run)
        rate = {m: steady[m][0] / steady[m][1] for m in methods}
        outs = {m: [s.out for s in states[m]] for m in methods}
        print(f"run {run} (greedy output equal: {all(o == outs[methods[0]] for o in outs.values())})")
        for m in methods:
            rounds = [rd for s in states[m] for rd in s.rounds]
            ratios[m].append(rate[m] / rate[methods[0]])
            lens = sorted(collections.Counter(rd.verify_len for rd in rounds).items())
            accepted, undrafted = sum(rd.accepted for rd in rounds) / len(rounds), sum(not rd.draft for rd in rounds) / len(rounds)
            print(
                f"  {m:14s} {rate[m]:7.1f} tok/s  {ratios[m][-1]:.4f}x  accepted/round {accepted:.2f}  undrafted {undrafted:.0%}"
                f"  verify lengths {lens}  blocks {sorted(blocks[m].items())}",
                flush=True,
            )
    print("mean ratios:", ", ".join(f"{m} {statistics.mean(v):.4f}x" for m, v in ratios.items()))


if __name__ == "__main__":
    main()
