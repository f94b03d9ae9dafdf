"""The CPU RMSNorm and rotary kernels (kernels/norm_rope_cpu.py) against plain PyTorch, and where `layers`
uses them: CPU inference only, PyTorch's ops under autograd."""

from __future__ import annotations

import pytest
import torch
from adaflash.kernels import norm_rope_cpu

from adaflash.layers import RMSNorm, Rotary, apply_rotary, rotary_heads

pytestmark = pytest.mark.skipif(norm_rope_cpu.load() is None, reason="the C++ kernels did not build here (no compiler)")


def plain_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.double()
    return (w.double() * (xf / (xf.pow(2).mean(-1, keepdim=True) + eps).sqrt()).to(x.dtype).double()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 576, 40])
def test_rms_norm_matches_plain_pytorch_and_rows_are_their_own(dtype, dim):
    torch.manual_seed(dim)
    x = (torch.randn(3, 5, dim) * torch.logspace(-3, 2, 5)[:, None]).to(dtype)  # [3, 5, D] rows of any scale
    w = (torch.rand(dim) + 0.5).to(dtype)
    y = norm_rope_cpu.load().rms_norm(x, w, 1e-5)
    ref = plain_rms_norm(x, w, 1e-5)
    ulp = 2**-23 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(y.float(), ref.float(), atol=0, rtol=4 * ulp)  # a rounding or two from exact
    alone = torch.stack([norm_rope_cpu.load().rms_norm(x[i, j : j + 1], w, 1e-5)[0] for i in range(3) for j in range(5)])
    assert torch.equal(alone.view_as(y), y)
    assert norm_rope_cpu.load().rms_norm(x[:0], w, 1e-5).shape == (0, 5, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch_cos", [1, 2])
def test_rope_gives_pytorchs_bits(dtype, batch_cos):
    torch.manual_seed(batch_cos)
    rot = Rotary(64, 10000.0)
    cos, sin = rot(torch.randint(0, 4000, (batch_cos, 6)), dtype)  # [Bc, 1, 6, 64]
    x = torch.randn(2, 6, 9, 64).to(dtype)  # [B, T, H, D]
    with torch.no_grad():
        out = rotary_heads(x, cos, sin)  # the kernel
    assert out.shape == (2, 9, 6, 64)
    assert torch.equal(out, apply_rotary(x.transpose(1, 2), cos, sin))
    with pytest.raises(RuntimeError, match="cos and sin"):
        norm_rope_cpu.load().rope(x, cos[..., :32], sin[..., :32])


def test_layers_use_the_kernels_for_inference_only(monkeypatch):
    norm = RMSNorm(64)
    x = torch.randn(4, 64, requires_grad=True)
    y = norm(x)  # autograd: PyTorch's ops
    y.sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
    calls = []
    monkeypatch.setattr(norm_rope_cpu, "load", lambda real=norm_rope_cpu.load: calls.append(1) or real())
    with torch.no_grad():
        torch.testing.assert_close(norm(x), y, atol=1e-6, rtol=1e-6)
    assert calls
    monkeypatch.undo()
    monkeypatch.setenv("ADAFLASH_KERNELS", "torch")
    assert norm_rope_cpu.load() is None and norm_rope_cpu.kernel(x.detach()) is None
