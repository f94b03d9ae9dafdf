"""The verify-length choice, pure functions over arrays: given each request's P(its first j drafts all accepted)
and a step-cost curve, which drafts to verify (`choose_lengths`), which requests draft and how long a block the
drafter runs (`plan_drafts`), and the block whose verify choice pays best over scenarios of recent rounds
(`choose_block`). The cost policy (adaflash.policy_cost) feeds them its acceptance models and this machine's
step costs every step; the module doc there derives the objective.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from adaflash.acceptance import as_np


def _ranked(values: np.ndarray) -> np.ndarray:
    """Indices of `values` [M] by falling value, ties in index order."""
    return np.argsort(-values, kind="stable")


def _best_prefix(values: np.ndarray, secs: np.ndarray, fixed_gain: float) -> tuple[int, float]:
    """values [M] in the order they are taken, secs [M + 1] step seconds with n of them taken -> the n
    with the most expected tokens per second, and that rate."""
    gain = fixed_gain + np.concatenate([[0.0], np.cumsum(values)])  # [M + 1]
    rate = gain / secs
    n = int(rate.argmax())
    return n, float(rate[n])


def choose_lengths(cum: np.ndarray, secs: np.ndarray, fixed_gain: float) -> tuple[np.ndarray, float]:
    """Verify lengths that maximise (fixed_gain + sum_i sum_{j < L_i - 1} cum_ij) / secs[sum_i (L_i - 1)].

    cum [R, J]: P(the first j drafts all accepted), non-increasing in j; secs [R * J + 1]: the step's
    seconds when n drafts are verified besides every request's anchor (non-decreasing; drafting
    included once it is spent); fixed_gain: tokens committed anyway (one per request). -> (lengths [R]
    in 1..J+1, the rate in tokens/s). Whatever n drafts are verified, the best are the n most likely
    ones, and those are prefixes of the requests' blocks since cum falls with j; so one scan over the
    drafts by falling cum finds the optimum for any cost curve (a flat one below the knee included).
    """
    r, j = cum.shape
    flat = as_np(cum).reshape(-1)
    order = _ranked(flat)  # [R*J]: ties keep the earlier position
    n, rate = _best_prefix(flat[order], as_np(secs), fixed_gain)
    taken = np.zeros(r * j, dtype=bool)
    taken[order[:n]] = True
    return 1 + taken.reshape(r, j).sum(-1), rate


@dataclass
class DraftPlan:
    draft: np.ndarray  # [R] bool: the request drafts this step
    block: int  # block length the drafter runs (0 = no drafter pass)
    lens: np.ndarray  # [R] int64 planned verify lengths (1 for requests that do not draft)
    rate: float  # expected tokens/s of the planned step


def plan_drafts(
    cum: np.ndarray,
    secs: np.ndarray,
    fixed_gain: float,
    draft_s: tuple[float, float, float],
    force: np.ndarray | None = None,
    extra_s: np.ndarray | None = None,
) -> DraftPlan:
    """Which requests draft and how long a block, before drafting (lengths <= the block).

    cum [R, K-1] from the prior model; secs [R * (K-1) + 1] verify seconds with n drafts verified (as in
    `choose_lengths`); draft_s: (per pass, per drafted request, per drafted block row) seconds; force
    [R] bool: requests that draft anyway (probes, at least one draft verified); extra_s [R]: seconds a
    request adds to the drafting pass besides d_req (extending its drafter cache with the context it
    committed since it last drafted). For every block length the drafts are taken by falling cum (the
    forced requests' first drafts first), a request paying its drafting cost with its first draft
    taken; the plan is the block length and prefix with the most expected tokens per second, plain
    decoding (nothing drafted) among them when nobody is forced. That scan is greedy in the requests'
    own costs: a costly request whose drafts rank high is taken with them. So a request whose whole
    block, accepted as expected, adds fewer tokens than its own drafting cost earns at plain decoding's
    rate, then at the plan's (it can only lower that rate), is left out of the scan, which then runs
    again on the rest; where no request can pay, plain decoding is chosen without any scan."""
    r = cum.shape[0]
    c, t = as_np(cum), as_np(secs)
    force = np.zeros(r, dtype=bool) if force is None else np.asarray(as_np(force) > 0)
    extra = np.zeros(r) if extra_s is None else as_np(extra_s)
    plain = DraftPlan(np.zeros(r, dtype=bool), 0, np.ones(r, dtype=np.int64), fixed_gain / float(t[0]))
    own = extra + draft_s[1] + 2 * draft_s[2]  # [R] the least a request's drafting costs
    total = c.sum(-1)  # [R]
    keep = (total >= plain.rate * own) | force  # [R] the best plan is at least plain decoding
    best = None
    while keep.any():
        part = _scan(c[keep], t, fixed_gain, draft_s, force[keep], extra[keep])
        best = DraftPlan(np.zeros(r, dtype=bool), part.block, np.ones(r, dtype=np.int64), part.rate)
        best.draft[keep], best.lens[keep] = part.draft, part.lens
        tighter = keep & ((total >= part.rate * own) | force)  # [R] against the plan's own rate
        if (tighter == keep).all():
            break
        keep = tighter
    return plain if best is None or (best.rate < plain.rate and not force.any()) else best


def _scan(cum, secs, fixed_gain, draft_s, force, extra_s) -> DraftPlan:
    """plan_drafts' scan over every block length b and prefix of the drafts ranked by cum, in one pass
    of array ops (it runs every step): the drafts are ranked once (the forced requests' first drafts
    first, then by falling cum, ties to the earlier request and position), and a block of b drafts
    from the ranked drafts those at positions < b - 1, in the same order. cum [R, J], secs [M + 1],
    force [R] bool, extra_s [R] (NumPy or torch)."""
    cum, secs, extra_s = as_np(cum), as_np(secs), as_np(extra_s)
    force = np.asarray(force, dtype=bool)
    r, n_pos = cum.shape
    d_pass, d_req, d_row = draft_s
    flat = cum.reshape(-1)  # [M], M = R * J: request i's position j at i * J + j
    if force.any():
        first = np.arange(r) * n_pos  # [R]
        rest = np.ones(r * n_pos, dtype=bool)
        rest[first[force]] = False
        tail = np.flatnonzero(rest)
        order = np.concatenate([first[force], tail[_ranked(flat[tail])]])  # [M]
    else:
        order = _ranked(flat)  # [M]
    pos = order % n_pos  # [M] block position of each ranked draft
    blocks = np.arange(2, n_pos + 2, dtype=np.float64)  # [B] block lengths
    take = pos[None] < np.arange(1, n_pos + 1)[:, None]  # [B, M]: in a block of that length (b - 1 drafts)
    count = np.cumsum(take, 1)  # [B, M] drafts taken up to each ranked one
    gain = fixed_gain + np.cumsum(flat[order][None] * take, 1)  # [B, M]
    is_first = pos == 0  # a request's first draft: it starts drafting there (in every block)
    drafted = np.cumsum(is_first)  # [M]
    extra = np.cumsum(np.where(is_first, extra_s[order // n_pos], 0.0))  # [M]
    cost = secs[count] + (drafted > 0) * d_pass + drafted * (d_req + d_row * blocks[:, None]) + extra  # [B, M]
    ok = take & (count >= max(int(force.sum()), 1))  # a new prefix, past the forced drafts
    rate = np.where(ok, gain / cost, -np.inf)  # [B, M] (cost > 0: secs >= 1e-6)
    best_b = rate.max(1)  # [B]
    bi = int(best_b.argmax())  # the shortest block of the best rate
    plain = fixed_gain / float(secs[0])
    if not force.any() and float(best_b[bi]) <= plain:
        return DraftPlan(np.zeros(r, dtype=bool), 0, np.ones(r, dtype=np.int64), plain)
    last = int(rate[bi].argmax())  # the shortest prefix of that rate
    taken = np.zeros(r * n_pos, dtype=bool)
    taken[order[: last + 1][take[bi, : last + 1]]] = True
    drafts = taken.reshape(r, n_pos).sum(-1)  # [R]
    return DraftPlan(drafts > 0, int(blocks[bi]), (1 + drafts).astype(np.int64), float(rate[bi, last]))


def choose_block(cum: np.ndarray, secs: np.ndarray, fixed_gain: float, spent: np.ndarray) -> tuple[int, float]:
    """The block length whose verify choice, made after drafting, commits the most tokens per second over
    scenarios of what that choice will see. cum [S, R, J]: in scenario s, request i's P(first j drafts
    accepted) (its recent rounds' block-model predictions, where they reach); secs [R * J + 1] as in
    `choose_lengths`; spent [J] drafting seconds for blocks 2..J+1. For each block b and scenario, the
    verify lengths `choose_lengths` would pick from the b - 1 drafts (the drafting spent); -> the b of
    the most tokens per second summed over the scenarios (the shortest of ties), and that rate. A plan priced on the
    prior's mean acceptance alone drafts too short a block for the rounds where the drafter is sure,
    since its mean cannot see the lengths chosen round by round (`policy_ab` `cost@block6`: HumanEval
    at c=1 1.002x `fixed6` where the plans drafted blocks of 5, at 0.957x)."""
    n_s, r, j = cum.shape
    flat = cum.reshape(n_s, -1)  # [S, M]
    order = np.argsort(-flat, axis=1, kind="stable")  # [S, M]
    vals = np.take_along_axis(flat, order, 1)  # [S, M]
    take = (order % j)[:, None] < np.arange(1, j + 1)[None, :, None]  # [S, B, M]: in a block of b (b - 1 drafts)
    count = np.cumsum(take, 2)  # [S, B, M]
    gain = fixed_gain + np.cumsum(vals[:, None] * take, 2)  # [S, B, M]
    cost = secs[count] + spent[None, :, None]  # [S, B, M]
    rate = np.where(take, gain / cost, -np.inf)
    none_g = np.full((n_s, j), float(fixed_gain))  # [S, B] no draft verified
    none_c = np.broadcast_to(float(secs[0]) + spent[None], (n_s, j))
    best = rate.argmax(2)[..., None]  # [S, B, 1]
    g, c = np.take_along_axis(gain, best, 2)[..., 0], np.take_along_axis(cost, best, 2)[..., 0]  # [S, B]
    worse = np.take_along_axis(rate, best, 2)[..., 0] <= none_g / none_c  # [S, B]: ties to no draft, as choose_lengths
    g, c = np.where(worse, none_g, g), np.where(worse, none_c, c)
    rate = g.sum(0) / c.sum(0)  # [B]
    return 2 + int(rate.argmax()), float(rate.max())
