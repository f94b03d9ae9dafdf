"""AdaFlash adaptive length head: predicts how much of a drafted block the target will accept.

The head reads the drafter's final-norm block hidden states h [B, K, H] (``Drafter.draft`` returns
them as its second output; position 0 is the anchor, positions 1..K-1 the drafted tokens). They are
DETACHED inside ``forward``, so the head's loss never sends gradients into the drafter.

    features = concat(mean_k h, h[:, -1])                     [B, 2H]
    x = SiLU(Linear(2H -> inner)(features))                   [B, inner]
    x = x + Linear(inner -> inner)(SiLU(x))                   [B, inner]   (residual block)
    pred = sigmoid(Linear(inner -> 1)(x))                     [B]          in (0, 1)

``pred`` estimates the block's acceptance rate label = clamp((accepted + 1) / block_size, 0, 1)
(``losses.acceptance_label``), where accepted = ``spec.accepted_length`` of the drafted tokens against the target's.
``verify_length`` turns it into how many tokens the target verifies next round.

Training: ``losses.length_head_loss`` (MSE) with the head's own optimizer (AdamW, lr 2e-4). It is first
fitted offline with the drafter frozen (``fit_length_head`` on precomputed hidden states), then
updated online. Persistence: ``save_length_head`` / ``load_length_head`` write / read
``length_head.safetensors`` + ``length_head.json`` inside a drafter directory (no pickle).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adaflash.losses import acceptance_label as label
from adaflash.losses import length_head_loss

WEIGHTS = "length_head.safetensors"
META = "length_head.json"
ARCHITECTURE = "AdaFlashLengthHead"
DRAFTER_CONFIG = "config.json"  # the drafter's own config, when the head sits in a drafter directory


@dataclass
class LengthHeadConfig:
    hidden_size: int  # H: the drafter's hidden size
    inner: int = 256  # width of the MLP
    block_size: int = 16  # anchor + (block_size - 1) drafted tokens; the longest verify length
    rate: float = 1.3  # safety margin: verify_len = round(pred * block_size * rate)
    min_len: int = 2  # shortest verify length (anchor + 1 draft)

    def __post_init__(self):
        for name in ("hidden_size", "inner", "block_size", "min_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"LengthHeadConfig.{name} must be an int, got {v!r}")
        if self.hidden_size < 1:
            raise ValueError(f"LengthHeadConfig.hidden_size must be >= 1, got {self.hidden_size}")
        if self.inner < 1:
            raise ValueError(f"LengthHeadConfig.inner must be >= 1, got {self.inner}")
        if self.block_size < 2:
            raise ValueError(f"LengthHeadConfig.block_size must be >= 2 (anchor + at least one draft), got {self.block_size}")
        if not 1 <= self.min_len <= self.block_size:
            raise ValueError(f"LengthHeadConfig.min_len must be in [1, block_size={self.block_size}], got {self.min_len}")
        if isinstance(self.rate, bool) or not isinstance(self.rate, (int, float)):
            raise ValueError(f"LengthHeadConfig.rate must be a float, got {self.rate!r}")
        self.rate = float(self.rate)
        if not math.isfinite(self.rate) or self.rate <= 0:
            raise ValueError(f"LengthHeadConfig.rate must be a finite float > 0, got {self.rate}")


# ----------------------------------------------------------------------------- label / verify length
def verify_length(pred: Tensor, block_size: int = 16, rate: float = 1.3, min_len: int = 2) -> Tensor:
    """Tokens the target verifies next round: clamp(round(pred * block_size * rate), min_len, block_size).

    pred [B] (predicted acceptance rate in (0, 1)) -> [B] int64.
    The length INCLUDES the anchor token (the last committed token at block position 0), so a verify
    length L checks L - 1 drafted tokens; L = block_size checks the whole block. ``torch.round``
    rounds halves to even (e.g. 2.5 -> 2).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not 1 <= min_len <= block_size:
        raise ValueError(f"min_len must be in [1, block_size={block_size}], got {min_len}")
    if not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"rate must be a finite float > 0, got {rate}")
    raw = torch.round(pred.detach().float() * (block_size * rate))  # [B]
    raw = torch.nan_to_num(raw, nan=float(block_size))  # a NaN prediction falls back to the full block
    return raw.clamp(min_len, block_size).long()  # [B]


