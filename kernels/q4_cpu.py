"""Q4_1 (and Q8_0) weights times int8 activations on CPU (q4_cpu.cpp): the arithmetic llama.cpp uses for
a GGUF's Q4_1 projections and Q8_0 LM head, row-invariant, with AVX-512 VNNI integer dot products where
the CPU has them, AVX2's where it has those (`isa()` says which).

Why: PyTorch's int4 kernel (`_weight_int4pack_mm_for_cpu`) reads 4x fewer weight bytes than bfloat16
but does not scale with rows (it dequantises as it multiplies: at 16 rows slower than bfloat16), and a
verify step multiplies 4-16 rows. Here each 32-input weight group is unpacked once per 4 rows and
multiplied in integers with the rows' int8 inputs, so verifying a block costs little more than one
token. Each output is one fixed sequence of float operations over its groups, whatever the call's
shape: a token verified in a block gets the bits plain decoding gives it alone (greedy lossless).

Where no compiler builds it, `load()` returns None and `Q4Linear` refuses to be made (the dtype needs it).
"""

from __future__ import annotations

from pathlib import Path

import torch
from adaflash.kernels.cpu_build import build

SOURCE = Path(__file__).with_name("q4_cpu.cpp")
GROUP = 32  # inputs per weight group (Q4_1's block) and per activation scale
BLOCK = 16  # outputs per packed block


def load(arch: str | None = None):
    """The compiled extension, or None where it cannot be built; `arch`: for that -march (a test of the
    AVX2 path on a CPU with VNNI: "haswell")."""
    return build("q4_cpu", SOURCE, "the q4 target dtype is unavailable; use int4, bfloat16 or float32", arch)


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q uint8 [N, K] (0..15, or 0..255 with bits=8), d and m [N, K/32] (w = d*q + m) -> the kernel's
    (packed uint8 [N/16, K/32, 64 * bits], d float32 [N/16, K/32, 16], m likewise). N must be a multiple
    of 16, K of 32."""
    n, k = q.shape
    if n % BLOCK or k % GROUP or d.shape != (n, k // GROUP) or m.shape != d.shape or bits not in (4, 8):
        raise ValueError(
            f"q4 weights need outputs in 16s, inputs in 32s, one d, m per group and 4 or 8 bits: q {tuple(q.shape)}, "
            f"d {tuple(d.shape)}, bits {bits}"
        )
    g = k // GROUP
    if bits == 8:
        qb = q.to(torch.uint8).view(n // BLOCK, BLOCK, g, 8, 4)  # [nb, j, g, c, b]: input = 4 c + b
        packed = qb.permute(0, 2, 3, 1, 4).reshape(n // BLOCK, g, 512).contiguous()  # [nb, g, c * j * b]
    else:
        qb = q.to(torch.uint8).view(n // BLOCK, BLOCK, g, 2, 4, 4)  # [nb, j, g, half, c, b]: input = 16 half + 4 c + b
        qb = qb.permute(0, 2, 4, 1, 5, 3)  # [nb, g, c, j, b, half]
        packed = (qb[..., 0] | (qb[..., 1] << 4)).reshape(n // BLOCK, g, 256).contiguous()

    def per_block(s: torch.Tensor) -> torch.Tensor:
        return s.float().view(n // BLOCK, BLOCK, g).transpose(1, 2).contiguous()  # [nb, g, 16]

    return packed, per_block(d), per_block(m)


def q4_linear(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32 or bfloat16 -> [..., N] in x's dtype."""
    return load().q4_linear(x, packed, d, m)


def reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in plain PyTorch, for tests: x [M, K] float32, q [N, K], d, m [N, K/32]
    float32 -> [M, N] float32, the same float operations in the same order (bit-exact; q of 4 or 8 bits)."""
    rows, k = x.shape
    g = k // GROUP
    xg = x.view(rows, g, GROUP)
    step = xg.abs().amax(-1) / 127.0  # [M, G]
    inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    qx = torch.round(xg * inv[..., None]).clamp(-127, 127)  # [M, G, 32], round half to even like nearbyint
    sx = step * qx.sum(-1)  # [M, G]
    dots = torch.einsum("mgk,ngk->mng", qx.double(), q.double().view(-1, g, GROUP)).float()  # [M, N, G] exact integers
    acc = torch.zeros(rows, q.shape[0])
    for i in range(g):
        t = dots[:, :, i] * step[:, i : i + 1]
        acc = acc + d[:, i] * t
        acc = acc + m[:, i] * sx[:, i : i + 1]
    return acc
