"""A model's decoder layers in one C++ call for CPU inference (stack_cpu.cpp `forward_layers`): bfloat16 weights
on AMX tiles, float32 weights through oneDNN, or q4 weights with bfloat16 or float32 activations; and a q4
drafter's context extension through its layers' k/v projections (`extend_layers`).

Why: the AMX matmuls and the attention kernel left a SmolLM2 step at concurrency 32 (one token per
request) with 13.5 ms of matmuls, 10 ms of attention and about 20 ms of Python and PyTorch dispatch
around them: some 700 small calls a step (norms, rotary, K/V writes, SwiGLU, residual adds, views).
The q4 target without AMX had the same overhead around its kernel: one token's forward 7.1 ms, 4.3 in
one call (docs/benchmarks.md). The C++ loop calls the same kernels and ATen ops in the same order, so its
bits are the Python loop's (tests/test_stack_kernel.py); it also lets go of the GIL while it runs.
`TargetModel.forward_packed` and `Drafter.draft_many` take it where every piece fits (`layers.stacked_layers`:
`DecoderLayer.stack_weights`, a pool in the activations' dtype on the attention kernel), `Drafter.extend_many`
`extend_layers` (`layers.stacked_kv`), and they keep the Python loop elsewhere (bfloat16
weights without AMX, GPUs, training, ADAFLASH_KERNELS=torch).
"""

from __future__ import annotations

import os
from pathlib import Path

from adaflash.kernels.cpu_build import build

SOURCE = Path(__file__).with_name("stack_cpu.cpp")


def load():
    """The compiled extension, or None: no compiler, or ADAFLASH_KERNELS=torch. (Its AMX form runs only where
    `amx_cpu.available()`: `stack_weights` gives AMX tiles only there.)"""
    if os.environ.get("ADAFLASH_KERNELS", "auto") == "torch":
        return None
    return build("stack_cpu", SOURCE, "the decoder layers run op by op from Python (same bits, more time per step)")
