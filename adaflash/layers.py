"""Transformer building blocks shared by the target model and the drafter.

Llama/Qwen3 style: RMSNorm, rotary position embeddings, grouped-query attention (optional
per-head q/k RMSNorm as in Qwen3), SwiGLU MLP. Module names follow the Hugging Face checkpoints
(`q_proj`, `gate_proj`, `input_layernorm`, ...) so their safetensors load without renaming.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from adaflash.kernels import norm_rope_cpu


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (kernel := norm_rope_cpu.kernel(x, self.weight)) is not None:
            return kernel.rms_norm(x, self.weight, self.eps)  # one call (CPU inference)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Default (unscaled) RoPE; cos/sin are computed per call from integer positions."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, D]
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, T, D]


def rotary_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D] (a projection's heads); cos/sin: [B, 1, T, D] -> rotated [B, H, T, D]."""
    if (kernel := norm_rope_cpu.kernel(x, cos, sin)) is not None:
        return kernel.rope(x, cos, sin).transpose(1, 2)  # one call (CPU inference), PyTorch's bits
    return apply_rotary(x.transpose(1, 2), cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B, 1, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _mkldnn_dtypes() -> tuple[torch.dtype, ...]:
    if not torch.backends.mkldnn.is_available():
        return ()
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


PACKED_DTYPES = _mkldnn_dtypes()
BF16_ROWS = 32  # rows per packed bfloat16 call (`Linear.forward`)


class Linear(nn.Linear):
    """nn.Linear with a faster CPU inference path, numerically the same GEMM.

    Without autograd on CPU (decoding, verification, drafting) the weight is reordered once into
    oneDNN's blocked layout and multiplied with `mkldnn._linear_pointwise`: MKL's plain sgemm is slow
    for the 1-16 rows a decoding or verify step sends (SmolLM2's LM head 10 / 17 / 19 ms for 1 / 4 / 16
    rows, oneDNN-packed 4 / 5 / 6 ms; docs/benchmarks.md). The packed copy is rebuilt whenever the
    weight changes (an optimizer step or a hot-swap bumps its version) and is never saved. Inputs are
    flattened to 2-D first: `F.linear` on a 3-D input whose batch stride is not the packed one (a
    slice such as h[:, 1:4]) takes matmul's batched path, which copies the whole transposed weight
    (46 ms per call for the LM head)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, in]
        if flat.shape[0] and self._packable(flat):
            # bfloat16 goes in calls of at most 32 rows: on a CPU with AMX, oneDNN's sums for a call of more
            # rows depend on where a row falls (1 to 37 of 40 rows got other bits than alone, by shape); up to
            # 32 rows a row is its own there too, and such a call costs about what one row does.
            rows = flat.shape[0]
            if rows <= BF16_ROWS or flat.dtype != torch.bfloat16:
                out = self._mm(flat)
            else:
                out = torch.cat([self._mm(flat[i : i + BF16_ROWS]) for i in range(0, rows, BF16_ROWS)])
        else:
            out = F.linear(flat, self.weight, self.bias)
        return out.view(*x.shape[:-1], out.shape[-1])  # [..., out]

    def _mm(self, flat: torch.Tensor) -> torch.Tensor:
        # one row goes through oneDNN's 2-row path: its 1-row kernel sums in another order for some shapes
        # (SmolLM2's down_proj, in 1,536), so a token decoded alone got other last bits than the same token
        # in a verify block; from 2 rows on a row's result is its own. Same cost.
        if flat.shape[0] == 1:
            return torch.ops.mkldnn._linear_pointwise(flat.expand(2, -1).contiguous(), self._packed(), self.bias, "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(flat, self._packed(), self.bias, "none", [], "")

    def _packable(self, x: torch.Tensor) -> bool:
        return not torch.is_grad_enabled() and x.device.type == "cpu" and x.dtype == self.weight.dtype and self._packs()

    def _packs(self) -> bool:
        """Whether this weight has a packed CPU form at all (CPU, a dtype oneDNN runs here)."""
        return self.weight.device.type == "cpu" and self.weight.dtype in PACKED_DTYPES

    def _packed(self) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype)
        if self.__dict__.get("_pack_key") != key:
            self.__dict__["_pack"] = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)  # layout tuned for ~16 rows
            self.__dict__["_pack_key"] = key
        return self.__dict__["_pack"]


def prepack(*modules: nn.Module) -> None:
    """Build the packed inference weights of every CPU `Linear` now, where the load happens (a
    drafter loaded by the hot-swap thread), not in the first engine step that uses them; likewise the
    norm/rotary kernel (compiled once per machine, 30-40 s) for a model with CPU norms."""
    for module in modules:
        for m in module.modules():
            if isinstance(m, Linear) and m._packs():
                m._packed()
            elif isinstance(m, RMSNorm) and m.weight.device.type == "cpu":
                norm_rope_cpu.load()


def frozen_linear(weight: torch.Tensor) -> Linear:
    """A bias-free `Linear` around an existing frozen weight [out, in] (not registered anywhere)."""
    lin = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return lin


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """GQA projections. `project_q` / `project_kv` are separate so the drafter can project the
    target's context features through k/v alone (KV injection)."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm: bool, eps: float):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = Linear(hidden, n_heads * head_dim, bias=False)
        self.k_proj = Linear(hidden, n_kv_heads * head_dim, bias=False)
        self.v_proj = Linear(hidden, n_kv_heads * head_dim, bias=False)
        self.o_proj = Linear(n_heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return rotary_heads(q, cos, sin)  # [B, H, T, D]

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        return rotary_heads(k, cos, sin), v.transpose(1, 2)  # [B, Hkv, T, D] each

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention + output projection -> [B, T, hidden]."""
        return self.o_proj(self.attend_heads(q, k, v, mask))

    def attend_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q: [B, H, T, D]; k, v: [B, Hkv, S, D]; mask: bool [B or 1, 1, T, S], True = may attend.

        Plain matmul attention: on CPU it beats SDPA's flash kernel several times for the short query
        blocks of decoding and verification. Query heads are grouped per KV head (no K/V copies).
        bf16 inference on CPU (a bf16 drafter) multiplies in float32: a bf16 matmul goes through oneDNN,
        which builds and caches a primitive (~0.3 MB, two caches of 1,024 entries) for every new key
        length, and a decoding context has a new one every step, so the server's memory crept up with
        entries never used again (and each step paid the JIT); float32 matmul is MKL's, uncached. The
        KV caches of such a model are float32 unless the kernel attends (`kvcache.kv_dtype`); the output has q's dtype."""
        out_dtype = q.dtype
        if out_dtype == torch.bfloat16 and q.device.type == "cpu" and not torch.is_grad_enabled():
            q, k, v = q.float(), k.float(), v.float()
        b, h, t, d = q.shape
        rep = h // self.n_kv_heads
        q = q.reshape(b, self.n_kv_heads, rep * t, d)  # heads h = kv * rep + r share kv head `kv`
        scores = (q @ k.transpose(-1, -2)).float() * d**-0.5  # [B, Hkv, rep*T, S]
        if mask is not None:
            scores = scores.view(b, self.n_kv_heads, rep, t, -1).masked_fill(~mask[:, :, None], float("-inf"))
            scores = scores.view(b, self.n_kv_heads, rep * t, -1)
        out = scores.softmax(-1).to(v.dtype) @ v  # [B, Hkv, rep*T, D]
        return out.view(b, h, t, d).transpose(1, 2).reshape(b, t, h * d).to(out_dtype)  # [B, T, H*D], before o_proj


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP; the target and the drafter both stack these."""

    def __init__(self, hidden: int, intermediate: int, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm: bool, eps: float):
        super().__init__()
        self.self_attn = Attention(hidden, n_heads, n_kv_heads, head_dim, qk_norm, eps)
        self.mlp = MLP(hidden, intermediate)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
