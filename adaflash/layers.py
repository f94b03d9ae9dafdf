"""Transformer building blocks shared by the target model and the drafter.

Llama/Qwen3 style: RMSNorm, rotary position embeddings, grouped-query attention (optional
per-head q/k RMSNorm as in Qwen3), SwiGLU MLP. Module names follow the Hugging Face checkpoints
(`q_proj`, `gate_proj`, `input_layernorm`, ...) so their safetensors load without renaming.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from adaflash.kernels import amx_cpu, attention_cpu, norm_rope_cpu, stack_cpu

_EPOCH = itertools.count()
_epoch = next(_EPOCH)


def _new_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    global _epoch
    _epoch = next(_EPOCH)


torch.nn.modules.module.register_module_parameter_registration_hook(_new_parameter)


def weights_epoch() -> int:
    """A number that changes whenever a parameter is registered or assigned on any module: caches of
    packed weights keyed on tensors' data pointers and versions also key on it (a new Parameter object
    may reuse a freed one's memory)."""
    return _epoch


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


_SEQUENCES: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar("sequences", default=None)


@contextlib.contextmanager
def prompt_rows(lens: list[int]):
    """Inside: a bfloat16 call over exactly these prompts' rows (sum(lens)) multiplies each prompt's rows in
    one call of their own (`packed_mm`), unchunked. A prompt's bits then depend on the prompt alone, as
    the 32-row chunks would make them, and oneDNN on AMX runs a 94-row prompt in one call instead of three.
    (Weights on the project's AMX tiles, `pack_weight`, take any rows in one call and ignore this.)"""
    token = _SEQUENCES.set(tuple(lens))
    try:
        yield
    finally:
        _SEQUENCES.reset(token)


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """A CPU weight [N, K] in the form `packed_mm` multiplies: AMX tiles for a bias-free bfloat16 weight
    where the CPU has AMX (kernels/amx_cpu.py: one row-invariant call for any number of rows; 32 requests
    x 4 tokens of SmolLM2's linear layers 110 -> 49 ms, one row 24 -> 15 ms), else oneDNN's blocked layout."""
    if bias is None and amx_cpu.fits(weight) and amx_cpu.available():
        return amx_cpu.Packed(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)  # layout tuned for ~16 rows


def packed_mm(flat: torch.Tensor, pack, bias: torch.Tensor | None = None) -> torch.Tensor:
    """flat [M, K] @ a packed weight (`pack_weight`) -> [M, N], each row's bits its own.

    AMX tiles (`amx_cpu.Packed`) take every row in one call. Through oneDNN (float32, or bfloat16 without
    the AMX kernel) bfloat16 goes in calls of at most 32 rows: on a CPU with AMX, oneDNN's sums for a call of more rows
    depend on where a row falls (1 to 37 of 40 rows got other bits than alone, by shape); up to 32 rows a
    row is its own there too, and such a call costs about what one row does. Prompts (`prompt_rows`) go
    one call each instead. One or two rows go through the 4-row path (`_one_call`): the 1-row kernel sums
    in another order for some shapes (SmolLM2's down_proj, in 1,536), so a token decoded alone got other
    last bits than the same token in a verify block; and the 4-row kernel is the faster one."""
    if isinstance(pack, amx_cpu.Packed):
        return pack(flat)
    rows = flat.shape[0]
    if rows <= BF16_ROWS or flat.dtype != torch.bfloat16:
        return _one_call(flat, pack, bias)
    lens = _SEQUENCES.get()
    if lens is None or sum(lens) != rows:
        lens = [min(BF16_ROWS, rows - i) for i in range(0, rows, BF16_ROWS)]
    bounds = [0, *itertools.accumulate(lens)]
    parts = [_one_call(flat[a:b], pack, bias) for a, b in zip(bounds, bounds[1:])]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


PAD_ROWS = 2  # oneDNN calls of at most this many rows are padded to MIN_ROWS (`_one_call`)
MIN_ROWS = 4


