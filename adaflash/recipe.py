"""The drafter's training recipe: the one step pretraining, the online trainer and the loss replay run.

In torchtune's shape: each application builds its data, its model and its DeepSpeed engine, then
calls `train_step(engine, batch, loss)` once per optimizer step; what happens inside is the same
for all three:

    teacher logits   distillation only: the frozen target's LM head on the recorded states (no grad)
    draft logits     [B, NB, K-1, V] (+ the length head's prediction [B, NB]), bf16 autocast if asked
    loss_step        -> {"loss": scalar with grad, metric: ...} for `loss.kind`:
                       ce       position-weighted cross-entropy against the text's own next tokens (pretraining)
                       opd/osd  distillation from the target's logits over the valid positions
                       head     no drafter loss (the drafter is frozen)
                     plus, with a head prediction, loss.head_weight x the head's MSE
    backward, clipping (per parameter group when the caller asks), optimizer step

A batch is right-padded: tokens [B, T], feats [B, T, n*H] (the target-layer features), anchors
[B, NB] (-1 = unused), lengths [B]; distillation batches (the online trainer's data path) add the
teacher rows tgt_hidden [B, NB, K-1, H], tgt_next [B, NB, K-1], valid [B, NB, K-1] and full [B, NB].

Draft-vocabulary head (`loss.vocab: draft`, the default): a drafter with a draft vocabulary (Vd of V ids,
SmolLM2: 8,192 of 49,152) only ever proposes those tokens, and what it serves is the softmax over them. So
training computes only those Vd rows of the LM head, for the drafter and for the teacher, and every loss
sees the distribution the drafter serves:
    ce       labels outside the draft vocabulary are masked (such a position can never be drafted; under the
             full head its gradient only pushed mass toward tokens the drafter can never propose); the
             accuracy metrics still count them as misses, as verification would
    opd/osd  the teacher restricted to the draft vocabulary and renormalised (a log-softmax over the Vd
             logits), not with its out-of-vocabulary mass m as an extra bucket: the drafter puts no mass on
             that bucket, so forward KL (osd) against it is infinite, and reverse KL (opd) changes by the
             constant -log(1 - m) only (no gradient). Renormalised, it is the minimiser over draft-vocabulary
             distributions of either KL to the full teacher, and it maximises the sampling acceptance
             1 - TV, which no draft-vocabulary distribution can lift above 1 - m. OPD's hard label is then the
             teacher's top-1 within the draft vocabulary (its full top-1 is outside only where no draft
             can be accepted greedily).
`loss.vocab: full` (or a drafter without a draft vocabulary) trains on all V rows, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from adaflash.kernels.opd import CLIP_MODES
from adaflash.losses import ce_loss, length_head_loss, opd_loss, osd_loss
from adaflash.spec import accepted_length

DISTILL = ("opd", "osd")  # the loss kinds that read the target's logits
VOCABS = ("draft", "full")  # loss.vocab: the LM-head rows a step computes


@dataclass
class StepSection:
    """The optimizer-step keys of every recipe's `train:` section; pretraining and the online trainer
    subclass it with their own defaults and keys."""

    seqs_per_step: int = 4  # sequences per optimizer step (per rank)
    anchors_per_seq: int = 16  # blocks trained per sequence per step
    lr: float = 3e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max gradient norm
    autocast_bf16: bool = False  # bf16 autocast of the drafter forward
    seed: int = 0

    def __post_init__(self):
        for name in ("seqs_per_step", "anchors_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass
class LossSection:
    """The drafter's loss and its knobs (a config's `loss:` section; a config narrows KINDS)."""

    KINDS: ClassVar[tuple[str, ...]] = ("ce", "opd", "osd", "head")

    kind: str = "opd"  # "opd" (AdaFlash: top-1 CE + clipped reverse KL), "osd" (baseline: forward KL),
    #                    "head" (the drafter stays frozen; only the length head learns from the live acceptance
    #                    labels), or "ce" (pretraining: cross-entropy against the text's own next tokens)
    alpha: float = 0.8  # OPD weight of the hard top-1 term; 1 - alpha goes to the reverse KL
    temperature: float = 1.0
    clip: float | None = 1.0  # clip of the reverse-KL terms; null disables clipping
    clip_mode: str = "vocab"  # "vocab": clip every vocabulary term (the mission's choice), "token": the row sum
    gamma: float = 7.0  # position weight exp(-(k-1)/gamma)
    head_weight: float = 1.0  # weight of the length-head MSE (its gradients reach only the head)
    vocab: str = "draft"  # "draft": LM-head rows of the drafter's draft vocabulary only (module docstring), "full": all V

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"kind must be one of {self.KINDS}, got {self.kind!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.vocab not in VOCABS:
            raise ValueError(f"vocab must be one of {VOCABS}, got {self.vocab!r}")
        if self.clip_mode not in CLIP_MODES:
            raise ValueError(f"clip_mode must be one of {CLIP_MODES}, got {self.clip_mode!r}")
        if self.temperature <= 0 or self.gamma <= 0:
            raise ValueError("temperature and gamma must be > 0")


def deepspeed_config(
    t: StepSection, zero_stage: int = 0, clip: bool = True, scheduler: dict | None = None, extra: dict | None = None
) -> dict:
    """The DeepSpeed config of a recipe: torch's AdamW, `t.seqs_per_step` sequences per rank and step, no
    gradient accumulation. clip=False leaves clipping to the caller (`clip_per_group`)."""
    conf = {
        "train_micro_batch_size_per_gpu": t.seqs_per_step,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": t.grad_clip if clip else 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "weight_decay": t.weight_decay, "torch_adam": True}},
        "zero_optimization": {"stage": zero_stage},
        "steps_per_print": 10**9,
    }
    if scheduler is not None:
        conf["scheduler"] = scheduler
    conf.update(extra or {})
    return conf


def clip_per_group(engine, max_norm: float) -> list[float]:
    """Clip each optimizer parameter group (e.g. drafter, length head) to its own gradient norm: one global
    norm ties them (the head's loss would change the drafter's clipped step, and the drafter's norm rescale
    the head's gradients from step to step). Gradients must be whole on every rank (ZeRO 0).
    -> each group's norm before clipping."""
    return [
        float(torch.nn.utils.clip_grad_norm_([p for p in g["params"] if p.grad is not None], max_norm))
        for g in engine.optimizer.param_groups
    ]


def block_labels(tokens: Tensor, anchors: Tensor, lengths: Tensor, k_blk: int) -> tuple[Tensor, Tensor]:
    """The text's own next tokens at every block position -> labels [B, NB, K-1] (token at anchor + k)
    and valid mask [B, NB, K-1] (the anchor is used and the label exists)."""
    pos = anchors[:, :, None] + torch.arange(1, k_blk, device=anchors.device)  # [B, NB, K-1]
    valid = (anchors[:, :, None] >= 0) & (pos < lengths[:, None, None])
    labels = torch.gather(tokens, 1, pos.clamp(max=tokens.shape[1] - 1).flatten(1)).view(pos.shape)
    return labels, valid


def train_vocab(drafter, mode: str) -> Tensor | None:
    """The full-vocabulary ids [Vd] a step's logit columns stand for: the drafter's draft vocabulary under
    mode (loss.vocab) "draft", None (all V, column j = token j) under "full" or for a drafter without one."""
    return drafter.vocab if mode == "draft" else None


def vocab_head(drafter, vocab: Tensor | None):
    """The drafter's frozen LM head for `vocab` (train_vocab's answer): its draft rows or the full head."""
    return drafter.lm_head if vocab is None else drafter.draft_head


def block_logits(drafter, batch: dict, vocab: Tensor | None = None) -> Tensor:
    """The drafter's draft logits at every anchored block of `batch`, over `vocab` (train_vocab's answer).
    -> [B, NB, K-1, V], or [B, NB, K-1, Vd] with a draft vocabulary"""
    h = drafter(batch["feats"], batch["tokens"], batch["anchors"], batch["lengths"])  # [B, NB, K-1, H]
    return vocab_head(drafter, vocab)(h)


@torch.no_grad()
def teacher_logits(target, batch: dict, vocab: Tensor | None = None) -> Tensor:
    """The frozen target's logits at the batch's block positions: its LM head (the `vocab` rows only, when
    given) on the final-norm states the teacher forward recorded (batch["tgt_hidden"]).
    -> [B, NB, K-1, V] fp32, or [B, NB, K-1, Vd] with a vocab"""
    if vocab is None:
        return target.lm_head(batch["tgt_hidden"]).float()
    return F.linear(batch["tgt_hidden"], target.lm_head.weight[vocab]).float()


def draft_ids(logits: Tensor, vocab: Tensor | None) -> Tensor:
    """Greedy drafts as full-vocabulary ids: logits [..., V or Vd] over `vocab` -> [...]."""
    j = logits.argmax(-1)
    return j if vocab is None else vocab[j]


def in_vocab(labels: Tensor, vocab: Tensor) -> tuple[Tensor, Tensor]:
    """Full-vocabulary ids [...] -> (their column in the sorted draft vocabulary [...] (0 when outside),
    whether they are in it [...])."""
    j = torch.searchsorted(vocab, labels).clamp(max=vocab.numel() - 1)
    inside = vocab[j] == labels
    return j.masked_fill(~inside, 0), inside


def loss_step(
    logits: Tensor,
    batch: dict,
    loss: LossSection,
    tgt_logits: Tensor | None = None,
    pred: Tensor | None = None,
    metrics: bool = True,
    vocab: Tensor | None = None,
) -> dict:
    """The recipe's loss on one batch: the drafter's logits [B, NB, K-1, V'], the target's tgt_logits
    [B, NB, K-1, V'] (opd/osd), the length head's prediction pred [B, NB] or None; V' = V, or Vd when the
    columns are the draft vocabulary `vocab` [Vd] (module docstring: ce masks labels outside it)
    -> {"loss": scalar with grad, name: metric}. For ce, `metrics` adds the accuracy at block position 1
    and the greedy accepted length (an argmax over V': costly). With a head, the head's MSE on full blocks
    against the drafter's own acceptance label is added (the head's input is detached: it reaches the head only)."""
    k_blk = logits.shape[2] + 1
    if loss.kind == "ce":
        labels, valid = block_labels(batch["tokens"], batch["anchors"], batch["lengths"], k_blk)  # [B, NB, K-1] x2
        cols, trained = (labels, valid) if vocab is None else in_vocab(labels, vocab)  # [B, NB, K-1] x2
        out = ce_loss(logits.flatten(0, 1), cols.flatten(0, 1), (valid & trained).flatten(0, 1), loss.gamma)
        if metrics:
            with torch.no_grad():
                draft = draft_ids(logits, vocab)  # [B, NB, K-1]
                acc_pos = ((draft == labels) & valid).sum((0, 1)) / valid.sum((0, 1)).clamp(min=1)  # [K-1]
                acc_len = accepted_length(draft.masked_fill(~valid, -1), labels)[batch["anchors"] >= 0]  # [blocks], as verified
            out.update(acc_pos1=float(acc_pos[0]), acc_len=float(acc_len.float().mean()))
    elif loss.kind == "head":  # the drafter is frozen: no distillation (no target logits either)
        out = {"loss": pred.sum() * 0.0}
    else:
        d, t, v = logits.flatten(0, 1), tgt_logits.flatten(0, 1), batch["valid"].flatten(0, 1)  # [N, K-1, V] x2, [N, K-1]
        if loss.kind == "opd":
            out = opd_loss(d, t, v, loss.alpha, loss.temperature, loss.clip, loss.clip_mode, loss.gamma)
        else:
            out = osd_loss(d, t, v, loss.temperature, loss.gamma)
    if pred is None:
        return out
    full = batch["full"].flatten()  # [N]
    with torch.no_grad():
        acc = accepted_length(draft_ids(logits.flatten(0, 1), vocab), batch["tgt_next"].flatten(0, 1))  # [N]: the drafter's own label
    head = length_head_loss(pred.flatten()[full], acc[full], k_blk) if full.any() else pred.sum() * 0.0
    terms = {k: float(v) for k, v in out.items() if k != "loss"}
    terms.update(
        head_loss=float(head.detach()),
        train_acc_len=float(acc[full].float().mean()) if full.any() else 0.0,
        positions=int(batch["valid"].sum()),
    )
    return {"loss": out["loss"] + loss.head_weight * head, **terms}


def train_step(
    engine,
    batch: dict,
    loss: LossSection,
    forward: Callable | None = None,
    teacher=None,
    autocast: bool = False,
    clip: Callable | None = None,
    metrics: bool = True,
    vocab: Tensor | None = None,
) -> dict:
    """One optimizer step of the DeepSpeed `engine` on `batch` -> loss_step's terms as numbers, "loss" last.
    forward(batch) -> (draft logits over `vocab`, head prediction or None); default: the engine's drafter
    over train_vocab(drafter, loss) (`vocab` is then ignored), no head. teacher: the frozen target (opd/osd).
    clip(engine) -> {metric: value}: clipping between backward and step when DeepSpeed does not clip (per
    parameter group)."""
    engine.train()
    if forward is None:
        vocab = train_vocab(engine.module, loss.vocab)
    tgt_logits = teacher_logits(teacher, batch, vocab) if loss.kind in DISTILL else None
    with torch.autocast(batch["tokens"].device.type, dtype=torch.bfloat16, enabled=autocast):
        logits, pred = forward(batch) if forward is not None else (block_logits(engine.module, batch, vocab), None)
    out = loss_step(logits, batch, loss, tgt_logits, pred, metrics, vocab)
    engine.backward(out["loss"])
    clipped = clip(engine) if clip is not None else {}
    engine.step()
    terms = {k: float(v) if isinstance(v, Tensor) else v for k, v in out.items() if k != "loss"}
    return {**terms, **clipped, "loss": float(out["loss"].detach())}