# ----------------------------------------------------------------------------- the head
class LengthHead(nn.Module):
    def __init__(self, config: LengthHeadConfig):
        super().__init__()
        self.config = config
        h, d = config.hidden_size, config.inner
        self.proj = nn.Linear(2 * h, d)  # [B, 2H] -> [B, inner]
        self.res = nn.Linear(d, d)  # residual block: x + res(SiLU(x))
        self.out = nn.Linear(d, 1)  # [B, inner] -> [B, 1]

    @staticmethod
    def features(h: Tensor) -> Tensor:
        """Block hidden states h [B, K, H] -> concat(mean over the block, last position) [B, 2H].

        Detaches h: no gradient reaches the drafter.
        """
        if h.dim() != 3:
            raise ValueError(f"expected block hidden states [B, K, H], got shape {tuple(h.shape)}")
        h = h.detach()
        return torch.cat([h.mean(dim=1), h[:, -1]], dim=-1)  # [B, 2H]

    def forward_features(self, feats: Tensor) -> Tensor:
        """Pooled features [B, 2H] -> predicted acceptance rate [B] in (0, 1)."""
        feats = feats.to(self.proj.weight.dtype)
        x = F.silu(self.proj(feats))  # [B, inner]
        x = x + self.res(F.silu(x))  # [B, inner]
        return torch.sigmoid(self.out(x)).squeeze(-1)  # [B]

    def forward(self, h: Tensor) -> Tensor:
        """Drafter block hidden states h [B, K, H] (detached here) -> predicted acceptance rate [B]."""
        if h.dim() == 3 and h.shape[-1] != self.config.hidden_size:
            raise ValueError(f"length head expects hidden size {self.config.hidden_size}, got {h.shape[-1]}")
        return self.forward_features(self.features(h))  # [B]

    @torch.no_grad()
    def verify_length(self, h: Tensor) -> Tensor:
        """h [B, K, H] -> verify lengths [B] int64 (including the anchor) with this head's config."""
        c = self.config
        return verify_length(self(h), c.block_size, c.rate, c.min_len)


# ----------------------------------------------------------------------------- persistence
def _json_safe(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def save_length_head(head: LengthHead, out_dir: str | Path, metrics: dict | None = None) -> Path:
    """Write ``length_head.safetensors`` (fp32) + ``length_head.json`` (config + metrics) into out_dir."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    meta = {"architecture": ARCHITECTURE, "config": asdict(head.config), "metrics": _json_safe(dict(metrics or {}))}
    (out_dir / META).write_text(json.dumps(meta, indent=2, allow_nan=False) + "\n")
    return out_dir


def has_length_head(path: str | Path) -> bool:
    """Whether the (drafter) directory has a length head: either of its two files is there, so a head
    missing one of them is an error when loaded rather than silently no head."""
    path = Path(path)
    return (path / META).exists() or (path / WEIGHTS).exists()


def load_length_head(path: str | Path, hidden_size: int | None = None) -> LengthHead:
    """Load a length head from a (drafter) directory; returns it in eval mode, fp32, on CPU.

    The expected hidden size is ``hidden_size`` if given, else the ``hidden_size`` of a drafter
    ``config.json`` in the same directory (if any). Raises ValueError on a mismatch, on non-finite
    weights, or on weights that do not fit the stored config; FileNotFoundError if files are missing.
    The stored metrics are available as ``head.metrics``.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / META).exists() or not (path / WEIGHTS).exists():
        raise FileNotFoundError(f"{path} has no length head (needs {META} and {WEIGHTS})")
    meta = json.loads((path / META).read_text())
    if meta.get("architecture") != ARCHITECTURE:
        raise ValueError(f"{path / META} is not an AdaFlash length head config")
    names = LengthHeadConfig.__dataclass_fields__.keys()
    config = LengthHeadConfig(**{k: v for k, v in meta.get("config", {}).items() if k in names})

    expected, source = hidden_size, "the caller"
    if expected is None and (path / DRAFTER_CONFIG).exists():
        expected = json.loads((path / DRAFTER_CONFIG).read_text()).get("hidden_size")
        source = f"the drafter config {path / DRAFTER_CONFIG}"
    if expected is not None and expected != config.hidden_size:
        raise ValueError(
            f"length head in {path} was trained for hidden_size={config.hidden_size}, but {source} "
            f"has hidden_size={expected}: fit a length head for this drafter"
        )

    state = load_file(str(path / WEIGHTS))
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise ValueError(f"length head {path} has non-finite weights in {bad[:3]}")
    head = LengthHead(config)
    try:
        head.load_state_dict(state)  # strict: names and shapes must match the config
    except RuntimeError as e:
        raise ValueError(f"length head weights in {path} do not match its config: {e}") from e
    head.metrics = meta.get("metrics", {})
    return head.eval()


