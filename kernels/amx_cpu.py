"""bfloat16 matmul on AMX tiles, row-invariant (amx_cpu.cpp), for CPU inference where the CPU has AMX.

Why: oneDNN's bfloat16 matmul on AMX sums a row in another order once a call has more than 32 rows, so
`layers.packed_mm` multiplied in 32-row calls and a verify step of 32 requests x 4 tokens read every
weight four times. This kernel's sums are one fixed sequence per output whatever the call's shape, so
one call takes every row of a step (and a prefill's every prompt) and a row's bits are its own: greedy
verification stays lossless against plain decoding through the same kernel.

Where the CPU has no AMX or no compiler builds it, `available()` is False and the caller keeps oneDNN.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from adaflash.kernels.cpu_build import build

SOURCE = Path(__file__).with_name("amx_cpu.cpp")
TILE = 16  # outputs per packed block
KSTEP = 32  # inputs per packed block


def load():
    """The compiled extension, or None where it cannot be built."""
    return build("amx_cpu", SOURCE, "bfloat16 matmuls use oneDNN in calls of at most 32 rows")


@functools.cache
def available() -> bool:
    """Whether bfloat16 matmuls can run here: a CPU with AMX, the kernel built with it, Linux's permission."""
    if not (torch.backends.mkldnn.is_available() and torch.cpu._is_amx_tile_supported()):
        return False
    ext = load()
    return ext is not None and bool(ext.enable())


def fits(weight: torch.Tensor) -> bool:
    """Whether a weight [N, K] has the kernel's shape (N in 16s, K in 32s) and dtype (bfloat16, CPU)."""
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and n % TILE == 0 and k % KSTEP == 0


class Packed:
    """A weight [N, K] in the kernel's tile layout: packed [N/16, K/32, 16, 32] (row r of a tile holds
    inputs 2r and 2r+1 of each of its 16 outputs side by side). Call it on x [M, K] -> [M, N]."""

    def __init__(self, weight: torch.Tensor):
        n, k = weight.shape
        w = weight.detach().contiguous().view(n // TILE, TILE, k // KSTEP, KSTEP // 2, 2)  # [nb, n, kb, r, pair]
        self.tiles = w.permute(0, 2, 3, 1, 4).reshape(n // TILE, k // KSTEP, TILE, 2 * TILE).contiguous()

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        return load().amx_linear(flat, self.tiles)  # the kernel makes flat contiguous where it is not


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in plain PyTorch (float32 sums of bfloat16 products, rounded to
    bfloat16 once): equal to the kernel's output up to the order of its float32 sums."""
    return (x.float() @ weight.float().T).to(torch.bfloat16)
