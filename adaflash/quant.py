"""Weight-only quantised Linear layers for the target on CPU: fewer weight bytes read per step.

Three formats, two on PyTorch's CPU weight-only kernels and one on ours:
- int4 (`_weight_int4pack_mm_for_cpu`, asymmetric, groups of 32 along the input): rebuilt from the
  GGUF's own Q4_1 blocks (4-bit q, fp16 scale d and minimum m per 32 weights, w = d*q + m), so the
  values are the file's and not a re-quantisation of the float copy. The kernel computes
  w = (q - 8) * scale + zero with scale and zero in the activation dtype; we store scale = d and
  zero = m + 8d. In float32 both are exact (m + 8d fits float32's 24 bits unless d and m differ in
  magnitude by more than ~2^13: no block of SmolLM2 does), (q - 8) * d is exact and one rounding of
  d*q + m follows, as in the dequantised copy: the int4 weights equal the float32 target's bit for
  bit. In bfloat16 scale and zero are rounded to 8 significant bits (the fp16 d and m have 11).
  Tensors of another GGUF type (SmolLM2's Q8_0 embedding, tied to the LM head) stay in float.
- q4 (kernels/q4_cpu.py, our kernel): the same Q4_1 blocks times int8-quantised activations (one step
  per row and 32 inputs), in integer dot products (AVX-512 VNNI where the CPU has it): llama.cpp's
  arithmetic for this file. Row-invariant by construction, and faster than the int4 kernel at every row
  count measured (it unpacks each weight group once per 4 rows); the activations' rounding makes it another model
  than the float one, with its own plain decoding as the greedy reference. The LM head runs on the same
  kernel from the file's Q8_0 blocks (`Q8Head`: SmolLM2's embedding, tied to the head), reading half
  the bytes of bfloat16, except on CPUs with AMX, where oneDNN's bfloat16 head is faster; embedding
  lookups keep the float copy.
- int8 (`_weight_int8pack_mm`, one scale per output channel): a symmetric re-quantisation of the
  float weights (round(w / s), s ~ max|w| / 127), so the weights differ from the file's (any target).

`quantise_target` swaps the target's projection `Linear`s for these modules in place; the forward
code is unchanged (a module call either way). `quantise_drafter` does the same for a loaded drafter with
q4 blocks quantised from its own float weights (no GGUF has them): its drafts need not be exact, and its
pass reads its weights from memory every step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from adaflash.kernels import q4_cpu
from adaflash.layers import Linear

GROUP = 32  # Q4_1 block size = the int4 kernel's group size
Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
Q8_0_BYTES = 34  # fp16 d, 32 int8
PROJECTIONS = {  # GGUF tensor name in block i -> submodule path in the target's layer i
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
WEIGHT_FORMATS = ("int4", "q4", "int8")


def q4_1_unpack(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 rows as stored in a GGUF (uint8 [N, K/32*20]) -> q (uint8 [N, K], 0..15), d and m
    (float16 [N, K/32]). In a block the low nibbles hold elements 0..15, the high ones 16..31."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, Q4_1_BYTES)  # [N, K/32, 20]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # [N, K/32]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    nib = blocks[..., 4:]  # [N, K/32, 16]
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1)  # [N, K/32, 32]
    return q.reshape(n, -1), d, m


def q4_1_pack(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Inverse of `q4_1_unpack`: the GGUF's Q4_1 bytes (uint8 [N, K/32*20])."""
    n = q.shape[0]
    qb = q.reshape(n, -1, 2, GROUP // 2).astype(np.uint8)  # [N, K/32, 2, 16]
    nib = qb[:, :, 0] | (qb[:, :, 1] << 4)  # [N, K/32, 16]
    dm = np.stack([d.astype(np.float16), m.astype(np.float16)], axis=-1).view(np.uint8)  # [N, K/32, 4]
    return np.concatenate([dm, nib], axis=-1).reshape(n, -1)


def q4_1_quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float weights [N, K] -> Q4_1 blocks as llama.cpp quantises them (the `gguf` package's rounding, bit for
    bit): per 32 inputs, in float32, d = (max - min) / 15 and q = trunc((w - min) / d + 0.5) clipped to
    0..15 (0 where d = 0), then d and m = min stored as float16 -> (q uint8 [N, K], d, m float16 [N, K/32])."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // GROUP, GROUP)  # [N, K/32, 32]
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)  # [N, K/32, 1]
    d = (hi - lo) / 15
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = ((g - lo) * inv + 0.5).floor().clamp(0, 15).to(torch.uint8)  # [N, K/32, 32] (>= 0: trunc = floor)
    return q.reshape(n, k), d[..., 0].half(), lo[..., 0].half()


