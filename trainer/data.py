"""Update-round data: buffered trajectories -> teacher-forced supervision at the recorded anchors.

A trajectory is prompt + output plus the anchors of the blocks that were actually drafted while
serving (on-policy). One frozen-target forward over prompt + output per trajectory gives, at every
position i, the target-layer features (the drafter's context) and the final-norm hidden state
(`target.lm_head(hidden[i])` = target logits predicting token i + 1), so each update round runs the
target once and the training steps only pay for the LM-head rows they use.

Block at anchor a, position k = 1..K-1 predicts token a + k; its teacher is the target at position
a + k - 1 conditioned on the committed text; it is valid while a + k < L (labels beyond the sequence
end are masked). Up to the block's first rejection this is exactly the distribution the server
verified with; after it, the server's target had seen rejected drafts, while this teacher sees what
the target actually produced next: what the drafter's block must predict. A FULL block has all K-1
positions valid: only full blocks count for tau and for the length head's acceptance label.
"""

from __future__ import annotations

import hashlib
import random
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from adaflash.buffer import Trajectory
from adaflash.losses import acceptance_label
from adaflash.recipe import draft_ids
from adaflash.spec import accepted_length
from adaflash.target import TargetModel


def is_heldout(request_id: str, frac: float) -> bool:
    """Deterministic split by request_id hash: the same request is held out in every process and round."""
    h = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big")
    return h / 2**64 < frac


@dataclass
class Sequence:
    """One trajectory ready for training: tokens, recorded anchors and (after `supervise`) the teacher."""

    request_id: str
    domain: str
    tokens: Tensor  # [L] prompt + output
    anchors: Tensor  # [NB] recorded anchors with >= 1 label (a < L - 1), ascending
    feats: Tensor | None = None  # [L, n*H] target-layer features
    hidden: Tensor | None = None  # [L, H] target final-norm hidden states
    target_next: Tensor | None = None  # [L] target argmax at each position (its greedy next token)

    def full_anchors(self, k_blk: int) -> Tensor:
        """Anchors whose whole block lies inside the sequence (a + K - 1 < L)."""
        return self.anchors[self.anchors + k_blk - 1 < len(self.tokens)]


def to_sequences(trajs: list[Trajectory]) -> list[Sequence]:
    """Trajectories -> sequences; ones without a usable recorded anchor are dropped."""
    out = []
    for t in trajs:
        tokens = torch.tensor(list(t.prompt_ids) + list(t.output_ids), dtype=torch.long)
        anchors = sorted({r.anchor for r in t.rounds if 0 <= r.anchor < len(tokens) - 1})
        if anchors:
            out.append(Sequence(t.request_id, t.domain or "unknown", tokens, torch.tensor(anchors, dtype=torch.long)))
    return out


@contextmanager
def capture_output(module: nn.Module):
    """Records `module`'s forward outputs in the yielded list (read the final-norm states a forward
    computes internally without changing the model code)."""
    seen: list[Tensor] = []
    handle = module.register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        yield seen
    finally:
        handle.remove()


@torch.no_grad()
def supervise(target: TargetModel, seqs: list[Sequence], chunk: int, feats_dtype: torch.dtype | None = None) -> None:
    """One target forward per sequence (packed `chunk` at a time): fills feats, hidden, target_next.
    feats_dtype: store the features in this dtype (bf16 when the drafter trains under bf16 autocast: its
    `fc` reads them in bf16 anyway, so the steps are unchanged and a round holds half the bytes);
    hidden stays in the target's dtype (the teacher's logits are computed from it)."""
    for i in range(0, len(seqs), chunk):
        part = seqs[i : i + chunk]
        caches = [target.new_cache(1, len(s.tokens)) for s in part]
        with capture_output(target.model.norm) as seen:
            logits, feats = target.forward_packed([s.tokens for s in part], caches)  # per seq [L, V], [L, n*H]
        hidden = seen[-1][0]  # [N, H] packed final-norm states
        a = 0
        for s, lg, f in zip(part, logits, feats):
            n = len(s.tokens)
            s.feats, s.hidden, s.target_next = f.to(feats_dtype or f.dtype), hidden[a : a + n].clone(), lg.argmax(-1)
            a += n


