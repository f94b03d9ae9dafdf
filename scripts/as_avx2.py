"""Run an `adaflash` command as a CPU with AVX2 but no AVX-512 would run it, on a CPU that has AVX-512.

  python scripts/as_avx2.py bench --methods ar,fixed3-lookup --dtype q4 ...     (any adaflash subcommand)
  python scripts/as_avx2.py kernel                                              (the q4 kernel alone, ms)

PyTorch's own kernels (ATen), oneDNN and MKL are held to AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS, set here before torch loads), our C++ kernels are built for -march=haswell, and the
CPU flags the code reads to choose dtypes (`adaflash.target.cpu_flags`) lose AVX-512, AVX-VNNI and AMX. What
stays the machine's: its memory, caches and clock, so absolute speeds are not an AVX2 machine's; the ratios
between dtypes and methods of one run are what it is for (docs/benchmarks.md, q4 on AVX2). The `cost` policy's
step costs are measured and cached apart (their cache key holds ATen's vector code).
"""

from __future__ import annotations

import os
import sys
import time

os.environ.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2")

import adaflash.kernels.cpu_build as cpu_build  # noqa: E402
import torch  # noqa: E402
from adaflash.kernels import amx_cpu, attention_cpu, norm_rope_cpu, q4_cpu, stack_cpu  # noqa: E402

import adaflash.target as target  # noqa: E402

ARCH = "haswell"
_build, _flags = cpu_build.build, target.cpu_flags()


def build(name, source, fallback, arch=None):
    return _build(name, source, fallback, ARCH)


for module in (amx_cpu, attention_cpu, norm_rope_cpu, q4_cpu, stack_cpu):
    module.build = build
target.cpu_flags = lambda: {f for f in _flags if not f.startswith(("avx512", "avx_vnni", "amx"))}
torch.cpu._is_amx_tile_supported = lambda: False


def kernel() -> None:
    """The q4 kernel for SmolLM2's projection shapes and its LM head, as built here natively, for AVX2 and
    with no vector dot products (ms, median of 15), beside PyTorch's float32 matmul held to AVX2."""
    from adaflash.quant import q4_1_quantise

    builds = {
        "native": _build("q4_cpu", q4_cpu.SOURCE, "-"),
        "avx2": q4_cpu.load(),
        "portable": _build("q4_cpu", q4_cpu.SOURCE, "-", "x86-64-v2"),
    }
    print("builds:", {k: b.isa() for k, b in builds.items()})
    g = torch.Generator().manual_seed(0)
    for n, k in ((1536, 576), (576, 1536), (49152, 576)):
        w = torch.randn(n, k, generator=g) * 0.05
        packed, d, m = q4_cpu.pack(*q4_1_quantise(w))
        for rows in (1, 4, 16, 32):
            x = torch.randn(rows, k, generator=g)
            runs = {**{name: lambda b=b: b.q4_linear(x, packed, d, m) for name, b in builds.items()}, "float32": lambda: x @ w.T}
            out = []
            for name, fn in runs.items():
                fn()
                times = []
                for _ in range(15):
                    t = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t)
                out.append(f"{name} {sorted(times)[7] * 1e3:.3f}")
            print(f"{n}x{k}, {rows} rows: " + " | ".join(out))


if __name__ == "__main__":
    print(
        f"as AVX2: ATen {torch.backends.cpu.get_cpu_capability()}, q4 kernel {q4_cpu.load().isa()}, bfloat16 fast: {target.bf16_is_fast()}",
        file=sys.stderr,
    )
    if sys.argv[1:2] == ["kernel"]:
        kernel()
    else:
        from adaflash.cli import main

        sys.exit(main(sys.argv[1:]))
