"""The AMX bfloat16 matmul (kernels/amx_cpu.cpp) against plain PyTorch, and its row invariance.

Runs where the CPU has AMX (Sapphire Rapids and later); elsewhere `Linear` keeps oneDNN and these skip.
"""

import pytest
import torch
from adaflash.kernels import amx_cpu

from adaflash.layers import Linear, pack_weight

pytestmark = pytest.mark.skipif(not amx_cpu.available(), reason="no AMX on this CPU (or the kernel did not build)")

SHAPES = [(576, 576), (960, 576), (576, 1536), (3072, 576), (48, 64), (16, 32)]  # (N, K): SmolLM2's and the smallest tiles


@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_plain_pytorch(n, k):
    """float32 sums of bfloat16 products rounded to bfloat16 once: the kernel differs from PyTorch's
    float32 matmul only in the order of those sums, i.e. in the last bit of a few outputs."""
    torch.manual_seed(0)
    w, x = (torch.randn(n, k) / 8).bfloat16(), torch.randn(77, k).bfloat16()
    out, ref = amx_cpu.Packed(w)(x), amx_cpu.reference(x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (77, n)
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-3, rtol=2**-7)  # one bf16 ulp (atol: sums that cancel)
    assert (out != ref).float().mean() < 0.01


def test_a_row_has_the_same_bits_in_any_call_and_thread_count():
    """What verification's losslessness rests on: a row's output does not depend on how many rows share
    the call (1 .. 300, across the 256-row chunks), where it falls in a tile, or the thread count."""
    torch.manual_seed(1)
    w, x = torch.randn(3072, 576).bfloat16(), torch.randn(300, 576).bfloat16()
    p = amx_cpu.Packed(w)
    alone = torch.cat([p(x[i : i + 1]) for i in range(300)])
    assert torch.equal(p(x), alone)
    for rows in (2, 15, 17, 33, 100):
        assert torch.equal(torch.cat([p(x[i : i + rows]) for i in range(0, 300, rows)]), alone), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(p(x[5:45]), alone[5:45])
    finally:
        torch.set_num_threads(threads)


def test_linear_uses_it_for_bias_free_bfloat16_weights_only():
    """`Linear` packs a bias-free bfloat16 weight of whole tiles for the kernel, any other for oneDNN; a
    weight change (optimizer step, hot-swap) repacks."""
    torch.manual_seed(2)
    lin = Linear(64, 48, bias=False).bfloat16()
    x = torch.randn(40, 64).bfloat16()
    with torch.no_grad():
        assert isinstance(pack_weight(lin.weight), amx_cpu.Packed)
        assert torch.equal(lin(x), amx_cpu.Packed(lin.weight)(x))
        lin.weight.mul_(2)
        assert torch.equal(lin(x), amx_cpu.Packed(lin.weight)(x))
    w = torch.randn(48, 64)
    assert not isinstance(pack_weight(w.bfloat16(), torch.zeros(48).bfloat16()), amx_cpu.Packed)  # a bias
    assert not isinstance(pack_weight(w[:40].bfloat16()), amx_cpu.Packed)  # 40 outputs: not whole tiles
    assert not isinstance(pack_weight(w), amx_cpu.Packed)  # float32
