"""Regeneration on a CPU: the serving engine's plain decoding vs padded batched decoding (issue 23 item 2).

    python -m adaflash.experiments.regen_speed --out runs/regen-speed --prompts 64 --max-new-tokens 128 --batch 32

The same prompts (the shortest of the training split's GSM8K, code and target-written chat and writing
prompts, in equal parts) answered greedily twice in one run, each with its features kept as the
`regenerate` stage stores them: by `Engine` with `keep_features` (what the stage runs on a CPU) and by
`answer_batch` in length-sorted batches of `--batch` (what it runs on a GPU). Reports tokens/s of each, the
ratio, and how many answers are token for token the same (in float32 all are, tests/test_pretrain.py; in
bfloat16 the two paths round differently and greedy answers part ways at near-ties).
Writes results.json into OUT.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from adaflash.pipelines.prompts import read_prompts
from adaflash.pipelines.regenerate import answer_batch, batches, regen_engine

from adaflash.request import Request
from adaflash.target import bf16_is_fast, load_target

DOMAINS = ("gsm8k", "code", "magpie_chat", "magpie_writing")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/regen-speed"))
    ap.add_argument("--prompt-sets", type=Path, default=Path("runs/prompt-sets"), help="built by `adaflash prompts` (train.parquet)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32, help="requests decoded together (engine) / padded batch size")
    ap.add_argument("--dtype", default="bfloat16" if bf16_is_fast() else "float32")
    args = ap.parse_args(argv)
    target = load_target("smollm2", args.dtype)
    records = read_prompts(args.prompt_sets / "train.parquet", list(DOMAINS), args.prompts // len(DOMAINS))
    chats = sorted((target.encode_chat(r.messages) for r in records), key=len)
    answer_batch(target, chats[:2], 4)  # warm both paths (kernel builds, first calls)
    regen_engine(target, 2, len(chats[0])).run([Request("warm", chats[0], 4)])

    t = time.perf_counter()
    states = regen_engine(target, args.batch, len(chats[-1])).run([Request(f"p{i}", c, args.max_new_tokens) for i, c in enumerate(chats)])
    engine_s = time.perf_counter() - t
    t = time.perf_counter()
    padded = []
    for lo, hi in batches([len(c) for c in chats], args.batch, None):
        padded += answer_batch(target, chats[lo:hi], args.max_new_tokens)
    padded_s = time.perf_counter() - t

    tok_e, tok_p = sum(len(s.out) for s in states), sum(len(r) for r, _, _ in padded)
    result = {
        "command": "python -m adaflash.experiments.regen_speed " + " ".join(sys.argv[1:] if argv is None else argv),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "prompts": len(chats),
        "max_new_tokens": args.max_new_tokens,
        "batch": args.batch,
        "engine": {"seconds": round(engine_s, 1), "tokens": tok_e, "tok_s": round(tok_e / engine_s, 1)},
        "padded": {"seconds": round(padded_s, 1), "tokens": tok_p, "tok_s": round(tok_p / padded_s, 1)},
        "speedup": round((tok_e / engine_s) / (tok_p / padded_s), 2),
        "identical_answers": sum(s.out == r for s, (r, _, _) in zip(states, padded)),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
