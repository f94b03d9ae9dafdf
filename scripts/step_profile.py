"""Target step time, before and after the KV pool (issue 21 item 1), in ONE process.

  python scripts/step_profile.py [--before b31d41c] [--dtype float32]

Takes `TargetModel.forward_packed` as it was at git revision --before (per-request attention over
per-request caches; it runs unchanged on the pool's per-request views) and the current one, and
times both alternately on the same caches (SmolLM2, random token ids) for decode-like steps:
R requests with contexts of C tokens, each verifying its own number of new tokens. Prints a
Markdown table (median of 6 steps per side).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import textwrap
import time

import torch

CONFIGS = [  # (context tokens, new tokens per request)
    (100, [1] * 32),
    (100, [4] * 32),
    (300, [1] * 32),
    (300, [1, 2, 4, 8, 16, 3, 5, 1] * 4),
    (600, [1, 2, 4, 8, 16, 3, 5, 1] * 4),
    (300, [4] * 8),
    (300, [1]),
    (300, [6]),
]


def old_forward_packed(rev: str):
    """The method's source at `rev`, compiled as a plain function of (model, tokens, caches)."""
    src = subprocess.run(["git", "show", f"{rev}:adaflash/target.py"], check=True, capture_output=True, text=True).stdout
    body = re.search(r"    @torch\.no_grad\(\)\n    def forward_packed\(.*?(?=\n\n\n|\n@dataclass)", src, re.S).group(0)
    ns = {"torch": torch}
    exec("from __future__ import annotations\n" + textwrap.dedent(body), ns)  # noqa: S102 - our own git history
    return ns["forward_packed"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="b31d41c", help="git revision with the per-request attention")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    from adaflash.target import load_target

    old = old_forward_packed(args.before)
    model = load_target("smollm2", dtype=args.dtype).model
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, dtype {args.dtype}; ms per target step, median of 6")
    print("| requests | context | new tokens (sum / max) | before | after | before / after |")
    print("|---|---|---|---|---|---|")
    for ctx, lens in CONFIGS:
        caches = [model.new_cache(1, ctx + 40) for _ in lens]
        model.forward_packed([torch.randint(0, 49000, (ctx + i,)) for i in range(len(lens))], caches, logits_last_only=True)
        times = {"before": [], "after": []}
        for rep in range(12):
            side = ("before", "after")[rep % 2]
            toks = [torch.randint(0, 49000, (n,)) for n in lens]
            lengths = [c.length for c in caches]
            t0 = time.perf_counter()
            old(model, toks, caches) if side == "before" else model.forward_packed(toks, caches)
            times[side].append(time.perf_counter() - t0)
            for c, n in zip(caches, lengths):
                c.crop(n)
        b, a = (1e3 * statistics.median(times[k]) for k in ("before", "after"))
        print(f"| {len(lens)} | {ctx} | {sum(lens)} / {max(lens)} | {b:.0f} | {a:.0f} | {b / a:.2f}x |", flush=True)
        del caches


if __name__ == "__main__":
    main()