# ----------------------------------------------------------------------------- offline fit
def _pearson(a: Tensor, b: Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    denom = a.norm() * b.norm()
    return float((a * b).sum() / denom) if float(denom) > 0 else float("nan")


def fit_length_head(
    head: LengthHead,
    feats: Tensor,  # [N, K, H] drafter block hidden states (drafter frozen: precomputed)
    accepted: Tensor,  # [N] accepted drafts per block
    block_size: int | None = None,
    lr: float = 2e-4,
    epochs: int = 20,
    batch_size: int = 64,
    val_frac: float = 0.2,
    seed: int = 0,
    weight_decay: float = 0.0,
    progress: bool = False,
) -> dict:
    """Offline fit of the head (MSE via ``losses.length_head_loss``, AdamW with its own lr).

    The split train / held-out is a deterministic permutation from ``seed``; so is the batch order.
    Returns held-out metrics: mae (|pred - label|), pearson (pred vs label), baseline_mae (predicting
    the mean train label), mse, n_train, n_val, plus train_loss (mean MSE of the last epoch).
    The head is left in eval mode.
    """
    block_size = head.config.block_size if block_size is None else block_size
    if feats.dim() != 3 or feats.shape[-1] != head.config.hidden_size:
        raise ValueError(f"feats must be [N, K, H={head.config.hidden_size}], got {tuple(feats.shape)}")
    n = feats.shape[0]
    if accepted.shape != (n,):
        raise ValueError(f"accepted must be [N] = [{n}], got {tuple(accepted.shape)}")
    if n < 2:
        raise ValueError(f"need at least 2 blocks to fit and validate, got {n}")
    if not 0.0 < val_frac < 1.0:
        raise ValueError(f"val_frac must be in (0, 1), got {val_frac}")
    if epochs < 1 or batch_size < 1 or lr <= 0:
        raise ValueError(f"need epochs >= 1, batch_size >= 1, lr > 0; got {epochs}, {batch_size}, {lr}")

    device = head.proj.weight.device
    pooled = LengthHead.features(feats).to(device)  # [N, 2H], pooled once (drafter frozen)
    acc = accepted.to(device)  # [N]
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=gen).to(device)  # [N]
    n_val = min(n - 1, max(1, int(round(n * val_frac))))
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    n_train = int(train_idx.numel())

    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    epoch_iter = range(epochs)
    if progress:
        from tqdm.auto import tqdm

        epoch_iter = tqdm(epoch_iter, desc="length head", unit="epoch")
    train_loss = float("nan")
    head.train()
    for _ in epoch_iter:
        order = train_idx[torch.randperm(n_train, generator=gen).to(device)]
        total = 0.0
        for i in range(0, n_train, batch_size):
            idx = order[i : i + batch_size]
            loss = length_head_loss(head.forward_features(pooled[idx]), acc[idx], block_size)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * idx.numel()
        train_loss = total / n_train
        if progress:
            epoch_iter.set_postfix(loss=f"{train_loss:.4f}")
    head.eval()

    with torch.no_grad():
        y_train = label(acc[train_idx], block_size)  # [n_train]
        y_val = label(acc[val_idx], block_size)  # [n_val]
        p_val = head.forward_features(pooled[val_idx]).float()  # [n_val]
        mae = float((p_val - y_val).abs().mean())
        mse = float(length_head_loss(p_val, acc[val_idx], block_size))
        baseline_mae = float((y_train.mean() - y_val).abs().mean())
    return {
        "mae": mae,
        "pearson": _pearson(p_val, y_val),
        "baseline_mae": baseline_mae,
        "mse": mse,
        "train_loss": train_loss,
        "n_train": n_train,
        "n_val": n_val,
    }