def _one_call(flat: torch.Tensor, pack: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One oneDNN call over all rows of flat [M, K]; one or two rows padded to MIN_ROWS (zero rows, their
    outputs dropped). oneDNN's kernels for 1-2 rows are slower than its 3-4 row ones when the weights
    stream from memory, as a decoding step's do (30 layers of SmolLM2's projections, weights not in cache,
    on the 2-core AVX-512 EPYC: float32 1 / 2 / 4 rows 23.9 / 22.1 / 17.0 ms, bfloat16 14.2 / 12.1 / 10.4 ms);
    three rows run as fast as four, and padded they lost the copy's time (whole forwards +5%). A row's bits
    are the same in the 4-row call as in any other (one row alone is not: the 1-row kernel sums in another
    order for some shapes, see `packed_mm`)."""
    m = flat.shape[0]
    if m <= PAD_ROWS:
        padded = flat.new_zeros(MIN_ROWS, flat.shape[1])  # [MIN_ROWS, K]
        padded[:m] = flat
        return torch.ops.mkldnn._linear_pointwise(padded, pack, bias, "none", [], "")[:m]
    return torch.ops.mkldnn._linear_pointwise(flat, pack, bias, "none", [], "")


def fused(owner: nn.Module, mods: tuple[nn.Module, ...], x: torch.Tensor) -> torch.Tensor | None:
    """x [..., K] through projections of the same input (q/k/v, gate/up) as ONE matmul over their outputs
    side by side -> [..., sum N], or None where they do not fuse (autograd on, not CPU, a dtype without a
    packed form, a weight format without a fused one: the caller then calls each). A SmolLM2 step makes
    210 small projection calls; fused, 120 (one layer's projections at one row: bfloat16 0.64 -> 0.55 ms,
    q4 0.20 -> 0.13 ms). A column's sums do not depend on its neighbours, and every CPU inference call
    of the model goes through the same fused form, so plain decoding and verification agree. The form
    is cached on `owner`, rebuilt when a weight changes; members' own packed copies are then never made."""
    op = fused_op(owner, mods, x)
    if op is None:
        return None
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    out = op(flat)
    return out.view(*x.shape[:-1], out.shape[-1])


class Fused:
    """Projections of one input as one packed weight [sum N, K] (`fused`): call it on flat [M, K] -> [M, sum N]."""

    def __init__(self, pack):
        self.pack = pack

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        return packed_mm(flat, self.pack)


def fused_op(owner: nn.Module, mods: tuple[nn.Module, ...], x: torch.Tensor):
    """The cached callable `fused` multiplies x's rows with (a `Fused`, or a fused module such as a
    Q4Linear), or None where the projections do not fuse for x."""
    if torch.is_grad_enabled() or x.device.type != "cpu":
        return None
    first = mods[0]
    if type(first) is Linear:  # exactly: subclasses (a quantised LM head) keep their own path
        if not first._packable(x) or any(type(m) is not Linear or m.bias is not None or m.weight.dtype != x.dtype for m in mods):
            return None
        key = tuple((m.weight.data_ptr(), m.weight._version) for m in mods)

        def build():
            return Fused(pack_weight(torch.cat([m.weight.detach() for m in mods])))

    elif hasattr(type(first), "fuse") and all(type(m) is type(first) for m in mods):
        key = tuple(id(m) for m in mods)

        def build():
            return type(first).fuse(mods)  # e.g. Q4Linear: one module over the members' blocks

    else:
        return None
    cached = owner.__dict__.get("_fused")
    if cached is None or cached[0] != key:
        owner.__dict__["_fused"] = cached = (key, build())
    return cached[1]


class InferenceCaches:
    """Drops a module's cached CPU inference forms (`Linear`'s `_pack`, the fused projections' `_fused`,
    `TargetModel`'s decoder-stack weights `_stack`) when it is copied or pickled: they are rebuilt on first
    use, and oneDNN's packed tensors cannot be copied (`copy.deepcopy` of a model that has run on the CPU,
    say to move the copy to a GPU, failed on them)."""

    _CACHES = ("_pack", "_pack_key", "_fused", "_stack", "_stack_params")

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in self._CACHES}


class Linear(InferenceCaches, nn.Linear):
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
            out = packed_mm(flat, self._packed(), self.bias)
        else:
            out = F.linear(flat, self.weight, self.bias)
        return out.view(*x.shape[:-1], out.shape[-1])  # [..., out]

    def _packable(self, x: torch.Tensor) -> bool:
        """Inference on CPU in the weight's dtype, and not under autocast (whose casts F.linear applies)."""
        if torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != self.weight.dtype:
            return False
        return not torch.is_autocast_enabled("cpu") and self._packs()

    def _packs(self) -> bool:
        """Whether this weight has a packed CPU form at all (CPU, a dtype oneDNN runs here)."""
        return self.weight.device.type == "cpu" and self.weight.dtype in PACKED_DTYPES

    def _packed(self) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype)
        if self.__dict__.get("_pack_key") != key:
            self.__dict__["_pack"] = pack_weight(w, self.bias)
            self.__dict__["_pack_key"] = key
        return self.__dict__["_pack"]


