"""Fused OPD per-row terms: a Triton kernel over vocabulary chunks, with a PyTorch fallback.

``fused_opd_terms`` is a drop-in replacement for ``opd_row_terms`` (plain PyTorch, here too): it returns the
per-row hard CE and (clipped) reverse KL, with gradients to the draft logits, without ever
materialising a [rows x V] probability tensor (forward: two streaming passes over V; backward: one
pass that recomputes the probabilities chunk by chunk from five saved scalars per row).

Triton is imported lazily (``_opd_triton``), so this module imports without triton installed.
Triton fixes interpreted vs compiled mode when the kernels are first imported (on the first kernel
call): to run them on CPU tensors set TRITON_INTERPRET=1 before that and keep it set (the
interpreter reads it at launch too). Inputs on the CPU are upcast to fp32 (no bf16 there).
"""

from __future__ import annotations

import importlib.util
import math
import os

import torch
import torch.nn.functional as F
from torch import Tensor

CLIP_MODES = ("vocab", "token")
BACKENDS = ("auto", "torch", "triton")
DEFAULT_BLOCK_V = 2048  # vocabulary chunk per loop iteration (power of two)


def upcast(x: Tensor) -> Tensor:
    """fp16/bf16 -> fp32 for the vocabulary softmax; fp32/fp64 are kept as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def check_clip(clip: float | None, clip_mode: str) -> None:
    if clip_mode not in CLIP_MODES:
        raise ValueError(f"clip_mode must be one of {CLIP_MODES}, got {clip_mode!r}")
    if clip is not None and not math.isfinite(float(clip)):
        raise ValueError(f"clip must be a finite float or None, got {clip}")


def opd_row_terms(
    draft_logits: Tensor,  # [R, V], any float dtype, requires grad
    target_logits: Tensor,  # [R, V], any float dtype, detached here
    temperature: float = 1.0,
    clip: float | None = 1.0,
    clip_mode: str = "vocab",
) -> tuple[Tensor, Tensor]:
    """Per-row OPD terms in plain PyTorch.  -> (hard [R] fp32, rkl [R] fp32).

    Computed in fp32 (fp64 inputs stay fp64).
    hard: cross-entropy (temperature 1) of the draft against the target's argmax token.
    rkl:  sum_v p_d(v) (log p_d(v) - log p_t(v)) with p = softmax(logits / temperature);
          clip_mode "vocab" clamps every vocabulary term to <= clip before the sum,
          "token" clamps the row sum; clip=None disables clipping.
    """
    check_clip(clip, clip_mode)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    zd = upcast(draft_logits)  # [R, V]
    zt = upcast(target_logits.detach())  # [R, V]

    top1 = zt.argmax(dim=-1, keepdim=True)  # [R, 1]; first index on ties
    hard = torch.logsumexp(zd, dim=-1) - zd.gather(-1, top1).squeeze(-1)  # [R]

    if temperature != 1.0:
        zd = zd / temperature
        zt = zt / temperature
    logp_d = F.log_softmax(zd, dim=-1)  # [R, V]
    logp_t = F.log_softmax(zt, dim=-1)  # [R, V]
    terms = logp_d.exp() * (logp_d - logp_t)  # [R, V]
    if clip is not None and clip_mode == "vocab":
        terms = terms.clamp(max=clip)
    rkl = terms.sum(dim=-1)  # [R]
    if clip is not None and clip_mode == "token":
        rkl = rkl.clamp(max=clip)
    return hard, rkl


def _next_pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length()


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _kernels():
    from adaflash.kernels import _opd_triton  # imports triton; decorates the kernels once

    return _opd_triton


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _can_run_triton(x: Tensor) -> bool:
    """Whether the Triton kernels can run on ``x``'s device right now.

    CUDA tensors need compiled kernels. CPU tensors need TRITON_INTERPRET=1 in the environment
    (Triton's interpreter reads it at launch as well) and kernels decorated in interpreter mode.
    Never imports triton for CPU tensors without TRITON_INTERPRET=1.
    """
    if not triton_available():
        return False
    if x.is_cuda:
        return not _kernels().INTERPRETED
    return _interpret_env() and _kernels().INTERPRETED


class _FusedOPDTerms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, draft, target, temperature, clip, clip_mode, block_v):
        k = _kernels()
        r, v = draft.shape
        mode = k.CLIP_NONE if clip is None else (k.CLIP_VOCAB if clip_mode == "vocab" else k.CLIP_TOKEN)
        clip_f = 0.0 if clip is None else float(clip)
        inv_temp = 1.0 / float(temperature)
        f32 = dict(device=draft.device, dtype=torch.float32)
        hard = torch.empty(r, **f32)  # [R]
        rkl = torch.empty(r, **f32)  # [R]
        lse1 = torch.empty(r, **f32)  # logsumexp(z_d)
        lsed = torch.empty(r, **f32)  # logsumexp(z_d / T)
        lset = torch.empty(r, **f32)  # logsumexp(z_t / T)
        usum = torch.empty(r, **f32)  # sum_v m_v p_v (log p_v - log q_v + 1)
        rscale = torch.empty(r, **f32)  # 0 for token-clipped rows, else 1
        idx = torch.empty(r, device=draft.device, dtype=torch.int32)  # argmax z_t
        if r > 0:
            k._opd_fwd_kernel[(r,)](
                draft,
                target,
                hard,
                rkl,
                lse1,
                lsed,
                lset,
                idx,
                usum,
                rscale,
                draft.stride(0),
                target.stride(0),
                v,
                inv_temp,
                clip_f,
                CLIP_MODE=mode,
                UNIT_TEMP=(inv_temp == 1.0),
                BLOCK_V=block_v,
            )
        ctx.save_for_backward(draft, target, lse1, lsed, lset, idx, usum, rscale)
        ctx.cfg = (inv_temp, clip_f, mode, block_v)
        return hard, rkl

    @staticmethod
    def backward(ctx, g_hard, g_rkl):
        draft, target, lse1, lsed, lset, idx, usum, rscale = ctx.saved_tensors
        inv_temp, clip_f, mode, block_v = ctx.cfg
        r, v = draft.shape
        if g_hard is None:
            g_hard = torch.zeros(r, device=draft.device, dtype=torch.float32)
        if g_rkl is None:
            g_rkl = torch.zeros(r, device=draft.device, dtype=torch.float32)
        g_hard = g_hard.float().contiguous()
        g_rkl = g_rkl.float().contiguous()
        grad = torch.empty_like(draft)  # [R, V], draft dtype
        if r > 0:
            _kernels()._opd_bwd_kernel[(r,)](
                draft,
                target,
                grad,
                g_hard,
                g_rkl,
                lse1,
                lsed,
                lset,
                idx,
                usum,
                rscale,
                draft.stride(0),
                target.stride(0),
                grad.stride(0),
                v,
                inv_temp,
                clip_f,
                CLIP_MODE=mode,
                BLOCK_V=block_v,
            )
        return grad, None, None, None, None, None


def fused_opd_terms(
    draft_logits: Tensor,  # [R, V]
    target_logits: Tensor,  # [R, V] (no gradient)
    temperature: float = 1.0,
    clip: float | None = 1.0,
    clip_mode: str = "vocab",
    block_v: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Triton version of ``opd_row_terms``.  -> (hard [R] fp32, rkl [R] fp32), grads to draft_logits.

    block_v: vocabulary chunk size (power of two); default min(2048, next_pow2(V)).
    """
    check_clip(clip, clip_mode)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if draft_logits.dim() != 2 or draft_logits.shape != target_logits.shape:
        raise ValueError(
            f"expected draft/target logits [R, V] of equal shape, got {tuple(draft_logits.shape)} and {tuple(target_logits.shape)}"
        )
    if not triton_available():
        raise RuntimeError("fused_opd_terms needs the `triton` package")
    v = draft_logits.shape[1]
    if block_v is None:
        block_v = min(DEFAULT_BLOCK_V, _next_pow2(max(v, 1)))
    if block_v <= 0 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    if not _can_run_triton(draft_logits):
        raise RuntimeError(
            "Triton kernels cannot run here: CUDA tensors need compiled kernels; CPU tensors need "
            "TRITON_INTERPRET=1, set before the kernels were first imported and still set"
        )
    draft = draft_logits
    target = target_logits.detach()
    if not draft.is_cuda:  # the interpreter has no bf16/fp16 support
        draft, target = draft.float(), target.float()
    if draft.stride(-1) != 1:
        draft = draft.contiguous()
    if target.stride(-1) != 1:
        target = target.contiguous()
    return _FusedOPDTerms.apply(draft, target, float(temperature), clip, clip_mode, int(block_v))


def opd_terms(
    draft_logits: Tensor,  # [R, V]
    target_logits: Tensor,  # [R, V]
    temperature: float = 1.0,
    clip: float | None = 1.0,
    clip_mode: str = "vocab",
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Per-row OPD terms via Triton (``fused_opd_terms``) or PyTorch (``opd_row_terms``).

    "auto" uses Triton when it is importable and the tensors are on CUDA or TRITON_INTERPRET=1;
    "triton" forces the kernel (error when it cannot run); "torch" forces the PyTorch path.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return opd_row_terms(draft_logits, target_logits, temperature, clip, clip_mode)
    usable = _can_run_triton(draft_logits)
    if backend == "triton" and not usable:
        raise RuntimeError(
            "Triton backend unavailable: needs `triton` and CUDA tensors, or CPU tensors with "
            "TRITON_INTERPRET=1 set before the kernels were first imported"
        )
    if usable:
        return fused_opd_terms(draft_logits, target_logits, temperature, clip, clip_mode)
    return opd_row_terms(draft_logits, target_logits, temperature, clip, clip_mode)
