"""Row-invariant ragged attention on CPU: a small C++ kernel (attention_cpu.cpp), built on first use.

Why: a bfloat16 (or int4) target rounds every layer's output to 8 significant bits, so the last-bit
differences that PyTorch's batched matmul and softmax make between a query computed alone and the
same query inside a verify block (their reduction order depends on the call's shape) become visible,
and greedy speculative output drifted from plain decoding in about half of the requests. The kernel
computes every query from its own visible keys in slot order and nothing else, so speculative and
plain decoding (and any concurrency) give the same bits. Together with `layers.Linear`'s row-invariant
projections it makes greedy output lossless in bfloat16, not only in float32.

The extension is compiled once per machine (kernels/cpu_build.py, 30-40 s on two cores); a KV pool on the CPU
builds it when it is made, so the first request does not wait. Where no C++ compiler is found, or
ADAFLASH_ATTENTION=torch is set, `load()` returns None and callers keep PyTorch's attention.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from adaflash.kernels import amx_cpu
from adaflash.kernels.cpu_build import build

SOURCE = Path(__file__).with_name("attention_cpu.cpp")
MODES = {"causal": 0, "full": 1, "tree": 2}
HEAD_DIMS = (32, 64, 128)  # the head dims the kernel takes (its vector loops are 16 lanes wide, unrolled per size)
CHUNK = 16  # block queries per work item (a prefill splits into chunks that run in parallel)


def load():
    """The compiled extension, or None (no compiler, or ADAFLASH_ATTENTION=torch); built once."""
    if os.environ.get("ADAFLASH_ATTENTION", "auto") == "torch":
        return None
    return build(
        "attention_cpu",
        SOURCE,
        "using PyTorch's attention: greedy speculative output in bfloat16/int4 may then differ from plain decoding at near-ties",
    )


def available() -> bool:
    return load() is not None


def amx_scores(pk: torch.Tensor) -> bool:
    """Whether attention over these K scores q . k on AMX tiles: bfloat16 K (a bf16 model's pool, whose
    queries are bf16 numbers too: exact as tile inputs) on a CPU with AMX. Each dot product is then one
    fixed sequence of tile pair-products, whatever the call, so row invariance holds as in the vector path;
    one layer of 32 requests x 4 tokens on 150 tokens of context: 0.76 -> 0.56 ms (the value sums, in vectors
    either way, are most of the rest). The tiles must be enabled (`amx_cpu.available()` asks Linux once)."""
    return pk.dtype == torch.bfloat16 and amx_cpu.available()


def context_slots(valid: torch.Tensor, req: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The valid pool slots before each request's block, once per forward (every layer shares them):
    valid [R, C] bool, req [B, 6] (see `ragged_attention`) -> (slots int32 [sum], offsets int64 [B + 1])."""
    slots, offsets = load().context_slots(valid, req)
    return slots, offsets


def ragged_attention(
    q: torch.Tensor,  # [N, Hq, D] the packed queries (RoPE applied), any float dtype
    pk: torch.Tensor,  # [R, Hkv, C, D] float32 or bfloat16: one layer's K of the pool
    pv: torch.Tensor,  # [R, Hkv, C, D] as pk
    req: torch.Tensor,  # [B, 6] int64: (row, block start, block length, first packed query, mode, tree offset)
    trees: torch.Tensor,  # [T] bool: the tree requests' [n, n] ancestor masks, flattened (empty if none)
    ctx: tuple[torch.Tensor, torch.Tensor],  # context_slots(valid, req)
) -> torch.Tensor:
    """-> [N, Hq * D] in q's dtype: each query attends to its request's context slots, then to the block
    keys its mode allows (0: its causal prefix, 1: the whole block, 2: its tree ancestors)."""
    n, hq, d = q.shape
    out = load().ragged_attention(q.float().contiguous(), pk, pv, req, trees, ctx[0], ctx[1], d**-0.5, amx_scores(pk))  # [N, Hq, D]
    return out.view(n, hq * d).to(q.dtype)


def reference(q, pk, pv, valid, req, trees) -> torch.Tensor:
    """The same attention in plain PyTorch (float64, one request at a time), for tests. -> [N, Hq*D] float64."""
    n_tok, hq, d = q.shape
    hkv = pk.shape[1]
    out = torch.zeros(n_tok, hq, d, dtype=torch.float64)
    for row, a, n, first, mode, off in req.tolist():
        blk = torch.ones(n, n, dtype=torch.bool)
        blk = blk.tril() if mode == 0 else blk if mode == 1 else trees[off : off + n * n].view(n, n)
        mask = torch.cat([valid[row, :a].expand(n, a), blk], dim=1)  # [n, a + n]
        k = pk[row, :, : a + n].double().repeat_interleave(hq // hkv, 0)  # [Hq, a + n, D]
        v = pv[row, :, : a + n].double().repeat_interleave(hq // hkv, 0)
        qq = q[first : first + n].double().transpose(0, 1)  # [Hq, n, D]
        s = (qq @ k.transpose(1, 2) * d**-0.5).masked_fill(~mask, float("-inf"))  # [Hq, n, a + n]
        out[first : first + n] = (s.softmax(-1) @ v).transpose(0, 1)
    return out.view(n_tok, hq * d)
