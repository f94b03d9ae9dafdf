"""Training losses for the drafter: pretraining cross-entropy, on-policy distillation (OPD), the OSD baseline
and the length head (adaflash/recipe.py picks one per step).

All functions are pure functions over tensors. Shapes use N = blocks (rows of a batch), K = drafted
positions per block, V = vocabulary size, R = flattened rows (N * K or the valid subset of them).

The vocabulary softmax is always computed in fp32 (bf16 / fp16 inputs are upcast row-wise), and the
target side never receives gradients. The per-row OPD terms come from ``adaflash.kernels.opd``:
``opd_row_terms`` (plain PyTorch, the reference) or the fused Triton kernel that replaces it one-for-one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from adaflash.kernels.opd import BACKENDS, check_clip, opd_row_terms, opd_terms, upcast


def position_weights(block_len: int, gamma: float = 7.0, device=None) -> Tensor:
    """Per-position weights w_k = exp(-(k-1)/gamma), k = 1..block_len.  -> [K] fp32."""
    if block_len < 0:
        raise ValueError(f"block_len must be >= 0, got {block_len}")
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    k = torch.arange(block_len, dtype=torch.float32, device=device)  # k-1 = 0..K-1
    return torch.exp(-k / gamma)


def _flatten_valid(draft_logits: Tensor, target_logits: Tensor, valid: Tensor | None, gamma: float) -> tuple[Tensor, Tensor, Tensor]:
    """[N, K, V] -> rows [R, V] of the valid positions plus their weights [R] (w_k)."""
    if draft_logits.dim() != 3 or draft_logits.shape != target_logits.shape:
        raise ValueError(
            f"expected draft/target logits [N, K, V] of equal shape, got {tuple(draft_logits.shape)} and {tuple(target_logits.shape)}"
        )
    n, k, v = draft_logits.shape
    w = position_weights(k, gamma, device=draft_logits.device)  # [K]
    if draft_logits.dtype == torch.float64:
        w = torch.exp(-torch.arange(k, dtype=torch.float64, device=draft_logits.device) / gamma)
    if valid is None:
        valid = torch.ones(n, k, dtype=torch.bool, device=draft_logits.device)
    if valid.shape != (n, k):
        raise ValueError(f"valid must be [N, K] = {(n, k)}, got {tuple(valid.shape)}")
    valid = valid.to(device=draft_logits.device, dtype=torch.bool)
    d = draft_logits.reshape(n * k, v)  # [N*K, V]
    t = target_logits.reshape(n * k, v)
    wk = w.expand(n, k).reshape(n * k)  # [N*K]
    if not bool(valid.all()):
        idx = valid.reshape(-1).nonzero().squeeze(-1)  # [R]
        d, t, wk = d.index_select(0, idx), t.index_select(0, idx), wk.index_select(0, idx)
    return d, t, wk


def _weighted_mean(x: Tensor, w: Tensor, ref: Tensor) -> Tensor:
    """sum(w * x) / sum(w); 0 (still attached to ``ref``'s graph) when there are no rows."""
    if x.numel() == 0:
        return ref.sum() * 0.0
    return (w * x).sum() / w.sum()


def opd_loss(
    draft_logits: Tensor,  # [N, K, V]
    target_logits: Tensor,  # [N, K, V]
    valid: Tensor | None,  # [N, K] bool (None = all valid)
    alpha: float = 0.8,
    temperature: float = 1.0,
    clip: float | None = 1.0,
    clip_mode: str = "vocab",
    gamma: float = 7.0,
    backend: str = "auto",
) -> dict[str, Tensor]:
    """On-policy distillation loss = alpha * hard + (1 - alpha) * rkl, both position weighted.

    Returns {"loss": scalar with grad, "hard": detached scalar, "rkl": detached scalar}.
    backend: "torch" (``opd_row_terms``), "triton" (fused kernel) or "auto" (Triton when usable).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_clip(clip, clip_mode)
    d, t, w = _flatten_valid(draft_logits, target_logits, valid, gamma)  # [R, V], [R, V], [R]
    if backend == "torch":
        hard_r, rkl_r = opd_row_terms(d, t, temperature, clip, clip_mode)
    else:
        hard_r, rkl_r = opd_terms(d, t, temperature, clip, clip_mode, backend=backend)
    hard = _weighted_mean(hard_r, w, draft_logits)
    rkl = _weighted_mean(rkl_r, w, draft_logits)
    loss = alpha * hard + (1.0 - alpha) * rkl
    return {"loss": loss, "hard": hard.detach(), "rkl": rkl.detach()}


def osd_loss(
    draft_logits: Tensor,  # [N, K, V]
    target_logits: Tensor,  # [N, K, V]
    valid: Tensor | None,  # [N, K] bool
    temperature: float = 1.0,
    gamma: float = 7.0,
) -> dict[str, Tensor]:
    """OSD baseline: position-weighted forward KL(p_t || p_d) at temperature T, no clipping.

    Returns {"loss": scalar with grad, "fkl": detached scalar}.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    d, t, w = _flatten_valid(draft_logits, target_logits, valid, gamma)
    logp_d = F.log_softmax(upcast(d) / temperature, dim=-1)  # [R, V]
    logp_t = F.log_softmax(upcast(t.detach()) / temperature, dim=-1)  # [R, V]
    fkl_r = (logp_t.exp() * (logp_t - logp_d)).sum(dim=-1)  # [R]
    fkl = _weighted_mean(fkl_r, w, draft_logits)
    return {"loss": fkl, "fkl": fkl.detach()}


def ce_loss(draft_logits: Tensor, labels: Tensor, valid: Tensor, gamma: float = 7.0) -> dict[str, Tensor]:
    """DFlash pretraining: cross-entropy against the text's own next tokens, weighted w_k over the valid
    positions and normalised by the weights in play.  draft_logits [N, K, V]; labels, valid [N, K]
    -> {"loss": scalar with grad}."""
    ce = F.cross_entropy(upcast(draft_logits).flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)  # [N, K]
    w = position_weights(labels.shape[1], gamma, device=valid.device) * valid  # [N, K]
    return {"loss": (ce * w).sum() / w.sum().clamp(min=1e-6)}


def acceptance_label(accepted: Tensor, block_size: int) -> Tensor:
    """Acceptance-rate label of a block, free from verification: clamp((accepted + 1) / block_size, 0, 1).
    The +1 counts the token the target always contributes (its correction or bonus).  [N] int -> [N] fp32."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    return ((accepted.float() + 1.0) / block_size).clamp(0.0, 1.0)


def length_head_loss(pred: Tensor, accepted: Tensor, block_size: int) -> Tensor:
    """MSE of the predicted acceptance rate pred [N] in (0, 1) against `acceptance_label`."""
    return F.mse_loss(pred.float(), acceptance_label(accepted, block_size).to(pred.device))
