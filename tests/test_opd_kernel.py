"""Fused Triton OPD kernel vs the PyTorch path, run on CPU through the Triton interpreter (fp32).

TRITON_INTERPRET=1 is set before triton and the kernels are imported (Triton fixes interpreted vs
compiled mode when a kernel is decorated, and its interpreter also reads the variable at launch).
Outside this module's tests the variable is put back as it was, so the rest of the test session
does not silently route ``backend="auto"`` through the slow interpreter.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton")
    from adaflash.kernels import _opd_triton

    if not _opd_triton.INTERPRETED:  # imported earlier in compiled mode: re-decorate for the interpreter
        _opd_triton = importlib.reload(_opd_triton)
finally:
    if _PREV_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREV_INTERPRET

from adaflash.kernels.opd import fused_opd_terms, opd_terms  # noqa: E402

from adaflash.losses import opd_loss, opd_row_terms  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _interpret_env():
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if _PREV_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREV_INTERPRET


TOL = dict(rtol=1e-4, atol=1e-5)

CLIPS = [(None, "vocab"), (1.0, "vocab"), (0.02, "vocab"), (5.0, "token")]


def rows(r, v, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r, v, generator=g) * scale, torch.randn(r, v, generator=g) * scale


def compare(d, t, temperature, clip, clip_mode, block_v, seed=0):
    """Forward values and grads (random upstream weights on hard and rkl) of both paths."""
    d_ref = d.clone().requires_grad_()
    d_fus = d.clone().requires_grad_()
    h_ref, r_ref = opd_row_terms(d_ref, t, temperature, clip, clip_mode)
    h_fus, r_fus = fused_opd_terms(d_fus, t, temperature, clip, clip_mode, block_v=block_v)
    torch.testing.assert_close(h_fus, h_ref, **TOL)
    torch.testing.assert_close(r_fus, r_ref, **TOL)
    g = torch.Generator().manual_seed(seed + 100)
    w_h, w_r = torch.rand(d.shape[0], generator=g), torch.randn(d.shape[0], generator=g)
    (w_h * h_ref + w_r * r_ref).sum().backward()
    (w_h * h_fus + w_r * r_fus).sum().backward()
    torch.testing.assert_close(d_fus.grad, d_ref.grad, **TOL)
    return r_ref.detach()


@pytest.mark.parametrize("clip,clip_mode", CLIPS)
@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.0])
def test_fused_matches_torch(temperature, clip, clip_mode):
    # V = 45 with 16-wide chunks: three chunks, the last one partial
    d, t = rows(6, 45, seed=int(temperature * 10))
    rkl = compare(d, t, temperature, clip, clip_mode, block_v=16)
    # token clip 5.0: T=1 has clipped and unclipped rows, T=0.6 only clipped, T=2 none
    if clip_mode == "token" and temperature == 1.0:
        unclipped = opd_row_terms(d, t, temperature, None)[1]
        assert (unclipped > clip).any() and (unclipped < clip).any()
        assert (rkl == clip).any()


@pytest.mark.parametrize("v,block_v", [(10, 16), (32, 16), (33, 8), (7, 1 << 3)])
@pytest.mark.parametrize("clip,clip_mode", [(0.05, "vocab"), (1.0, "token")])
def test_chunk_edges(v, block_v, clip, clip_mode):
    d, t = rows(4, v, seed=v)
    compare(d, t, 0.8, clip, clip_mode, block_v=block_v)


def test_default_chunk_size_and_outlier():
    """Outlier token (draft mass, ~zero target probability) in the last, partial chunk."""
    d, t = rows(3, 50, seed=9, scale=1.0)
    d[:, 47] = 4.0
    t[:, 47] = -40.0
    for clip, mode in [(None, "vocab"), (1.0, "vocab"), (1.0, "token")]:
        compare(d, t, 1.0, clip, mode, block_v=None)
        compare(d, t, 1.0, clip, mode, block_v=16)


def test_argmax_ties_pick_first_index():
    d, _ = rows(3, 40, seed=11)
    t = torch.zeros(3, 40)
    t[0, [5, 30]] = 2.0  # tie across chunks
    t[1, [17, 18]] = 2.0  # tie inside a chunk
    t[2, 39] = 2.0  # in the partial last chunk
    for block_v in (16, 64):
        compare(d, t, 1.0, 1.0, "vocab", block_v=block_v)


def test_only_one_output_used_and_no_target_grad():
    d, t = rows(4, 37, seed=12)
    t.requires_grad_()
    for pick in (0, 1):
        d_ref = d.clone().requires_grad_()
        d_fus = d.clone().requires_grad_()
        opd_row_terms(d_ref, t, 1.3, 0.5, "vocab")[pick].sum().backward()
        fused_opd_terms(d_fus, t, 1.3, 0.5, "vocab", block_v=16)[pick].sum().backward()
        torch.testing.assert_close(d_fus.grad, d_ref.grad, **TOL)
    assert t.grad is None


@pytest.mark.parametrize("clip,clip_mode", [(1.0, "vocab"), (4.0, "token")])
def test_opd_loss_triton_backend(clip, clip_mode):
    g = torch.Generator().manual_seed(13)
    draft = torch.randn(2, 5, 29, generator=g) * 3
    target = torch.randn(2, 5, 29, generator=g) * 3
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[1, 3:] = False
    outs, grads = {}, {}
    for backend in ("torch", "triton"):
        x = draft.clone().requires_grad_()
        outs[backend] = opd_loss(x, target, valid, temperature=0.9, clip=clip, clip_mode=clip_mode, backend=backend)
        outs[backend]["loss"].backward()
        grads[backend] = x.grad
    for key in ("loss", "hard", "rkl"):
        torch.testing.assert_close(outs["triton"][key], outs["torch"][key], **TOL)
    torch.testing.assert_close(grads["triton"], grads["torch"], **TOL)


def test_dispatcher(monkeypatch):
    d, t = rows(2, 20, seed=14)
    d.requires_grad_()
    h, _ = opd_terms(d, t, backend="auto")  # CPU with TRITON_INTERPRET=1: fused kernel
    assert "Fused" in type(h.grad_fn).__name__
    h, _ = opd_terms(d, t, backend="triton")
    assert "Fused" in type(h.grad_fn).__name__
    h, _ = opd_terms(d, t, backend="torch")
    assert "Fused" not in type(h.grad_fn).__name__
    monkeypatch.delenv("TRITON_INTERPRET")
    h, _ = opd_terms(d, t, backend="auto")  # CPU without TRITON_INTERPRET=1: PyTorch path
    assert "Fused" not in type(h.grad_fn).__name__
    with pytest.raises(RuntimeError):
        opd_terms(d, t, backend="triton")


def test_bf16_input_upcast_on_cpu():
    d, t = rows(3, 24, seed=15)
    d16 = d.bfloat16().requires_grad_()
    h, r = fused_opd_terms(d16, t.bfloat16(), 1.0, 1.0, "vocab", block_v=16)
    h_ref, r_ref = opd_row_terms(d.bfloat16().float(), t.bfloat16().float(), 1.0, 1.0, "vocab")
    torch.testing.assert_close(h, h_ref, **TOL)
    torch.testing.assert_close(r, r_ref, **TOL)
    (h + r).sum().backward()
    assert d16.grad.dtype == torch.bfloat16


def test_kernels_compile_for_sm90():
    """Compiled (not interpreted) kernels lower to PTX/cubin for an H100-class target, no GPU needed."""
    code = textwrap.dedent(
        """
        import os
        os.environ.pop("TRITON_INTERPRET", None)
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from adaflash.kernels import _opd_triton as k
        assert not k.INTERPRETED
        tgt = GPUTarget("cuda", 90, 32)
        ptrs = dict(LSE1="*fp32", LSED="*fp32", LSET="*fp32", IDX="*i32", USUM="*fp32", RSCALE="*fp32")
        fwd = dict(D="*bf16", T="*bf16", HARD="*fp32", RKL="*fp32", **ptrs,
                   stride_d="i64", stride_t="i64", V="i32", inv_temp="fp32", clip="fp32",
                   CLIP_MODE="constexpr", UNIT_TEMP="constexpr", BLOCK_V="constexpr")
        bwd = dict(D="*bf16", T="*bf16", GD="*bf16", G_HARD="*fp32", G_RKL="*fp32", **ptrs,
                   stride_d="i64", stride_t="i64", stride_g="i64", V="i32", inv_temp="fp32", clip="fp32",
                   CLIP_MODE="constexpr", BLOCK_V="constexpr")
        for mode in (0, 1, 2):
            for unit in (True, False):
                c = dict(CLIP_MODE=mode, UNIT_TEMP=unit, BLOCK_V=2048)
                triton.compile(ASTSource(k._opd_fwd_kernel, fwd, constexprs=c), target=tgt)
            c = dict(CLIP_MODE=mode, BLOCK_V=2048)
            triton.compile(ASTSource(k._opd_bwd_kernel, bwd, constexprs=c), target=tgt)
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.skip("ahead-of-time compile took too long on this machine")
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("no ptxas available for an ahead-of-time compile")
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
