"""The machine's limits and how close a decoding method gets to them (`adaflash bench`'s roofline).

`machine_limits` measures, with the bench's own torch threads and dtype, the matmul rate (a large
square GEMM) and the memory bandwidth (a large copy). `step_fraction` says, for one engine step that
verifies `tokens` tokens, how long the step would take at those limits: the target's linear layers
cost 2 x parameters FLOPs per token and read every weight once per step (plus the LM head over the
vocabulary), the larger of compute time and weight-read time is the limit; the achieved fraction is
that limit over the measured step time. Attention and the drafter are left out, so the fraction is an
upper bound on how much of the machine the target's matmuls use.
"""

from __future__ import annotations

import time

import torch


def _best_of(fn, repeats: int = 5) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def machine_limits(dtype: torch.dtype = torch.float32, n: int = 1536, mib: int = 256) -> dict:
    """-> {"gflops": matmul GFLOP/s, "gbps": memory GB/s (read + write of a copy)} on this CPU now."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    t_mm = _best_of(lambda: torch.mm(a, b))
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    t_copy = _best_of(lambda: dst.copy_(src))
    return {"gflops": 2 * n**3 / t_mm / 1e9, "gbps": 2 * src.numel() * 4 / t_copy / 1e9}


def target_costs(model) -> dict:
    """FLOPs per verified token and bytes read per step of the target's linear layers, LM head included
    (a tied embedding counts once, as the LM head); a quantised projection reads its packed weight
    and scales (adaflash.quant)."""
    from adaflash.quant import Int4Linear, Int8Linear

    layers = {}  # one entry per weight: (parameters, bytes read)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            layers[id(m.weight)] = (m.weight.numel(), m.weight.numel() * m.weight.element_size())
        elif isinstance(m, (Int4Linear, Int8Linear)):
            layers[id(m)] = (m.in_features * m.out_features, sum(b.numel() * b.element_size() for b in m.buffers()))
    return {"flops_per_token": 2 * sum(n for n, _ in layers.values()), "bytes_per_step": sum(b for _, b in layers.values())}


def step_fraction(tokens_per_step: float, step_s: float, costs: dict, limits: dict) -> float:
    """Achieved fraction of the machine's limit for one step verifying `tokens_per_step` tokens in `step_s`."""
    t_compute = tokens_per_step * costs["flops_per_token"] / (limits["gflops"] * 1e9)
    t_memory = costs["bytes_per_step"] / (limits["gbps"] * 1e9)
    return max(t_compute, t_memory) / step_s