def make_batch(items: list[tuple[Sequence, Tensor]], k_blk: int) -> dict:
    """Right-padded batch of (sequence, anchors) items for the drafter's training forward.

    Returns tokens [B, T], feats [B, T, n*H], anchors [B, NB] (-1 = unused), lengths [B],
    teacher rows: tgt_hidden [B, NB, K-1, H], tgt_next [B, NB, K-1], valid [B, NB, K-1], full [B, NB].
    """
    b = len(items)
    t = max(len(s.tokens) for s, _ in items)
    nb = max(len(a) for _, a in items)
    s0 = items[0][0]
    tokens = torch.zeros(b, t, dtype=torch.long)
    feats = s0.feats.new_zeros(b, t, s0.feats.shape[-1])
    anchors = torch.full((b, nb), -1, dtype=torch.long)
    lengths = torch.zeros(b, dtype=torch.long)
    tgt_hidden = s0.hidden.new_zeros(b, nb, k_blk - 1, s0.hidden.shape[-1])
    tgt_next = torch.zeros(b, nb, k_blk - 1, dtype=torch.long)
    valid = torch.zeros(b, nb, k_blk - 1, dtype=torch.bool)
    for i, (s, a) in enumerate(items):
        n = len(s.tokens)
        tokens[i, :n], feats[i, :n], lengths[i] = s.tokens, s.feats, n
        anchors[i, : len(a)] = a
        rows = a[:, None] + torch.arange(k_blk - 1)  # [nb_i, K-1]: teacher position a + k - 1
        ok = rows + 1 < n  # the label a + k exists
        rows = rows.clamp(max=n - 1)
        tgt_hidden[i, : len(a)] = s.hidden[rows]
        tgt_next[i, : len(a)] = s.target_next[rows]
        valid[i, : len(a)] = ok
    return {
        "tokens": tokens,
        "feats": feats,
        "anchors": anchors,
        "lengths": lengths,
        "tgt_hidden": tgt_hidden,
        "tgt_next": tgt_next,
        "valid": valid,
        "full": valid.all(-1),
    }


def train_items(
    seqs: list[Sequence], step: int, rank: int, world: int, seqs_per_step: int, anchors_per_seq: int, seed: int, round_no: int
) -> list[tuple[Sequence, Tensor]]:
    """The (sequence, sampled recorded anchors) items of one step on one rank.

    Deterministic in (seed, round, step, rank): a restarted round replays the same batches. Sequences
    are visited in a per-round shuffled order, epoch after epoch; ranks take disjoint slices."""
    order = list(range(len(seqs)))
    random.Random(f"{seed}-{round_no}").shuffle(order)
    rng = random.Random(f"{seed}-{round_no}-{step}-{rank}")
    start = (step * world + rank) * seqs_per_step
    items = []
    for j in range(start, start + seqs_per_step):
        s = seqs[order[j % len(order)]]
        picked = sorted(rng.sample(s.anchors.tolist(), min(anchors_per_seq, len(s.anchors))))
        items.append((s, torch.tensor(picked, dtype=torch.long)))
    return items


def eval_items(seqs: list[Sequence], k_blk: int, anchors_per_item: int) -> list[tuple[Sequence, Tensor]]:
    """Every full recorded block of every sequence, `anchors_per_item` blocks per item."""
    items = []
    for s in seqs:
        full = s.full_anchors(k_blk)
        items += [(s, full[i : i + anchors_per_item]) for i in range(0, len(full), anchors_per_item)]
    return items


@torch.no_grad()
def heldout_tau(
    forward, seqs: list[Sequence], k_blk: int, anchors_per_item: int, items_per_batch: int, vocab: Tensor | None = None
) -> dict:
    """Teacher-forced tau on held-out sequences: 1 + mean accepted length of the drafter's block argmax
    against the target's argmax over full blocks at the recorded anchors, overall and per domain;
    plus the length head's MAE against the acceptance label of this drafter.

    `forward(batch)` -> (draft logits [B, NB, K-1, V], or [B, NB, K-1, Vd] over the draft vocabulary
    `vocab` [Vd]: the argmax is then the draft as served, head prediction [B, NB]).
    """
    acc_by_dom: dict[str, list[Tensor]] = defaultdict(list)
    errs = []
    items = eval_items(seqs, k_blk, anchors_per_item)
    for i in range(0, len(items), items_per_batch):
        part = items[i : i + items_per_batch]
        batch = make_batch(part, k_blk)
        logits, pred = forward(batch)
        full = batch["full"]  # [B, NB]
        acc = accepted_length(draft_ids(logits, vocab), batch["tgt_next"])  # [B, NB]
        errs.append((pred.float() - acceptance_label(acc, k_blk))[full].abs())
        for row, (s, _) in enumerate(part):
            acc_by_dom[s.domain].append(acc[row][full[row]])
    tau = lambda xs: 1.0 + float(torch.cat(xs).float().mean()) if sum(len(x) for x in xs) else float("nan")  # noqa: E731
    all_acc = [x for xs in acc_by_dom.values() for x in xs]
    return {
        "tau": tau(all_acc),
        "blocks": sum(len(x) for x in all_acc),
        "head_mae": float(torch.cat(errs).mean()) if errs and sum(len(e) for e in errs) else float("nan"),
        "domains": {d: {"tau": tau(xs), "blocks": sum(len(x) for x in xs)} for d, xs in sorted(acc_by_dom.items())},
    }
