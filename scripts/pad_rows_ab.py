"""Shuffled A/B of padding small oneDNN calls (docs/benchmarks.md, "Small oneDNN calls padded to four rows").

    python scripts/pad_rows_ab.py

Whole SmolLM2 forwards of 1, 2, 3, 4 and 8 tokens for one request after 200 tokens of context, float32 and
bfloat16, with `layers.PAD_ROWS, layers.MIN_ROWS` set to before (1, 2: one row through the 2-row path) and after
(2, 4: 1-2 rows padded to 4), the settings in a shuffled order, median of 10 (each a mean of 4 forwards).
"""

import random
import statistics
import time

import torch

import adaflash.layers as layers
from adaflash.target import load_target

SETTINGS = {"before": (1, 2), "after": (2, 4)}  # (PAD_ROWS, MIN_ROWS)
for dtype in ("float32", "bfloat16"):
    m = load_target("smollm2", dtype).model
    cache = m.new_cache(1, 1024)
    m.forward_packed([torch.randint(100, 1000, (200,))], [cache], logits_last_only=True)  # 200 tokens of context
    order = [(k, n) for k in SETTINGS for n in (1, 2, 3, 4, 8)] * 10
    random.Random(0).shuffle(order)
    ms = {}
    for k, n in order:
        layers.PAD_ROWS, layers.MIN_ROWS = SETTINGS[k]
        t = time.perf_counter()
        for _ in range(4):
            m.forward_packed([torch.randint(100, 1000, (n,))], [cache])
            cache.crop(200)
        ms.setdefault((k, n), []).append((time.perf_counter() - t) / 4 * 1e3)
    for k in SETTINGS:
        print(dtype, k, {n: round(statistics.median(ms[k, n]), 1) for n in (1, 2, 3, 4, 8)})