def q8_0_unpack(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 rows as stored in a GGUF (uint8 [N, K/32*34]) -> s (int8 [N, K]) and d (float16 [N, K/32]): w = d*s."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, Q8_0_BYTES)  # [N, K/32, 34]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # [N, K/32]
    return blocks[..., 2:].copy().view(np.int8).reshape(n, -1), d


def _q4_kernel():
    """The q4 kernel's extension; where it cannot be built the q4 dtype cannot be made."""
    kernel = q4_cpu.load()
    if kernel is None:
        raise RuntimeError("the q4 kernel could not be built here (see the warning above): use int4, bfloat16 or float32")
    return kernel


class Int4Linear(nn.Module):
    """Bias-free y = x @ w.T with w = d*q + m per group of 32 inputs, on the CPU int4 kernel.

    q: int [N, K] in 0..15; d, m: [N, K/32]; `dtype` is the activation dtype (float32 or bfloat16),
    in which the kernel also keeps scale and zero."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        n, k = q.shape
        if k % GROUP or d.shape != (n, k // GROUP) or m.shape != d.shape:
            raise ValueError(f"int4 weights need K a multiple of {GROUP}, one d and m per group: q {tuple(q.shape)}, d {tuple(d.shape)}")
        self.in_features, self.out_features, self.dtype = k, n, dtype
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)  # [N, K/2] uint8
        self.register_buffer("packed", packed)
        d, m = d.float(), m.float()
        self.register_buffer("scale_zero", torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous().to(dtype))  # [K/32, N, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # [M, K]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scale_zero)  # [M, N]
        return out.view(*x.shape[:-1], self.out_features)

    def dequantised(self) -> torch.Tensor:
        """The weight the kernel multiplies with, [N, K] float32 (what an identity input returns)."""
        eye = torch.eye(self.in_features, dtype=self.dtype)
        return self(eye).float().T.contiguous()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {GROUP}, {self.dtype}"


class Q4Linear(nn.Module):
    """Bias-free y = x @ w.T with w = d*q + m per group of 32 inputs, x rounded to int8 per row and 32
    inputs, on our row-invariant kernel (kernels/q4_cpu.py). q: int [N, K] in 0..15; d, m: [N, K/32]."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
        super().__init__()
        kernel = _q4_kernel()
        packed, dp, mp = q4_cpu.pack(q, d, m)
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.register_buffer("packed", packed)  # [N/16, K/32, 256] uint8
        self.register_buffer("d", dp)  # [N/16, K/32, 16] float32
        self.register_buffer("m", mp)
        self._kernel = kernel.q4_linear  # called directly: 210 calls a step, Python overhead counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, self.packed, self.d, self.m)  # [..., N] in x's dtype

    def q4_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed, d, m) as the kernel takes them: what kernels/stack_cpu.cpp multiplies with (`DecoderLayer.stack_weights`)."""
        return self.packed, self.d, self.m

    @staticmethod
    def fuse(mods: tuple[Q4Linear, ...]) -> Q4Linear:
        """One module over the members' outputs side by side (`layers.fused`): their packed blocks
        concatenated (blocks of 16 outputs are computed independently: the same bits), the members'
        buffers then views into it (no second copy)."""
        out = Q4Linear.__new__(Q4Linear)
        nn.Module.__init__(out)
        out.in_features, out.out_features, out._kernel = mods[0].in_features, sum(m.out_features for m in mods), mods[0]._kernel
        for name in ("packed", "d", "m"):
            whole = torch.cat([getattr(m, name) for m in mods])  # [sum N/16, K/32, ...]
            out.register_buffer(name, whole)
            for m, part in zip(mods, whole.split([m.out_features // q4_cpu.BLOCK for m in mods])):
                setattr(m, name, part)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q4_1 x int8 activations, group {GROUP}"


class Q8Head(Linear):
    """The LM head on the q4 kernel from a GGUF's Q8_0 blocks (w = d*s, s in -127..127 per 32 inputs):
    the kernel's 8-bit form w = d*q + m with q = s + 128 and m = -128 d, inputs rounded to int8 per row
    and 32 as in `Q4Linear` (row-invariant). It keeps the float `weight` it replaces (tied to the
    embedding: lookups, the drafter's draft-vocabulary rows, training); a call with autograd on or
    off the CPU is the plain float matmul."""

    def __init__(self, weight: nn.Parameter, s: torch.Tensor, d: torch.Tensor):
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        kernel = _q4_kernel()
        if s.shape != weight.shape:
            raise ValueError(f"Q8_0 head {tuple(s.shape)} does not match the LM head {tuple(weight.shape)}")
        self.weight = weight
        d = d.float()
        packed, dp, mp = q4_cpu.pack((s.to(torch.int16) + 128).to(torch.uint8), d, -128 * d, bits=8)
        self.register_buffer("packed", packed, persistent=False)  # [N/16, K/32, 512] uint8
        self.register_buffer("d", dp, persistent=False)  # [N/16, K/32, 16] float32
        self.register_buffer("m", mp, persistent=False)
        self._kernel = kernel.q4_linear

    def _packs(self) -> bool:
        return False  # no oneDNN copy: inference goes to the kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
            return super().forward(x)
        return self._kernel(x, self.packed, self.d, self.m)  # [..., N] in x's dtype

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q8_0 x int8 activations, group {GROUP}"


class Int8Linear(nn.Module):
    """Bias-free y = x @ (q * s).T with q int8 [N, K] and one scale s per output channel [N]."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        w = weight.detach().float()  # [N, K]
        # The kernel takes the scale in the activation dtype: round it there first (up, so max|w| still
        # fits in 127 steps), then quantise against the rounded scale: every weight within half a step.
        scale = (w.abs().amax(dim=1) / 127 * (1 + 2**-7)).clamp(min=torch.finfo(torch.bfloat16).tiny).to(dtype)  # [N]
        self.in_features, self.out_features, self.dtype = w.shape[1], w.shape[0], dtype
        self.register_buffer("qweight", (w / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8))  # [N, K]
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # [M, K]
        out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scale)  # [M, N]
        return out.view(*x.shape[:-1], self.out_features)

    def dequantised(self) -> torch.Tensor:
        """The weight the kernel multiplies with, [N, K] float32."""
        return self.qweight.float() * self.scale.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel, {self.dtype}"


