"""Measured target forwards at a given context vs what the cost policy's step-cost model predicts.

  python scripts/step_cost_check.py [CONTEXT]      (default 300 tokens of context per request)

Times `TargetModel.forward_packed` (SmolLM2 float32, random token ids, the best of 5 sweeps) for layouts of
new tokens per request: one request verifying 1-17 tokens, and 8 requests with extra tokens on some of them,
each request after CONTEXT tokens of context. Prints each beside `StepCost.verify(R, N, QK)` from the cached (or a
fresh) calibration (adaflash/cost.py), timed at 32 and LONG_CONTEXT tokens of context, with and without its
attention term QK (the model before 2026-12-03 had none).
"""

from __future__ import annotations

import sys
import time

import torch

from adaflash.cost import attention_pairs, load_or_calibrate
from adaflash.drafter import DEFAULT_DRAFTER, load_drafter
from adaflash.target import load_target

LAYOUTS = {  # name -> new tokens per request
    "1x1": [1],
    "1x2": [2],
    "1x4": [4],
    "1x9": [9],
    "1x17": [17],
    "8x1": [1] * 8,
    "8: one +1": [2] + [1] * 7,
    "8: one +3": [4] + [1] * 7,
    "8: three +1": [2, 2, 2] + [1] * 5,
    "8: two 8": [8, 8] + [1] * 6,
    "8x2": [2] * 8,
    "8: one +15": [16] + [1] * 7,
}


@torch.no_grad()
def main() -> None:
    ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    t = load_target("smollm2", "float32")
    cost = load_or_calibrate(t.model, load_drafter(DEFAULT_DRAFTER, t.model, t.identity, torch.float32))
    m, vocab, g = t.model, t.model.config.vocab_size, torch.Generator().manual_seed(0)
    caches = [m.new_cache(1, ctx + 64) for _ in range(8)]
    m.forward_packed([torch.randint(0, vocab, (ctx,), generator=g) for _ in range(8)], caches, logits_last_only=True)

    def run(lay: list[int]) -> float:
        toks = [torch.randint(0, vocab, (n,), generator=g) for n in lay]
        t0 = time.perf_counter()
        m.forward_packed(toks, caches[: len(lay)])
        dt = time.perf_counter() - t0
        for c, n in zip(caches, lay):
            c.crop(c.length - n)
        return dt

    for lay in LAYOUTS.values():  # warm-up
        run(lay)
    best = {k: float("inf") for k in LAYOUTS}
    for _ in range(5):
        for k, lay in LAYOUTS.items():
            best[k] = min(best[k], run(lay))
    print(f"| layout | requests | tokens | measured ms (context {ctx}) | model ms | its attention term ms |\n|---|---|---|---|---|---|")
    for k, lay in LAYOUTS.items():
        qk = attention_pairs(lay, [ctx] * len(lay))
        model = cost.verify(len(lay), sum(lay), qk)
        print(f"| {k} | {len(lay)} | {sum(lay)} | {best[k] * 1e3:.1f} | {model * 1e3:.1f} | {cost.per_pair * qk * 1e3:.1f} |")


if __name__ == "__main__":
    main()
