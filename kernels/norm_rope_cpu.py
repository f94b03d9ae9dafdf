"""RMSNorm and rotary embeddings in one C++ call each for CPU inference (norm_rope_cpu.cpp).

Why: at one or a few rows per step, PyTorch's 8 small ops per RMSNorm and 7 per rotary embedding (61 and
60 per SmolLM2 step) cost more in dispatch than in arithmetic. The rotary kernel rounds after each op as
PyTorch's does (same bits); the norm sums squares in its own fixed order (within an ulp of PyTorch's).
Both are per row, so a row's result does not depend on the call. `layers` uses them for CPU inference
(no autograd) when they build, and PyTorch's ops otherwise (training, GPUs, no compiler, or
ADAFLASH_KERNELS=torch).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from adaflash.kernels.cpu_build import build

SOURCE = Path(__file__).with_name("norm_rope_cpu.cpp")


def load():
    """The compiled extension, or None (no compiler, or ADAFLASH_KERNELS=torch)."""
    if os.environ.get("ADAFLASH_KERNELS", "auto") == "torch":
        return None
    return build("norm_rope_cpu", SOURCE, "using PyTorch's RMSNorm and rotary ops (same results, more time per step)")


def kernel(x: torch.Tensor, *others: torch.Tensor):
    """The extension where it takes this call (CPU inference without autograd, float32 or bfloat16
    tensors of one dtype), else None (PyTorch's ops)."""
    if torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    return load() if all(o.dtype == x.dtype for o in others) else None