def rope_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """GGUF row for each HF row of a q/k projection: llama.cpp stores each head's rotary pairs
    interleaved (2i, 2i+1), HF in halves (i, D/2 + i); HF row h*D + j*D/2 + i is GGUF row h*D + 2i + j."""
    dim = n_rows // n_heads
    h, rest = np.divmod(np.arange(n_rows), dim)
    j, i = np.divmod(rest, dim // 2)
    return h * dim + 2 * i + j


def gguf_q4_1(gguf: Path, num_heads: int, num_kv_heads: int) -> tuple[dict[str, tuple[np.ndarray, ...]], dict[str, str]]:
    """The Q4_1 projections of a GGUF as {HF module path: (q, d, m)} in HF row order, and
    {GGUF tensor name: type} of every tensor left in float (other types, non-projections). llama.cpp
    interleaves q/k rows only for the `llama` architecture (transformers undoes it for that one alone)."""
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(gguf))
    interleaved = reader.fields["general.architecture"].contents() == "llama"
    found, kept = {}, {}
    for t in reader.tensors:
        parts = t.name.split(".")  # blk.{i}.{kind}.weight
        proj = PROJECTIONS.get(parts[2]) if len(parts) == 4 and parts[0] == "blk" else None
        if proj is None or t.tensor_type != GGMLQuantizationType.Q4_1:
            kept[t.name] = t.tensor_type.name
            continue
        q, d, m = q4_1_unpack(np.asarray(t.data))
        if interleaved and parts[2] in ("attn_q", "attn_k"):
            rows = rope_rows(q.shape[0], num_heads if parts[2] == "attn_q" else num_kv_heads)
            q, d, m = q[rows], d[rows], m[rows]
        found[f"model.layers.{parts[1]}.{proj}"] = (q, d, m)
    return found, kept


def gguf_q8_0_head(gguf: Path, tied: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """(s, d) of the GGUF's LM head when stored as Q8_0: `output.weight`, or the embedding `token_embd.weight`
    where the model ties the two (`tied`); None otherwise."""
    from gguf import GGMLQuantizationType, GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(gguf)).tensors}
    t = tensors.get("output.weight") or (tensors.get("token_embd.weight") if tied else None)
    if t is None or t.tensor_type != GGMLQuantizationType.Q8_0:
        return None
    return q8_0_unpack(np.asarray(t.data))


def amx() -> bool:
    """Whether this CPU has AMX tiles: oneDNN's bfloat16 matmul runs on them, and SmolLM2's bf16 LM head is
    then faster than the Q8_0 one (1.8 vs 2.1 ms a row on a Xeon; on an AVX-512 EPYC bf16 took 4.8)."""
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False


