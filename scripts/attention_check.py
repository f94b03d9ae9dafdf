"""Target step time with one of our CPU kernels vs PyTorch's ops, in ONE process.

  python scripts/attention_check.py [--dtype bfloat16] [--switch attention|norm-rope]

Times `TargetModel.forward_packed` (SmolLM2, random token ids) alternately with the kernel
(kernels/attention_cpu.py, or kernels/norm_rope_cpu.py with --switch norm-rope) and with PyTorch's ops
(ADAFLASH_ATTENTION=torch, ADAFLASH_KERNELS=torch) on the same caches, for decode-like
steps: R requests with C context tokens each, each bringing its own number of new tokens. Prints a
Markdown table (median of 7 steps per side). Losslessness is checked with `adaflash generate --json`
and `scripts/quant_check.py compare` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

SWITCHES = {"attention": "ADAFLASH_ATTENTION", "norm-rope": "ADAFLASH_KERNELS"}  # the variable that selects PyTorch's ops
CASES = [  # (requests, context tokens, new tokens per request)
    (1, 300, [1]),
    (1, 300, [8]),
    (1, 800, [1]),
    (1, 800, [16]),
    (8, 300, [1] * 8),
    (8, 300, [4] * 8),
    (32, 300, [1] * 32),
    (32, 300, [1] * 24 + [3] * 8),
    (32, 300, [4] * 32),
    (32, 800, [1] * 32),
    (32, 150, [2, 3, 4, 5] * 8),
]


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "q4"])
    ap.add_argument("--switch", default="attention", choices=list(SWITCHES), help="which kernel is compared with PyTorch's ops")
    args = ap.parse_args()
    var = SWITCHES[args.switch]
    from adaflash.kernels import attention_cpu

    from adaflash.target import load_target

    if not attention_cpu.available():
        raise SystemExit("the attention kernel did not build here (see the warning above)")
    model = load_target("smollm2", args.dtype).model
    print(f"{args.dtype}, {torch.get_num_threads()} threads, {args.switch} kernel\n")
    print("| requests | context | new tokens (sum / max) | PyTorch ms | kernel ms | kernel / PyTorch |")
    print("|---|---|---|---|---|---|")
    for rows, ctx, lens in CASES:
        caches = [model.new_cache(1, 1024) for _ in range(rows)]
        model.forward_packed([torch.randint(0, model.config.vocab_size, (ctx,)) for _ in range(rows)], caches, logits_last_only=True)
        toks = [torch.randint(0, model.config.vocab_size, (n,)) for n in lens]
        times = {"torch": [], "auto": []}
        for rep in range(8):
            for mode, ts in times.items():
                os.environ[var] = mode
                t0 = time.perf_counter()
                model.forward_packed(toks, caches)
                if rep:  # the first round warms up
                    ts.append(time.perf_counter() - t0)
                for c in caches:
                    c.crop(ctx)
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"| {rows} | {ctx} | {sum(lens)} / {max(lens)} | {ms['torch']:.1f} | {ms['auto']:.1f} | {ms['auto'] / ms['torch']:.2f} |")
        del caches
    os.environ.pop(var)


if __name__ == "__main__":
    main()
