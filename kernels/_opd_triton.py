"""Triton kernels behind ``adaflash.kernels.opd`` (imported lazily; needs ``triton``).

Triton decides interpreted vs compiled mode when a kernel is decorated, i.e. when this module is
imported: set TRITON_INTERPRET=1 before the first import to run the kernels on CPU tensors.

One program per row. Math (a = z_d / T, b = z_t / T, p = softmax(a), q = softmax(b)):
  forward pass 1 (chunks over V): online logsumexp of z_d, a and b; running (max, index) of z_t.
  forward pass 2: term_v = p_v (log p_v - log q_v); rkl = sum_v clip(term_v); also
                  U = sum_v m_v p_v (log p_v - log q_v + 1), m_v = 1 where the term is not clipped.
  backward:       d rkl / d z_j = rscale / T * (m_j p_j (log p_j - log q_j + 1) - p_j U)
                  d hard / d z_j = softmax(z_d)_j - [j == argmax z_t]
  (rscale = 0 for a token-clipped row whose sum exceeded clip, else 1).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

# Whether the kernels below were decorated in interpreter (CPU / numpy) mode.
INTERPRETED: bool = bool(knobs.runtime.interpret)

CLIP_NONE, CLIP_VOCAB, CLIP_TOKEN = 0, 1, 2


@triton.jit
def _opd_fwd_kernel(
    D,
    T,
    HARD,
    RKL,
    LSE1,
    LSED,
    LSET,
    IDX,
    USUM,
    RSCALE,
    stride_d,
    stride_t,
    V,
    inv_temp,
    clip,
    CLIP_MODE: tl.constexpr,
    UNIT_TEMP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    d_row = D + row * stride_d
    t_row = T + row * stride_t
    offs = tl.arange(0, BLOCK_V)

    # pass 1: online logsumexps and the target's running argmax
    m1 = float("-inf")  # draft, temperature 1
    s1 = 0.0
    md = float("-inf")  # draft / T
    sd = 0.0
    mt = float("-inf")  # target / T
    st = 0.0
    best = float("-inf")
    best_idx = 0
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        zd = tl.load(d_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        zt = tl.load(t_row + cols, mask=mask, other=float("-inf")).to(tl.float32)

        m_new = tl.maximum(m1, tl.max(zd, 0))
        s1 = s1 * tl.exp(m1 - m_new) + tl.sum(tl.exp(zd - m_new), 0)
        m1 = m_new
        if not UNIT_TEMP:
            ad = zd * inv_temp
            m_new = tl.maximum(md, tl.max(ad, 0))
            sd = sd * tl.exp(md - m_new) + tl.sum(tl.exp(ad - m_new), 0)
            md = m_new
        at = zt * inv_temp
        m_new = tl.maximum(mt, tl.max(at, 0))
        st = st * tl.exp(mt - m_new) + tl.sum(tl.exp(at - m_new), 0)
        mt = m_new

        c_best = tl.max(zt, 0)
        c_idx = tl.argmax(zt, 0)  # first index among ties
        take = c_best > best  # strict: earlier chunks win ties, like torch.argmax
        best_idx = tl.where(take, start + c_idx, best_idx)
        best = tl.where(take, c_best, best)

    lse1 = m1 + tl.log(s1)
    if UNIT_TEMP:
        lsed = lse1
    else:
        lsed = md + tl.log(sd)
    lset = mt + tl.log(st)
    z_top = tl.load(d_row + best_idx).to(tl.float32)
    hard = lse1 - z_top

    # pass 2: clipped reverse-KL terms and U for the backward pass
    s_rkl = 0.0
    u_sum = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        zd = tl.load(d_row + cols, mask=mask, other=0.0).to(tl.float32)
        zt = tl.load(t_row + cols, mask=mask, other=0.0).to(tl.float32)
        lpd = zd * inv_temp - lsed
        lpt = zt * inv_temp - lset
        pd = tl.exp(lpd)
        diff = lpd - lpt
        term = pd * diff
        u = pd * (diff + 1.0)
        if CLIP_MODE == 1:
            keep = term <= clip
            term = tl.where(keep, term, clip)
            u = tl.where(keep, u, 0.0)
        term = tl.where(mask, term, 0.0)
        u = tl.where(mask, u, 0.0)
        s_rkl += tl.sum(term, 0)
        u_sum += tl.sum(u, 0)

    rscale = 1.0
    if CLIP_MODE == 2:
        rscale = tl.where(s_rkl <= clip, 1.0, 0.0)
        s_rkl = tl.minimum(s_rkl, clip)

    tl.store(HARD + row, hard)
    tl.store(RKL + row, s_rkl)
    tl.store(LSE1 + row, lse1)
    tl.store(LSED + row, lsed)
    tl.store(LSET + row, lset)
    tl.store(IDX + row, best_idx)
    tl.store(USUM + row, u_sum)
    tl.store(RSCALE + row, rscale)


@triton.jit
def _opd_bwd_kernel(
    D,
    T,
    GD,
    G_HARD,
    G_RKL,
    LSE1,
    LSED,
    LSET,
    IDX,
    USUM,
    RSCALE,
    stride_d,
    stride_t,
    stride_g,
    V,
    inv_temp,
    clip,
    CLIP_MODE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    d_row = D + row * stride_d
    t_row = T + row * stride_t
    g_row = GD + row * stride_g
    offs = tl.arange(0, BLOCK_V)

    g_hard = tl.load(G_HARD + row).to(tl.float32)
    g_rkl = tl.load(G_RKL + row).to(tl.float32) * tl.load(RSCALE + row) * inv_temp
    lse1 = tl.load(LSE1 + row)
    lsed = tl.load(LSED + row)
    lset = tl.load(LSET + row)
    top = tl.load(IDX + row)
    u_sum = tl.load(USUM + row)

    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        zd = tl.load(d_row + cols, mask=mask, other=0.0).to(tl.float32)
        zt = tl.load(t_row + cols, mask=mask, other=0.0).to(tl.float32)
        # hard: softmax(z_d) - onehot(argmax z_t)
        p1 = tl.exp(zd - lse1)
        grad = g_hard * (p1 - tl.where(cols == top, 1.0, 0.0))
        # clipped reverse KL
        lpd = zd * inv_temp - lsed
        lpt = zt * inv_temp - lset
        pd = tl.exp(lpd)
        diff = lpd - lpt
        u = pd * (diff + 1.0)
        if CLIP_MODE == 1:
            u = tl.where(pd * diff <= clip, u, 0.0)
        grad += g_rkl * (u - pd * u_sum)
        tl.store(g_row + cols, grad.to(GD.dtype.element_ty), mask=mask)