def q4_is_fast(device: torch.device | str = "cpu") -> bool:
    """Whether a q4 drafter is the fast one here: a CPU with AVX-512 VNNI (the kernel's integer dot products)
    and no AMX (where oneDNN's bfloat16 runs on tiles; not measured), the kernel built: where it was measured
    faster than a bfloat16 drafter at every concurrency (docs/benchmarks.md)."""
    from adaflash.target import cpu_flags

    return torch.device(device).type == "cpu" and "avx512_vnni" in cpu_flags() and not amx() and q4_cpu.load() is not None


def quantise_target(model: nn.Module, fmt: str, gguf: Path | None = None, q8_head: bool | None = None) -> dict:
    """Swap the target's projection Linears for `fmt` ("int4" or "q4" from `gguf`'s Q4_1 blocks, "int8"
    from the loaded float weights) in the model's dtype, in place, and for q4 the LM head for a `Q8Head`
    where the file stores it as Q8_0 and `q8_head` (None: where the CPU has no AMX); -> a summary of what
    was converted and what stayed float."""
    dtype = model.lm_head.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{fmt} weights run with float32 or bfloat16 activations, not {dtype}")
    paths = [f"model.layers.{i}.{p}" for i in range(len(model.model.layers)) for p in PROJECTIONS.values()]
    if fmt == "int8":
        for path in paths:
            _swap(model, path, Int8Linear(model.get_submodule(path).weight, dtype))
        return {"format": "int8", "converted": len(paths), "float": ["embedding", "LM head", "norms"]}
    if fmt not in ("int4", "q4"):
        raise ValueError(f"weight format must be one of {', '.join(WEIGHT_FORMATS)}; got {fmt!r}")
    if gguf is None:
        raise ValueError(f"{fmt} weights are rebuilt from a GGUF's Q4_1 blocks: load the target from 'smollm2' or a .gguf file")
    c = model.config
    blocks, kept = gguf_q4_1(gguf, c.num_heads, c.num_kv_heads)
    if not blocks:
        raise ValueError(f"{gguf.name} has no Q4_1 projections (types: {sorted(set(kept.values()))}): use int8 or a float dtype")
    for path, (q, d, m) in blocks.items():
        q, d, m = torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m)
        _swap(model, path, Int4Linear(q, d, m, dtype) if fmt == "int4" else Q4Linear(q, d, m))
    float_projections = [p for p in paths if p not in blocks]
    head = None
    if fmt == "q4" and (not amx() if q8_head is None else q8_head):
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        if (found := gguf_q8_0_head(gguf, tied)) is not None:
            model.lm_head = Q8Head(model.lm_head.weight, *(torch.from_numpy(a) for a in found))
            head = "Q8_0"
    return {"format": fmt, "converted": len(blocks), "float_projections": float_projections, "float_tensors": kept, "head": head}


def quantise_drafter(drafter: nn.Module) -> int:
    """Swap a loaded drafter's projections (its layers' q/k/v/o and MLP, and the feature fusion `fc`) for
    `Q4Linear`s quantised from their float weights (`q4_1_quantise`), in place, where their shapes fit the
    kernel (outputs in 16s, inputs in 32s; others stay float). Inference only: the quantised drafter has
    no float copy to train or export. -> projections converted. On a 2-core AVX-512 EPYC one request's pass
    took 3.9 ms against bfloat16's 5.9 (docs/benchmarks.md), acceptance unchanged."""
    _q4_kernel()
    paths = ["fc"] + [f"layers.{i}.{p}" for i in range(len(drafter.layers)) for p in PROJECTIONS.values()]
    done = 0
    for path in paths:
        old = drafter.get_submodule(path)
        if type(old) is not Linear or old.bias is not None or old.out_features % q4_cpu.BLOCK or old.in_features % GROUP:
            continue
        _swap(drafter, path, Q4Linear(*q4_1_quantise(old.weight)))
        done += 1
    return done


def weight_format(model: nn.Module) -> str:
    """How the model's projections are stored: "int4", "q4", "int8" or "float"."""
    for m in model.modules():
        if isinstance(m, Int4Linear):
            return "int4"
        if isinstance(m, Q4Linear):
            return "q4"
        if isinstance(m, Int8Linear):
            return "int8"
    return "float"


def model_form(model: nn.Module) -> str:
    """The model's activation dtype and, for quantised projections, their format: "torch.float32",
    "torch.bfloat16+q4" (what a step-cost calibration depends on, and what a bench report names)."""
    fmt = weight_format(model)
    return str(model.dtype) + ("" if fmt == "float" else f"+{fmt}")


def _swap(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    old = model.get_submodule(path)
    if (old.out_features, old.in_features) != (module.out_features, module.in_features):
        shape = f"{module.out_features}x{module.in_features}"
        raise ValueError(f"{path}: quantised weight {shape} does not match {old.out_features}x{old.in_features}")
    setattr(model.get_submodule(parent), name, module)
