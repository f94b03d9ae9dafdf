"""Draft lengths for a stock engine that fixes the number of draft tokens per batch size rather than per request
(vLLM's num_speculative_tokens_per_batch_size): the cost policy's objective (adaflash.policy_cost) for B requests
that all draft K tokens with one acceptance profile, priced by this machine's step costs (adaflash.cost), and that
profile learnt from the traffic the engine reports (`LiveProfile`). The vLLM backend (server/vllm_backend.py) serves
from these schedules and re-chooses them as the profile moves; `adaflash bench` prices its `vllm-cost` peer with one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from adaflash.acceptance import round_labels
from adaflash.cost import StepCost, load_or_calibrate


def batch_schedule(
    cost: StepCost, cum: np.ndarray, max_batch: int, context: float = 256.0, draft_always: bool = False
) -> list[tuple[int, int, int]]:
    """The draft length per batch size for an engine that fixes it per batch, not per request (vLLM's
    `num_speculative_tokens_per_batch_size`): the same choice as `plan_drafts`, for B requests that all
    draft K tokens (K = 0: no drafts) with the same profile. cum [J]: P(the first j drafts all accepted),
    j = 1..J; context: cached tokens each verified token attends to; draft_always: the drafter's pass runs
    at K = 0 too (vLLM's DFlash keeps the drafter's cache in step with every committed token, drafting
    or not). -> inclusive ranges [(B_lo, B_hi, K)] covering 1..max_batch, K the length with the most
    expected tokens per second:

        K(B) = argmax_K  B * (1 + sum_{j <= K} cum_j) / (t_T(B, B * (K + 1), context) + t_D(B, K + 1, committed))
    """
    return batch_ranges(batch_rates(cost, cum, max_batch, context, draft_always).argmax(1).tolist())  # the shortest of the best


def batch_rates(cost: StepCost, cum: np.ndarray, max_batch: int, context: float = 256.0, draft_always: bool = False) -> np.ndarray:
    """[max_batch, J + 1] expected tokens per second of B = 1..max_batch requests that all draft K = 0..J tokens
    (`batch_schedule`'s objective; the arguments are its)."""
    cum = np.asarray(cum, dtype=np.float64)  # [J]
    gain = 1.0 + np.concatenate([[0.0], np.cumsum(cum)])  # [J + 1] tokens a request commits with K drafts
    rows = np.arange(1, len(cum) + 2)  # [J + 1] tokens a request verifies (K + 1)
    out = np.empty((max_batch, len(rows)))
    for b in range(1, max_batch + 1):
        secs = cost.verify_curve(b, b, b * len(cum), context)[(rows - 1) * b]  # [J + 1] B requests at K + 1 rows each
        plain = cost.draft(b, 1, b) if draft_always else 0.0  # K = 0: the anchor's row, one token committed each
        secs = secs + np.array([plain] + [cost.draft(b, int(r), int(b * g)) for r, g in zip(rows[1:], gain[1:])])
        out[b - 1] = b * gain / secs
    return out


def batch_ranges(ks: list[int]) -> list[tuple[int, int, int]]:
    """K per batch size 1..len(ks) -> inclusive ranges [(B_lo, B_hi, K)], equal neighbours merged."""
    out: list[tuple[int, int, int]] = []
    for b, k in enumerate(ks, 1):
        if out and out[-1][2] == k:
            out[-1] = (out[-1][0], b, k)
        else:
            out.append((b, b, int(k)))
    return out


def held_out_profile(drafter_dir, block_size: int) -> np.ndarray | None:
    """cum [block_size - 1] from the drafter's held-out evaluation (`adaflash evaluate`'s eval.json beside
    its weights: the share of rounds whose first j drafts were all accepted, whole blocks verified, the
    mean over its domains), or None where it has none."""
    path = Path(drafter_dir) / "eval.json"
    if not path.is_file():
        return None
    rows = [
        v["accepted_at_least"]
        for d in json.loads(path.read_text()).get("domains", {}).values()
        for v in d.get("variants", {}).values()
        if v.get("verify_len") == block_size and len(v.get("accepted_at_least") or []) == block_size - 1
    ]
    return np.mean(np.array(rows, dtype=np.float64), 0) if rows else None


def stock_profile(drafter, drafter_dir) -> np.ndarray:
    """cum [block - 1] a stock engine's schedule starts from: the drafter's held-out acceptance, or where it has
    none the cost policy's starting prior (each position accepted with probability 1/2, given the ones before)."""
    cum = held_out_profile(drafter_dir, drafter.block_size)
    return 0.5 ** np.arange(1, drafter.block_size) if cum is None else cum


def stock_schedule(target, drafter, drafter_dir, max_batch: int, context: float = 256.0) -> list[tuple[int, int, int]]:
    """`batch_schedule` for serving `drafter` (its files in `drafter_dir`) with `target` on vLLM (whose
    DFlash drafter runs every step, `draft_always`), priced by this machine's calibrated step costs of the
    two (`load_or_calibrate`), from `stock_profile`."""
    return batch_schedule(load_or_calibrate(target, drafter), stock_profile(drafter, drafter_dir), max_batch, context, draft_always=True)


class LiveProfile:
    """The acceptance profile (cum [J], as `batch_schedule` takes it) of the traffic a stock engine serves,
    learnt from its verify steps: per position, the steps that verified it and those that accepted it (the
    positions up to the first rejection, `round_labels`), forgetting `forget` per step, with a prior profile
    worth `strength` steps at every position. Positions the traffic's steps never verify (beyond the
    schedule's K) keep the prior's rate given the ones before, so cum there follows the live rates of
    the positions verified."""

    def __init__(self, prior_cum: np.ndarray, strength: float = 16.0, forget: float = 0.995):
        cum = np.asarray(prior_cum, dtype=np.float64)  # [J]
        self.prior = np.clip(cum / np.concatenate([[1.0], cum[:-1]]).clip(1e-9), 1e-4, 1.0)  # [J] P(j | < j accepted)
        self.strength, self.forget = strength, forget
        self.reset()

    def reset(self) -> None:
        """Forget the traffic's steps (a hot-swap: they measured the old drafter)."""
        self.accepted, self.verified = np.zeros(len(self.prior)), np.zeros(len(self.prior))

    def observe(self, drafted: list[int], accepted: list[int]) -> None:
        """One request's verify steps: drafts each verified [S] and accepted [S]."""
        if not len(drafted):
            return
        y, seen = round_labels(accepted, drafted, len(self.prior))  # [S, J]
        f = self.forget ** len(drafted)
        self.accepted = f * self.accepted + (y * seen).sum(0)
        self.verified = f * self.verified + seen.sum(0)

    def age(self, factor: float) -> None:
        """Scale the traffic's evidence by `factor` without a step to show for it (a stock engine that verified no
        drafts: the profile drifts back to the prior, so a schedule that stopped drafting is tried again)."""
        self.accepted, self.verified = factor * self.accepted, factor * self.verified

    def cum(self) -> np.ndarray:
        """[J] P(the first j drafts all accepted)."""
        return np.cumprod((self.accepted + self.strength * self.prior) / (self.verified + self.strength))
