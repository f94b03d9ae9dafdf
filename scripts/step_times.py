"""Target step times at concurrency 32 for one source tree: 32 requests on 150 tokens of context verifying
N = 1, 2, 4, 8 new tokens each, and the prefill of 32 GSM8K eval prompts (bfloat16, SmolLM2).

  python scripts/step_times.py [TREE]

TREE: a directory laid out as the installed package (adaflash/ with its kernels/, pipelines/, ... inside;
default: the installed project). To compare two commits, lay the older one out that way and run both trees
alternately: `git worktree add /tmp/old REV`, then copy /tmp/old/adaflash to /tmp/oldpkg/adaflash and each
entry of pyproject's [tool.setuptools.package-dir] (kernels -> adaflash/kernels, ...) beside it.
Prints one line of medians (8 steps; 3 prefills) in ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree", nargs="?", default=None, help="a package tree to import adaflash from (default: the installed one)")
    ap.add_argument("--prompt-sets", default="runs/prompt-sets", help="built prompt sets (eval.parquet)")
    args = ap.parse_args()
    prompt_sets = Path(args.prompt_sets).resolve()
    if args.tree:
        sys.path.insert(0, str(Path(args.tree).resolve()))
    import torch
    from adaflash.pipelines.prompts import read_prompts

    from adaflash import layers
    from adaflash.target import load_target

    target = load_target("smollm2", "bfloat16")
    model = target.model
    layers.prepack(model)
    torch.manual_seed(0)
    out, ctx = {}, 150
    for per in (1, 2, 4, 8):
        caches = [model.new_cache(1, ctx + 200) for _ in range(32)]
        model.forward_packed([torch.randint(0, 49000, (ctx,)) for _ in range(32)], caches, logits_last_only=True)
        times = []
        for _ in range(8):
            tokens = [torch.randint(0, 49000, (per,)) for _ in range(32)]
            t0 = time.perf_counter()
            model.forward_packed(tokens, caches)
            times.append(time.perf_counter() - t0)
            for c in caches:
                c.crop(ctx)
        out[str(per)] = statistics.median(times) * 1e3
    prompts = [torch.tensor(target.encode_chat(r.messages)) for r in read_prompts(prompt_sets / "eval.parquet", ["gsm8k"], 32)]
    times = []
    for _ in range(3):
        caches = [model.new_cache(1, 300) for _ in prompts]
        t0 = time.perf_counter()
        model.forward_packed(prompts, caches, logits_last_only=True)
        times.append(time.perf_counter() - t0)
        del caches
    out["prefill"] = statistics.median(times) * 1e3
    print(args.tree or "installed", " ".join(f"{k}:{v:.1f}" for k, v in out.items()))


if __name__ == "__main__":
    main()
