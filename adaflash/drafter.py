"""DFlash-style block-diffusion drafter: one forward pass proposes a whole block of tokens.

Conditioning on the target (KV injection): the hidden states of a few target layers are concatenated,
fused by `fc` + RMSNorm into context features, and every drafter layer projects them through its own
k/v projections. These context keys/values sit in front of the block's own keys/values; queries come
from block tokens only, so the context never enters the residual stream. The block is
[last committed token, MASK x (K-1)], attention inside it is bidirectional, and the target's own
(frozen, shared, not saved) embedding and LM head turn block positions 1..K-1 into K-1 draft tokens.
The drafter's cache keeps context K/V only; the block's K/V are recomputed each round.

Draft vocabulary: drafts may come from a subset of the target's vocabulary (the tokens the target
actually emits, `adaflash draft-vocab`), stored beside the weights as `draft_vocab.safetensors`. The
LM head is then those rows of the target's head only (SmolLM2: 8,192 of 49,152 rows); on a CPU the
full head is a large part of drafting. Verification still uses the target's full vocabulary, so output is
unchanged (greedy) or still the target's distribution (sampling: q is zero outside the subset); a
token outside the subset just cannot be drafted. Training computes those rows only too
(`loss.vocab`, adaflash/recipe.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from adaflash.kvcache import KVCache, KVPool, Ragged, packed_slots, pool_of
from adaflash.layers import DecoderLayer, Linear, RMSNorm, Rotary, frozen_linear, prepack, stacked_kv, stacked_layers
from adaflash.length_head import LengthHead, has_length_head, load_length_head
from adaflash.spec import greedy
from adaflash.target import TargetModel

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
DRAFT_VOCAB = "draft_vocab.safetensors"  # optional: {"ids": int64 [Vd]} sorted full-vocabulary ids

DEFAULT_DRAFTER = Path(__file__).resolve().parent.parent / "models" / "drafter-smollm2"  # the committed drafter


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int  # drafter depth (the target's own depth is in `target`)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    target_layer_ids: list[int]  # target layers whose outputs are fused into context features
    block_size: int = 16  # anchor + (block_size - 1) drafted tokens
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    qk_norm: bool = True
    mask: str = "learned"  # the MASK slot is a learned embedding (the vocabulary need not reserve a token)
    target: dict = field(default_factory=dict)  # identity of the target it was trained for

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + at least one draft), got {self.block_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if self.mask != "learned":
            raise ValueError(f"mask must be 'learned', got {self.mask!r}")

    @classmethod
    def for_target(
        cls, target: TargetModel, identity: dict, num_layers: int = 3, block_size: int = 16, qk_norm: bool = True
    ) -> "DrafterConfig":
        """A drafter in the target's own style and width, conditioned on the target's feature layers."""
        c = target.config
        return cls(
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=num_layers,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            target_layer_ids=list(target.feature_layers),
            block_size=block_size,
            rope_theta=c.rope_theta,
            rms_norm_eps=c.rms_norm_eps,
            qk_norm=qk_norm,
            target=dict(identity),
        )


class Drafter(nn.Module):
    def __init__(self, config: DrafterConfig, target: TargetModel):
        super().__init__()
        self.config = config
        n_feat = len(config.target_layer_ids)
        self.fc = Linear(n_feat * config.hidden_size, config.hidden_size, bias=False)  # packed on CPU inference
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        c = config
        self.layers = nn.ModuleList(
            DecoderLayer(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.qk_norm, c.rms_norm_eps)
            for _ in range(c.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.randn(config.hidden_size) * 0.02)
        self.rotary = Rotary(config.head_dim, config.rope_theta)
        self.vocab: torch.Tensor | None = None  # [Vd] full ids of the draft vocabulary; None = all
        self.attach(target)

    def attach(self, target: TargetModel, dtype: torch.dtype | None = None) -> None:
        """Share the target's frozen embedding and LM head (kept out of this module's parameters).
        With a `dtype` other than the target's (a bf16 drafter beside an fp32 target: drafts need
        not be exact, verification is), one frozen copy in that dtype is made instead."""
        if target.config.hidden_size != self.config.hidden_size:
            raise ValueError(f"drafter width {self.config.hidden_size} != target width {target.config.hidden_size}")
        if list(target.feature_layers) != list(self.config.target_layer_ids):
            raise ValueError(f"target exposes layers {target.feature_layers}, drafter needs {self.config.target_layer_ids}")
        embed, head = target.model.embed_tokens, target.lm_head
        if dtype is not None and dtype != target.dtype:
            head_w = head.weight.detach().to(dtype)
            emb_w = head_w if embed.weight is head.weight else embed.weight.detach().to(dtype)
            embed, head = (lambda ids: F.embedding(ids, emb_w)), frozen_linear(head_w)
        self.__dict__["embed"] = embed
        self.__dict__["lm_head"] = head
        self.__dict__["target_config"] = target.config  # what an export in the DFlash format records
        self.vocab_size = target.config.vocab_size
        self.set_vocab(self.vocab)

    def set_vocab(self, ids: torch.Tensor | None) -> None:
        """Draft from the full-vocabulary ids `ids` [Vd] only (None: from the whole vocabulary).
        `draft_head` is then a frozen copy of those rows of the shared LM head."""
        if ids is not None:
            ids = torch.as_tensor(ids, dtype=torch.long).flatten()
            v = self.vocab_size
            if ids.numel() == 0 or bool((ids < 0).any() or (ids >= v).any()) or bool((ids[1:] <= ids[:-1]).any()):
                raise ValueError(
                    f"a draft vocabulary must be sorted, unique, non-empty ids in [0, {v}), "
                    f"got {ids.numel()} ids: rebuild it with `adaflash draft-vocab`"
                )
            ids = ids.to(self.lm_head.weight.device)
        self.vocab = ids
        head = self.lm_head
        self.__dict__["draft_head"] = head if ids is None else frozen_linear(head.weight.detach()[ids].contiguous())

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms' weights: the projections may be q4, `adaflash.quant.quantise_drafter`)."""
        return self.hidden_norm.weight.dtype

    def new_pool(self, rows: int = 0) -> KVPool:
        """An empty KV pool for this drafter's batch-1 caches (an engine keeps one per drafter version, for `rows`
        requests at once)."""
        c, w = self.config, self.hidden_norm.weight
        return KVPool(c.num_layers, c.num_kv_heads, c.head_dim, w.dtype, w.device, rows)

    def new_cache(self, batch: int = 1, capacity: int = 256) -> KVCache:
        """batch 1: a row of this drafter's shared KV pool (what `draft_many` batches over); else a padded batch cache."""
        if batch == 1:
            return pool_of(self).take(capacity)
        c, w = self.config, self.hidden_norm.weight
        return KVCache(c.num_layers, batch, c.num_kv_heads, c.head_dim, w.dtype, capacity, w.device)

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """[B, T, n*H] target-layer features -> [B, T, H] context features."""
        return self.hidden_norm(self.fc(feats.to(self.dtype)))

    def block_input(self, anchor_tokens: torch.Tensor, length: int | None = None) -> torch.Tensor:
        """[...] anchor ids -> [..., L, H] embeddings of [anchor, MASK x (L-1)], L = length or K."""
        first = self.embed(anchor_tokens).to(self.mask_embedding.dtype)[..., None, :]
        masks = self.mask_embedding.expand(*anchor_tokens.shape, (length or self.block_size) - 1, -1)
        return torch.cat([first, masks], dim=-2)

    @torch.no_grad()
    def extend_context(self, feats: torch.Tensor, cache: KVCache, valid: torch.Tensor | None = None) -> None:
        """Append newly committed tokens' target features [B, T, n*H] to the context K/V cache."""
        b, t, _ = feats.shape
        if t == 0:
            return
        if valid is None:
            valid = torch.ones(b, t, dtype=torch.bool, device=feats.device)
        ctx = self.fuse(feats)  # [B, T, H]
        start, positions = cache.append(valid)  # positions: [B, T]
        cos, sin = self.rotary(positions, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            cache.k[i][:, :, start : start + t] = k
            cache.v[i][:, :, start : start + t] = v

    @torch.no_grad()
    def draft(self, cache: KVCache, last_token: torch.Tensor, n_logits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over the block. last_token: [B]. Returns (draft logits [B, n, Vd] fp32 over the
        draft vocabulary for block positions 1..n, n = n_logits or K-1; final block hidden states
        [B, K, H] for the length head). Asking only for the drafts that will be verified skips most of
        the LM head."""
        k_blk = self.block_size
        x = self.block_input(last_token)  # [B, K, H]
        positions = cache.next_pos[:, None] + torch.arange(k_blk, device=x.device)  # [B, K]: the anchor sits at next_pos
        cos, sin = self.rotary(positions, x.dtype)
        n = cache.length
        mask = torch.cat([cache.valid[:, :n], torch.ones(x.shape[0], k_blk, dtype=torch.bool, device=x.device)], dim=1)
        mask = mask[:, None, None, :]  # [B, 1, 1, n + K]: all context and the whole block, no causal mask
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, kb, vb = attn.project_qkv(h, cos, sin)
            k = torch.cat([cache.k[i][:, :, :n], kb.to(cache.k[i].dtype)], dim=2)
            v = torch.cat([cache.v[i][:, :, :n], vb.to(cache.v[i].dtype)], dim=2)
            x = x + attn.attend(q, k, v, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        h = self.norm(x)
        return self.logits(h[:, 1 : 1 + (n_logits or k_blk - 1)]), h

    @torch.no_grad()
    def extend_many(self, feats: list[torch.Tensor], caches: list[KVCache]) -> None:
        """Ragged batch of `extend_context`: request i appends feats[i] [T_i, n*H] to its own pooled cache.
        The fusion and k/v projections run once over all requests' tokens packed together, and each
        layer writes them into the pool in one indexed copy."""
        lens = [f.shape[0] for f in feats]
        ctx = self.fuse(torch.cat(feats)[None])  # [1, N, H]
        starts, pos = [], []
        for cache, n in zip(caches, lens):
            start, p = cache.append(torch.ones(1, n, dtype=torch.bool, device=ctx.device))
            starts.append(start)
            pos.append(p)
        pool = caches[0].pool
        rows, slots, _ = packed_slots(caches, starts, lens)  # [N] each
        cos, sin = self.rotary(torch.cat(pos, dim=1), ctx.dtype)
        if stacked_kv(self, self.layers, ctx[0], pool, rows, slots, cos, sin, self.config.rms_norm_eps):
            return  # the same layers in one C++ call (kernels/stack_cpu.py), the same bits
        for li, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)  # [1, Hkv, N, D]
            pool.k[li][rows, :, slots] = k[0].transpose(0, 1).to(pool.dtype)  # [N, Hkv, D]
            pool.v[li][rows, :, slots] = v[0].transpose(0, 1).to(pool.dtype)

    @torch.no_grad()
    def draft_many(self, caches: list[KVCache], last_tokens: torch.Tensor, length: int | None = None) -> torch.Tensor:
        """Ragged batch of `draft`: one block per request, each attending to its own context cache.
        last_tokens [R] -> final block hidden states [R, L, H]. No logits: the engine asks `logits` only
        for the positions it will verify (the LM head over 15 positions costs ~3 target token-forwards).
        `length` L <= K drafts a shorter block [anchor, MASK x (L-1)] when the engine already knows it
        verifies at most L tokens: the block's compute is ~all of the pass (linears over R*L rows;
        at 32 requests 176 ms for L = 16, 75 ms for L = 4), and the first drafts barely change (the
        block is bidirectional, but the masks beyond the verified positions carry no token).
        Attention runs once per layer over the requests' rows of the drafter's KV pool (kvcache.Ragged):
        each block's K/V are written just past its context as scratch (the cache's length does not
        move, so the next append overwrites them) and every block sees its context and itself."""
        k_blk, r = min(length or self.block_size, self.block_size), len(caches)
        x = self.block_input(last_tokens, k_blk)  # [R, L, H]
        dev = x.device
        for c in caches:
            c.reserve(k_blk)  # room for the scratch block (may grow the pool: before the views are read)
        positions = torch.stack([c.next_pos[0] for c in caches])[:, None] + torch.arange(k_blk, device=dev)  # [R, L]
        cos, sin = self.rotary(positions, x.dtype)
        batch = Ragged(caches, [c.length for c in caches], [k_blk] * r, causal=False)
        flat_cos, flat_sin = (t.reshape(1, 1, r * k_blk, -1) for t in (cos, sin))  # [1, 1, R*L, D]
        stacked = stacked_layers(self, self.layers, x.reshape(r * k_blk, -1), batch, flat_cos, flat_sin, self.config.rms_norm_eps)
        if stacked is not None:  # the same layers in one C++ call (kernels/stack_cpu.py), the same bits
            return self.norm(stacked[0].view(r, k_blk, -1))
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, kb, vb = attn.project_qkv(h, cos, sin)  # [R, Hq, L, D], [R, Hkv, L, D] x 2
            q = q.transpose(1, 2).reshape(r * k_blk, attn.n_heads, -1)  # [R*L, Hq, D]
            kb = kb.transpose(1, 2).reshape(r * k_blk, attn.n_kv_heads, -1)  # [R*L, Hkv, D]
            vb = vb.transpose(1, 2).reshape(r * k_blk, attn.n_kv_heads, -1)
            out = batch.attend(attn, li, q, kb, vb).view(r, k_blk, -1)  # [R, L, Hq*D]
            x = x + attn.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft logits for block hidden states h [..., H] -> [..., Vd] fp32 over the draft vocabulary
        (column j is token `vocab[j]`; Vd = V and column j is token j without a draft vocabulary)."""
        return self.draft_head(h).float()

    def draft_ids(self, h: torch.Tensor) -> torch.Tensor:
        """Greedy drafts for block hidden states h [..., H] -> full-vocabulary ids [...]."""
        j = greedy(self.draft_head(h))
        return j if self.vocab is None else self.vocab[j]

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Training forward over many blocks per sequence (DFlash recipe).

        feats [B, T, n*H] target features; tokens [B, T] (right padded); lengths [B];
        anchors [B, NB] anchor positions (-1 = unused slot). Block j of row b sees the context strictly
        before its anchor, all of its own block and nothing of other blocks.
        Returns final hidden states of block positions 1..K-1: [B, NB, K-1, H].
        """
        b, t = tokens.shape
        nb, k_blk = anchors.shape[1], self.block_size
        ctx = self.fuse(feats)  # [B, T, H]
        safe = anchors.clamp(min=0)
        x = self.block_input(torch.gather(tokens, 1, safe)).reshape(b, nb * k_blk, -1)  # [B, NB*K, H]
        dev = tokens.device
        blk_pos = (safe[:, :, None] + torch.arange(k_blk, device=dev)).reshape(b, nb * k_blk)  # [B, NB*K]
        ctx_pos = torch.arange(t, device=dev).expand(b, t)
        cos_b, sin_b = self.rotary(blk_pos, x.dtype)
        cos_c, sin_c = self.rotary(ctx_pos, x.dtype)
        # mask [B, 1, NB*K, T + NB*K]
        block_of = torch.arange(nb, device=dev).repeat_interleave(k_blk)  # [NB*K]
        anchor_q = safe.repeat_interleave(k_blk, dim=1)  # [B, NB*K]
        cols = torch.arange(t, device=dev)[None, None, :]
        sees_ctx = (cols < anchor_q[:, :, None]) & (cols < lengths.to(dev)[:, None, None])
        sees_blk = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
        mask = torch.cat([sees_ctx, sees_blk], dim=2)[:, None]
        for layer in self.layers:
            attn = layer.self_attn
            kc, vc = attn.project_kv(ctx, cos_c, sin_c)
            h = layer.input_layernorm(x)
            q, kb, vb = attn.project_qkv(h, cos_b, sin_b)
            x = x + attn.attend(q, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2), mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        h = self.norm(x).view(b, nb, k_blk, -1)
        return h[:, :, 1:]

    def save(self, out_dir: Path, dtype: torch.dtype = torch.bfloat16, extra: dict | None = None) -> Path:
        """safetensors weights + config.json (block size, target layers, mask handling, target identity)."""
        from safetensors.torch import save_file

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(out_dir / WEIGHTS), metadata={"format": "pt"})
        meta = {"architecture": "DFlashDrafter", "dtype": str(dtype).removeprefix("torch."), **asdict(self.config)}
        meta["n_params"] = sum(p.numel() for p in self.parameters())
        meta["draft_vocab_size"] = None if self.vocab is None else self.vocab.numel()
        meta.update(extra or {})
        if self.vocab is None:
            (out_dir / DRAFT_VOCAB).unlink(missing_ok=True)  # the directory describes exactly this drafter
        else:
            save_file({"ids": self.vocab.cpu().contiguous()}, str(out_dir / DRAFT_VOCAB), metadata={"format": "pt"})
        (out_dir / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
        return out_dir


@torch.no_grad()
def deepen(drafter: Drafter, target: TargetModel, num_layers: int) -> Drafter:
    """A deeper copy of `drafter`: its layers, then new ones that start as copies of its last layer with the
    attention and MLP output projections zeroed, so each passes the residual stream through unchanged and
    the copy drafts exactly what `drafter` does until training moves them (how a deeper drafter continues a
    trained one: `drafter.num_layers` above the init drafter's in a pretrain config)."""
    c = drafter.config
    if num_layers < c.num_layers:
        raise ValueError(f"a drafter of {c.num_layers} layers cannot be deepened to {num_layers}")
    state = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    last = f"layers.{c.num_layers - 1}."
    for i in range(c.num_layers, num_layers):
        for k, v in [(k, v) for k, v in state.items() if k.startswith(last)]:
            zero = k.endswith(("o_proj.weight", "down_proj.weight"))
            state[f"layers.{i}." + k.removeprefix(last)] = torch.zeros_like(v) if zero else v.clone()
    dtype = drafter.dtype
    out = Drafter(replace(c, num_layers=num_layers), target)
    out.load_state_dict(state)
    out = out.to(dtype).train(drafter.training).requires_grad_(drafter.fc.weight.requires_grad)
    out.attach(target, dtype)
    out.set_vocab(drafter.vocab)
    return out


def load_drafter_config(path: Path) -> DrafterConfig:
    meta = json.loads((Path(path) / CONFIG).read_text())
    if meta.get("architecture") != "DFlashDrafter":
        raise ValueError(f"{path}/config.json is not a DFlash drafter config")
    names = DrafterConfig.__dataclass_fields__.keys()
    return DrafterConfig(**{k: v for k, v in meta.items() if k in names})


def check_fits(config: DrafterConfig, identity: dict) -> None:
    """Refuse a drafter trained for another target (different weights, vocabulary or width)."""
    want = config.target
    for key in ("fingerprint", "vocab_size", "hidden_size", "num_layers"):
        if key in want and want[key] != identity.get(key):
            raise ValueError(
                f"drafter was trained for target {want.get('name')} ({key}={want[key]}), "
                f"but the loaded target has {key}={identity.get(key)}: use a drafter trained for this target"
            )


def _read_adaflash(path: Path) -> tuple[DrafterConfig, dict, torch.Tensor | None]:
    """An AdaFlash drafter directory -> (config, state dict, draft vocabulary ids or None)."""
    from safetensors.torch import load_file

    if not (path / CONFIG).exists() or not (path / WEIGHTS).exists():
        raise FileNotFoundError(f"{path} is not a drafter directory (needs {CONFIG} and {WEIGHTS})")
    config = load_drafter_config(path)
    want = json.loads((path / CONFIG).read_text()).get("draft_vocab_size")
    ids = None
    if (path / DRAFT_VOCAB).exists():
        ids = load_file(str(path / DRAFT_VOCAB)).get("ids")
        if ids is None or (want is not None and ids.numel() != want):
            raise ValueError(f"{path}/{DRAFT_VOCAB} does not hold the {want} ids config.json names: rebuild it with `adaflash draft-vocab`")
    elif want:
        raise FileNotFoundError(f"{path}/config.json names a draft vocabulary of {want} tokens but {DRAFT_VOCAB} is missing")
    return config, load_file(str(path / WEIGHTS)), ids


DRAFTER_DTYPES = ("auto", "float32", "bfloat16", "q4")


def resolve_drafter_dtype(name: str | torch.dtype | None, target: TargetModel) -> tuple[torch.dtype, str | None]:
    """A drafter dtype -> (activation dtype, "q4" or None for float projections). None: the target's dtype;
    "q4": Q4_1 projections quantised from the drafter's weights (`adaflash.quant.quantise_drafter`) with
    activations in bf16 where this CPU runs it fast; "auto": that q4 form where `q4_is_fast`, else bf16
    where this CPU or GPU runs it fast, else float32. Drafts need not be exact: verification, in the target's dtype, is."""
    from adaflash.quant import q4_is_fast
    from adaflash.target import resolve_dtype

    if not isinstance(name, str):
        return name or target.dtype, None
    if name not in DRAFTER_DTYPES and name not in ("fp32", "bf16"):
        raise ValueError(f"drafter dtype must be one of {', '.join(DRAFTER_DTYPES)}; got {name!r}")
    if name == "q4" or (name == "auto" and q4_is_fast(target.lm_head.weight.device)):
        return resolve_dtype("auto"), "q4"
    return resolve_dtype(name), None


def drafter_dtype_of(drafter: Drafter) -> str | torch.dtype:
    """What `load_drafter` takes to load another version in this drafter's form: "q4" or its dtype."""
    from adaflash.quant import weight_format

    return "q4" if weight_format(drafter) == "q4" else drafter.dtype


def load_drafter(path: str | Path, target: TargetModel, identity: dict, dtype: str | torch.dtype | None = None) -> Drafter:
    """Load a drafter directory for `target`, in AdaFlash's format or the DFlash checkpoint format
    (adaflash.dflash_format: an export of ours or a z-lab drafter); refuses mismatched targets and
    non-finite weights. `dtype`: see `resolve_drafter_dtype` (None = the target's)."""
    from adaflash.dflash_format import is_dflash_dir, read_dflash

    path = Path(path)
    if is_dflash_dir(path):
        config, state, ids = read_dflash(path, target.model.embed_tokens.weight, identity)
    else:
        config, state, ids = _read_adaflash(path)
    check_fits(config, identity)
    drafter = Drafter(config, target)
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise ValueError(f"drafter {path} has non-finite weights in {bad[:3]}")
    drafter.load_state_dict(state)  # strict: shapes and names must match the config
    dtype, fmt = resolve_drafter_dtype(dtype, target)
    drafter = drafter.to(dtype).eval().requires_grad_(False)
    drafter.attach(target, dtype)
    if ids is not None:
        drafter.set_vocab(ids)
    if fmt == "q4":
        from adaflash.quant import quantise_drafter

        quantise_drafter(drafter)
    prepack(drafter, drafter.lm_head, drafter.draft_head)  # shared LM head (already packed with the target) or copies
    return drafter


def load_drafter_and_head(path: str | Path, target, dtype: str | torch.dtype | None = None) -> tuple[Drafter, LengthHead | None]:
    """A drafter directory for `target` (a loaded Target): the drafter, checked as `load_drafter` does, and
    its length head, or None when the directory has none (`has_length_head`). What serving, hot-swap,
    the trainer and the experiments load."""
    drafter = load_drafter(path, target.model, target.identity, dtype)
    head = load_length_head(path, drafter.config.hidden_size) if has_length_head(path) else None
    return drafter, head