def prepack(*modules: nn.Module) -> None:
    """Build the packed inference weights of every CPU `Linear` now (fused q/k/v and gate/up where they
    fuse), where the load happens (a drafter loaded by the hot-swap thread), not in the first engine step
    that uses them; likewise the norm/rotary kernel (compiled once per machine, 30-40 s) for a model with
    CPU norms."""
    for module in modules:
        members = set()
        with torch.no_grad():
            for m in module.modules():
                group = m.same_input() if isinstance(m, (Attention, MLP)) else ()
                dtype = getattr(getattr(group[0], "weight", None), "dtype", torch.float32) if group else None
                if group and fused(m, group, torch.zeros(1, group[0].in_features, dtype=dtype)) is not None:
                    members.update(id(g) for g in group)  # called fused from now on: no packed copy of their own
        for m in module.modules():
            if isinstance(m, Linear) and m._packs() and id(m) not in members:
                m._packed()
            elif isinstance(m, RMSNorm) and m.weight.device.type == "cpu":
                norm_rope_cpu.load()


def frozen_linear(weight: torch.Tensor) -> Linear:
    """A bias-free `Linear` around an existing frozen weight [out, in] (not registered anywhere)."""
    lin = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return lin


class MLP(InferenceCaches, nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def same_input(self) -> tuple[nn.Module, ...]:
        """The projections of one input, which `fused` may run as one matmul."""
        return self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = fused(self, self.same_input(), x)
        if gu is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        g, u = gu.split(self.gate_proj.out_features, dim=-1)
        return self.down_proj(F.silu(g) * u)


class Attention(InferenceCaches, nn.Module):
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
        return self._heads_kv(self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim), self.v_proj(x), cos, sin)

    def _heads_kv(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t = k.shape[:2]
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = v.reshape(b, t, self.n_kv_heads, self.head_dim)
        return rotary_heads(k, cos, sin), v.transpose(1, 2)  # [B, Hkv, T, D] each

    def same_input(self) -> tuple[nn.Module, ...]:
        """The projections of one input, which `fused` may run as one matmul."""
        return self.q_proj, self.k_proj, self.v_proj

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`project_q` and `project_kv` of the same x, in one matmul where they fuse (`fused`) -> q [B, H, T, D],
        k, v [B, Hkv, T, D]. Every forward that projects q, k and v of one input calls this."""
        qkv = fused(self, self.same_input(), x)
        if qkv is None:
            return self.project_q(x, cos, sin), *self.project_kv(x, cos, sin)
        b, t, _ = x.shape
        q, k, v = qkv.split([self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features], dim=-1)
        q = q.reshape(b, t, self.n_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return rotary_heads(q, cos, sin), *self._heads_kv(k.reshape(b, t, self.n_kv_heads, self.head_dim), v, cos, sin)

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

    def stack_weights(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """The weights kernels/stack_cpu.cpp runs this layer with for input x, or None where it does not take the
        layer (norms not in x's dtype, weights in neither form below). On AMX tiles (bfloat16) or through oneDNN
        (float32) six (input norm, fused q/k/v, o, post-attention norm, fused gate/up, down: AMX tiles or oneDNN's
        blocked weights); on the q4 kernel fourteen (input norm, (packed, d, m) of the fused q/k/v and of o,
        post-attention norm, (packed, d, m) of the fused gate/up and of down; bfloat16 or float32); then the q and
        k norms where the layer has them (the drafter's). The fused
        forms are those `fused` and `Linear.forward` multiply with, so both paths use the same weights."""
        attn, mlp = self.self_attn, self.mlp
        norms = [self.input_layernorm.weight, self.post_attention_layernorm.weight]
        qk = [attn.q_norm.weight, attn.k_norm.weight] if attn.q_norm is not None else []  # after the rest, where the layer has them
        if x.dtype not in (torch.bfloat16, torch.float32) or any(w.dtype != x.dtype for w in norms + qk):
            return None
        qkv, gu = fused_op(attn, attn.same_input(), x), fused_op(mlp, mlp.same_input(), x)
        q4 = [getattr(m, "q4_weights", None) for m in (qkv, attn.o_proj, gu, mlp.down_proj)]  # quant.Q4Linear's
        if all(q4):
            w = [f() for f in q4]
            return [norms[0], *w[0], *w[1], norms[1], *w[2], *w[3], *qk]
        if not (isinstance(qkv, Fused) and isinstance(gu, Fused)):
            return None
        outs = [attn.o_proj, mlp.down_proj]
        if any(type(m) is not Linear or m.bias is not None or not m._packable(x) for m in outs):
            return None
        packs = [qkv.pack, outs[0]._packed(), gu.pack, outs[1]._packed()]
        if x.dtype == torch.bfloat16 and all(isinstance(p, amx_cpu.Packed) for p in packs):
            return [norms[0], packs[0].tiles, packs[1].tiles, norms[1], packs[2].tiles, packs[3].tiles, *qk]
        # float32 through oneDNN: the C++ loop runs `_one_call` (`stacked_layers` hands it PAD_ROWS and MIN_ROWS)
        if x.dtype == torch.float32 and all(isinstance(p, torch.Tensor) and p.is_mkldnn for p in packs):
            return [norms[0], packs[0], packs[1], norms[1], packs[2], packs[3], *qk]
        return None


def stacked_layers(owner: nn.Module, layers, x: torch.Tensor, batch, cos: torch.Tensor, sin: torch.Tensor, eps: float, features=()):
    """`layers` (DecoderLayers of `owner`, the target or the drafter) over the packed rows x [N, H] of a ragged
    batch (kvcache.Ragged) in one C++ call (kernels/stack_cpu.py), with the Python layer loop's bits, where every
    layer and the pool fit it (bfloat16 weights on AMX tiles, float32 weights through oneDNN, or q4 weights with
    bfloat16 or float32 activations; the attention kernel)
    -> (x [N, H] after the last layer, the outputs of the layers in `features` side by side [N, n*H]), else None.
    cos, sin [1, 1, N, D]: the rows' rotary tables."""
    if not batch.kernel or batch.pool.dtype != x.dtype or (ext := stack_cpu.load()) is None:
        return None
    if (weights := _stack_weights(owner, layers, x, DecoderLayer.stack_weights)) is None:
        return None
    a, pool = layers[0].self_attn, batch.pool
    return ext.forward_layers(
        x, weights, cos, sin, pool.k, pool.v, batch.tok_slot, batch.tok_pos, batch.req, batch.tree_bits, *batch.ctx,
        a.n_heads, a.n_kv_heads, eps, a.head_dim**-0.5, attention_cpu.amx_scores(pool.k[0]), list(features), PAD_ROWS, MIN_ROWS,
    )  # fmt: skip


def stacked_kv(owner: nn.Module, layers, ctx: torch.Tensor, pool, rows, slots, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> bool:
    """A drafter's context extension (`Drafter.extend_many`: every layer's k and v projections of ctx [N, H], the k
    norm, RoPE on k, K/V written into `pool` at `rows`, `slots` [N]) in one C++ call (kernels/stack_cpu.py), with the
    Python loop's bits, where every layer's k and v projections are on the q4 kernel and the pool is in ctx's dtype
    -> whether it ran. cos, sin [1, 1, N, D]."""
    if torch.is_grad_enabled() or ctx.device.type != "cpu" or pool.dtype != ctx.dtype or (ext := stack_cpu.load()) is None:
        return False
    if (weights := _stack_weights(owner, layers, ctx, _kv_weights)) is None:
        return False
    a = layers[0].self_attn
    ext.extend_layers(ctx, weights, cos, sin, pool.k, pool.v, rows, slots, a.n_kv_heads, eps)
    return True


def _kv_weights(layer: DecoderLayer, x: torch.Tensor) -> list[torch.Tensor] | None:
    """A layer's weights for `stacked_kv`: (packed, d, m) of its k and v projections, then its k norm where it has
    one; None unless both are on the q4 kernel (quant.Q4Linear) and the norm is in x's dtype."""
    attn = layer.self_attn
    q4 = [getattr(m, "q4_weights", None) for m in (attn.k_proj, attn.v_proj)]
    norm = [attn.k_norm.weight] if attn.k_norm is not None else []
    if x.dtype not in (torch.bfloat16, torch.float32) or not all(q4) or any(w.dtype != x.dtype for w in norm):
        return None
    return [*q4[0](), *q4[1](), *norm]


def _stack_weights(owner: nn.Module, layers, x: torch.Tensor, weights_of) -> list[torch.Tensor] | None:
    """Every layer's `weights_of(layer, x)` (`DecoderLayer.stack_weights`, `_kv_weights`) side by side, cached on `owner`
    per function (30 layers' checks took 2 ms of a 33 ms step) until a weight changes in place or a parameter is
    assigned anywhere (`weights_epoch`)."""
    params = owner.__dict__.get("_stack_params") or list(owner.parameters())
    key = (x.dtype, weights_epoch(), tuple((p.data_ptr(), p._version) for p in params))
    cache, kind = owner.__dict__.setdefault("_stack", {}), weights_of.__name__
    if kind not in cache or cache[kind][0] != key:
        per = [weights_of(layer, x) for layer in layers]
        weights = None if any(w is None for w in per) or len({len(w) for w in per}) != 1 else [t for w in per for t in w]
        owner.__dict__["_stack_params"] = list(owner.parameters())
        cache[kind] = (key, weights)
    return cache[kind][1]
