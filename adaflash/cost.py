"""What an engine step costs on this machine, measured once and kept up to date from live steps.

A step's wall time is modelled as linear in what it does (seconds):

    verification   (target.forward_packed)       t_T = a0 + a1 * R + a2 * g(N) + a3 * QK
                                                 R requests, N tokens verified, QK = sum_i n_i c_i / 1000
    drafting       (extend, draft, logits)       t_D = d0 + d1 * Rd + d2 * Rd * Ld + d3 * Cx
                                                 Rd requests drafted, blocks of Ld, Cx context tokens

g(N) is what N token rows cost the target beyond one row: the roofline's shape. A forward over few
rows is bound by reading the weights, so rows are nearly free until the batch becomes compute-bound
(a single request's forward over 1 or 8 tokens costs the same on a CPU), then each row costs about the
same; but the matmul kernels work in tiles, so the curve is a staircase (on a 2-core AVX-512 machine,
float32, two threads: 1-9 rows cost the same, 11 rows 30% more), and a batch of 32 plain-decoding
requests sits right at a tile's edge, where one more row costs a tenth of the step. `calibrate`
therefore times whole forwards of one request over N new tokens at every N up to 40, then every 4 to
96 and at 112, 128, 160 and 192 (`time_rows`, ROWS_GRID; cleaned by `clean_rows`), and g(N) = S(N) -
S(1) in seconds, a2 about 1. Without that measurement (a calibration cached before it, or points given
by hand), g(N) = max(N - knee, 0) with the knee fitted on the calibration points (the candidate with
the smallest relative residual; 0 gives a model linear in N). a1 is the per-request work. QK is the
attention's work: request i's n_i new tokens each score its c_i cached tokens (thousands of such
query-key pairs; the pairs among the new tokens are in g, timed on one request). At 300 tokens of
context on the 2-core AVX2 machine a 17-token block took 111 ms where the model without it said 69,
and 8 requests of 2 tokens 105 where it said 74: the calibration, at 32 tokens of context, had priced
every token as if contexts stayed short. It therefore also times a few batches at LONG_CONTEXT. Cx: a request
that drafts first extends its drafter cache with the target features of every token it committed
since it last drafted (`Engine._extend_context`), so one that skipped many steps costs more to draft
(on this CPU the extension was 40-50% of drafting at concurrency 32). The cost-aware verify policy
(adaflash.policy_cost) reads the step's seconds as a function of the tokens it verifies.

`calibrate` times a small grid of both passes (a few seconds) on dummy caches. `load_or_calibrate`
keeps that under the user cache (`cache_root()/cost/`), keyed by CPU/GPU model, the vector code ATen runs, torch threads, the
target's fingerprint and both dtypes, so a restart on the same machine measures little: three of the
points timed again (`drift`, about a second; again with more sweeps where one is off, a burst of other work
excused) scale the cached timings to the machine's speed now, and the whole grid is measured only where one is
more than 30% off (a
calibration another machine of the same processor model wrote; one that does not fit the linear model,
disturbed by other processes, is used but not kept). Live steps
then refit the coefficients (`Linear.observe`: least squares with exponential forgetting, pulled
toward the calibration so directions live traffic never varies, e.g. R at a steady concurrency, keep
their measured values instead of drifting), so the model follows a machine whose load changes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("adaflash.cost")

QK_UNIT = 1000.0  # the attention feature counts query-key pairs in thousands (coefficients of ms scale)


def attention_pairs(queries, contexts) -> float:
    """The verify-cost feature QK: new tokens per request x their cached tokens, summed, in thousands."""
    return sum(n * c for n, c in zip(queries, contexts)) / QK_UNIT


@dataclass
class Linear:
    """y ~ theta . x, fitted by least squares on calibration points (the prior, weight `prior_weight`
    each) plus live points whose weight decays by `forget` per observation. Residuals are clipped to
    +-`clip` of the prediction so one step stalled by another process does not swing the fit."""

    names: list[str]  # feature names, e.g. ["1", "R", "N"]
    x0: list[list[float]] = field(default_factory=list)  # [n, d] calibration features
    y0: list[float] = field(default_factory=list)  # [n] calibration times (s)
    forget: float = 0.97
    prior_weight: float = 1.0
    clip: float = 0.5
    ridge: float = 1e-6

    def __post_init__(self):
        d = len(self.names)
        x = torch.tensor(self.x0, dtype=torch.float64).reshape(-1, d)  # [n, d]
        y = torch.tensor(self.y0, dtype=torch.float64)  # [n]
        a0 = self.prior_weight * x.T @ x + self.ridge * torch.eye(d, dtype=torch.float64)  # [d, d] prior information
        self._a0, self._b0 = a0.tolist(), (self.prior_weight * x.T @ y).tolist()  # [d, d], [d]
        # live information: [d, d] and [d] in Python floats (d <= 4, updated every engine step: tensor ops
        # would cost more than the arithmetic)
        self._a, self._b = [[0.0] * d for _ in range(d)], [0.0] * d
        self._solve()

    def _solve(self) -> None:
        a = [[p + q for p, q in zip(ra, rb)] for ra, rb in zip(self._a0, self._a)]
        self.theta = solve_small(a, [p + q for p, q in zip(self._b0, self._b)])  # [d]

    def __call__(self, *x: float) -> float:
        return sum(t * v for t, v in zip(self.theta, x))

    def observe(self, x: list[float], y: float) -> None:
        """One live measurement: y seconds for features x."""
        pred = max(self(*x), 1e-9)
        y = min(max(y, (1 - self.clip) * pred), (1 + self.clip) * pred)
        f = self.forget
        self._a = [[f * v + xi * xj for v, xj in zip(row, x)] for row, xi in zip(self._a, x)]
        self._b = [f * v + xi * y for v, xi in zip(self._b, x)]
        self._solve()

    def coef(self, name: str, floor: float = 0.0) -> float:
        """One coefficient, at least `floor` (a fit on noisy steps can go slightly negative)."""
        return max(self.theta[self.names.index(name)], floor)


def solve_small(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b for a small dense system (Gaussian elimination with partial pivoting, in floats)."""
    n = len(b)
    m = [list(row) + [v] for row, v in zip(a, b)]  # [n, n + 1]
    for c in range(n):
        p = max(range(c, n), key=lambda i: abs(m[i][c]))
        m[c], m[p] = m[p], m[c]
        for i in range(c + 1, n):
            f = m[i][c] / m[c][c]
            m[i] = [u - f * v for u, v in zip(m[i], m[c])]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x


KNEES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)  # candidate knees (tokens per step) of the verify cost


def fit_knee(points: list[tuple[int, int, float, float]]) -> int:
    """The knee of t = a0 + a1 R + a2 max(N - knee, 0) + a3 QK that fits (R, N, QK, seconds) points best, by least
    squares on relative errors; near-ties go to the smaller knee (the linear model, knee 0, when it fits)."""
    y = torch.tensor([t for *_, t in points], dtype=torch.float64)  # [n]
    w = 1.0 / y  # relative errors: a 50 ms and a 500 ms point count alike
    best, best_err = 0, float("inf")
    for k in KNEES:
        x = torch.tensor([[1.0, r, max(n - k, 0), qk] for r, n, qk, _ in points], dtype=torch.float64)  # [n, 4]
        if k and not bool((x[:, 2] > 0).any()):
            break  # no point beyond this knee: its slope is not measured
        theta = torch.linalg.lstsq(x * w[:, None], y * w, driver="gelsd").solution  # [4] (minimum norm: QK may be all 0)
        if float(theta[2]) <= 0:
            continue
        err = float((((x @ theta) - y) * w).square().sum())
        if err < 0.99 * best_err - 1e-12:  # a larger knee must fit clearly better (knees <= min N are the same model)
            best, best_err = k, err
    return best


class StepCost:
    """The two linear models; `verify(R, N, QK)` and `draft(Rd, Ld)` in seconds (0 drafted = no pass).
    target_points: (R, N, QK, seconds), or (R, N, seconds) at no context; drafter_points: (Rd, Ld, Cx,
    seconds), or (Rd, Ld, seconds) with no context extended; rows: [(N, seconds)] of whole forwards at N
    token rows (`time_rows`), or None (the knee model)."""

    def __init__(
        self,
        target_points: list[tuple[int, int, float]],
        drafter_points: list[tuple[int, int, float]],
        forget: float = 0.97,
        rows: list[tuple[int, float]] | None = None,
    ):
        target_points = [tuple(p) if len(p) == 4 else (p[0], p[1], 0.0, p[2]) for p in target_points]
        drafter_points = [tuple(p) if len(p) == 4 else (p[0], p[1], 0, p[2]) for p in drafter_points]
        self.points = {"target": target_points, "drafter": drafter_points, "rows": list(rows or [])}
        self.knee = 0 if rows else fit_knee(target_points)
        self._g = rows_feature(rows).numpy() if rows else None  # [max N + 1] g(N) in seconds
        self._g_at = self.g(np.arange(len(self._g) if self._g is not None else 257)).tolist()  # g(0 ..) as floats
        # points all at no context (given by hand) leave QK out: live steps alone would set its coefficient
        self._qk = any(qk for _, _, qk, _ in target_points)
        tx = [self._x(r, n, qk) for r, n, qk, _ in target_points]
        self.target = Linear(["1", "R", "N", "QK"][: 3 + self._qk], tx, [t for *_, t in target_points], forget)
        self.drafter = Linear(
            ["1", "Rd", "RdLd", "Cx"], [[1.0, r, r * ld, cx] for r, ld, cx, _ in drafter_points], [t for *_, t in drafter_points], forget
        )

    def g(self, n: np.ndarray) -> np.ndarray:
        """Token counts [M] (int) -> the token feature [M] (float64): the rows' measured cost beyond one row
        (linear past the largest measured count), or tokens beyond the knee. NumPy: this runs every step."""
        if self._g is None:
            return np.maximum(n - self.knee, 0).astype(np.float64)
        top = len(self._g) - 1
        slope = (self._g[top] - self._g[top // 2]) / (top - top // 2)  # seconds per row at the far end
        return self._g[np.minimum(n, top)] + slope * np.maximum(n - top, 0)

    def _x(self, r: int, n: int, qk: float = 0.0) -> list[float]:
        """Verify-cost features: 1, R, g(N), QK (read from a list: this runs several times a step)."""
        g = self._g_at[n] if n < len(self._g_at) else float(self.g(np.array([n]))[0])
        return [1.0, float(r), g, qk] if self._qk else [1.0, float(r), g]

    def verify(self, r: int, n: int, qk: float = 0.0) -> float:
        return max(self.target(*self._x(r, n, qk)), 1e-6)

    def verify_curve(self, r: int, n: int, extra: int, context: float = 0.0) -> np.ndarray:
        """[extra + 1] seconds (float64) of verifying N = n .. n + extra tokens over r requests (non-decreasing),
        every token after `context` cached tokens (the requests' mean)."""
        g = self.g(np.arange(n, n + extra + 1))  # [extra + 1]
        a0, a1 = self.target.theta[0], self.target.theta[1]
        qk = np.arange(n, n + extra + 1) * (self.per_pair * context / QK_UNIT)  # [extra + 1] seconds of attention
        return np.maximum(a0 + a1 * r + self.per_token * g + qk, 1e-6)

    def draft(self, rd: int, ld: int, cx: int = 0) -> float:
        return max(self.drafter(1.0, rd, rd * ld, cx), 0.0) if rd else 0.0

    @property
    def per_token(self) -> float:
        """The coefficient of g(N): seconds per token beyond the knee, or (a measured staircase) the
        factor from the linear layers' time to the step's, about 1 (never below 1e-6)."""
        return self.target.coef("N", 1e-6)

    @property
    def per_pair(self) -> float:
        """Seconds per thousand query-key pairs of attention (never below 0)."""
        return self.target.coef("QK") if self._qk else 0.0

    @property
    def per_drafted(self) -> tuple[float, float, float]:
        """(per pass, per drafted request, per drafted block row) seconds."""
        return self.drafter.coef("1"), self.drafter.coef("Rd"), self.drafter.coef("RdLd")

    @property
    def per_context(self) -> float:
        """Seconds per context token a drafting request extends its drafter cache with."""
        return self.drafter.coef("Cx")

    def observe_verify(self, r: int, n: int, seconds: float, qk: float = 0.0) -> None:
        self.target.observe(self._x(r, n, qk), seconds)

    def observe_draft(self, rd: int, ld: int, seconds: float, cx: int = 0) -> None:
        if rd:
            self.drafter.observe([1.0, rd, rd * ld, cx], seconds)

    def plausible(self, tol: float = 0.35) -> bool:
        """Every calibration point within `tol` of the fit and the marginal costs positive: a sweep that
        other processes disturbed fails this, and is then used but not cached."""
        ok = self.target.coef("N") > 0 and self.target.coef("R") > 0 and self.drafter.coef("RdLd") >= 0
        fits = [(self.verify(r, n, qk), t) for r, n, qk, t in self.points["target"]]
        fits += [(self.draft(r, ld, cx), t) for r, ld, cx, t in self.points["drafter"]]
        if self.points["rows"]:  # at most a tenth of the row counts slowed by more than `tol` (against the floor: a
            # stretch slowed for a while lifts the isotonic fit with it, `clean_rows`)
            raw = torch.tensor([t for _, t in self.points["rows"]], dtype=torch.float64)
            floor = raw.flip(0).cummin(0).values.flip(0)  # [M] the least seen at N or more rows
            ok = ok and float((raw > (1 + tol) * floor).double().mean()) <= 0.1
        return ok and all(abs(f - t) <= tol * t for f, t in fits)

    def to_json(self) -> dict:
        return {"target": self.points["target"], "drafter": self.points["drafter"], "rows": self.points["rows"]}

    def scaled(self, target: float, drafter: float) -> "StepCost":
        """The same calibration with every target timing (points and rows) times `target` and every drafter
        timing times `drafter`: a machine found that much slower or faster now (`drift`) keeps the grid's shape."""
        if target == drafter == 1.0:
            return self
        tp = [(r, n, qk, target * t) for r, n, qk, t in self.points["target"]]
        dp = [(r, ld, cx, drafter * t) for r, ld, cx, t in self.points["drafter"]]
        return StepCost(tp, dp, self.target.forget, [(n, target * t) for n, t in self.points["rows"]] or None)

    @classmethod
    def from_json(cls, d: dict, forget: float = 0.97) -> "StepCost":
        rows = [tuple(p) for p in d.get("rows") or []]
        return cls([tuple(p) for p in d["target"]], [tuple(p) for p in d["drafter"]], forget, rows or None)


def clean_rows(rows: list[tuple[int, float]]) -> torch.Tensor:
    """[(N, seconds)] sorted by N -> [M] seconds: the least-squares fit that never falls with N (isotonic
    regression, pool-adjacent-violators): more rows never cost less. A point below a smaller count's is
    averaged with it, not taken as the truth for every smaller count: on a shared virtual machine one
    sweep point came out fast (9 rows at 66.6 ms where 1 row took 67.7 and 7 rows 89.5) and the running
    minimum this used to take made every count up to 9 look as cheap as one row, so the policy verified
    16-token blocks that cost 2-3 ms a row. (Each point is already the fastest of several sweeps, so a
    burst of other work rarely reaches it.)"""
    blocks: list[list[float]] = []  # [sum, count] of pooled neighbours, means non-decreasing
    for _, s in rows:
        blocks.append([s, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            tot, cnt = blocks.pop()
            blocks[-1][0] += tot
            blocks[-1][1] += cnt
    return torch.tensor([tot / cnt for tot, cnt in blocks for _ in range(int(cnt))], dtype=torch.float64)


def rows_feature(rows: list[tuple[int, float]]) -> torch.Tensor:
    """[(N, seconds)] of the linear layers -> g [max N + 1]: g(N) = S(N) - S(1), S the cleaned
    measurements (`clean_rows`) interpolated between the measured counts."""
    n = torch.tensor([r for r, _ in rows], dtype=torch.float64)
    t = clean_rows(rows)  # [M] sorted by N
    grid = torch.arange(int(n[-1]) + 1, dtype=torch.float64)
    idx = torch.searchsorted(n, grid).clamp(1, len(n) - 1)  # [G]: the measured count at or above each N
    w = ((grid - n[idx - 1]) / (n[idx] - n[idx - 1])).clamp(0, 1)
    s = t[idx - 1] + w * (t[idx] - t[idx - 1])  # [G]
    return (s - s[1]).clamp(min=0)


# ----------------------------------------------------------------------------- calibration
ROWS_GRID = tuple(range(1, 41)) + tuple(range(44, 97, 4)) + (112, 128, 160, 192)  # token rows time_rows measures
# (requests, tokens each), up to the batch sizes the engine serves (a fit only interpolates well)
TARGET_GRID = ((1, 1), (1, 4), (1, 8), (1, 16), (1, 32), (4, 1), (4, 4), (8, 1), (8, 4), (8, 8), (16, 1), (32, 1), (32, 2))
LONG_CONTEXT = 320  # tokens of context the attention points verify after (QK's coefficient is fitted between them and 32)
LONG_GRID = ((1, 1), (1, 8), (1, 16), (4, 4), (8, 1), (8, 2), (8, 4))  # (requests, tokens each) at LONG_CONTEXT
DRAFTER_GRID = ((1, 2), (1, 16), (4, 4), (8, 2), (8, 8), (32, 2), (32, 4))  # (requests drafted, block length)
EXTEND_GRID = ((1, 4, 32), (8, 4, 8), (8, 4, 32), (32, 4, 4), (32, 4, 16))  # drafted after extending (tokens each)


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


@torch.no_grad()
def time_rows(target, reps: int = 3, grid: tuple[int, ...] = ROWS_GRID, context: int = 8) -> list[tuple[int, float]]:
    """[(N, seconds)]: whole target forwards of one request over N new tokens (after a `context`-token
    prompt, rolled back after each), the fastest of `reps` sweeps over the grid. Whole forwards, not the
    linear layers alone: timed apart, one layer's cache-hot projections missed the step up past 9 rows
    that 30 layers streaming their weights show (on the 2-core AVX-512 machine, two threads: 1-9 rows
    ~57 ms, 11 rows 74, 16 rows 82), and grew 30-40% slower with N."""
    vocab, dev = target.config.vocab_size, target.lm_head.weight.device
    g = torch.Generator().manual_seed(0)
    cache = target.new_cache(1, context + max(grid) + 1)
    target.forward_packed([torch.randint(0, vocab, (context,), generator=g).to(dev)], [cache], logits_last_only=True)
    tokens = torch.randint(0, vocab, (max(grid),), generator=g).to(dev)

    def secs(n: int) -> float:
        t = time.perf_counter()
        target.forward_packed([tokens[:n]], [cache])
        t = time.perf_counter() - t
        cache.crop(context)
        return t

    secs(grid[0])  # warm-up: first calls allocate
    best = [float("inf")] * len(grid)
    for _ in range(reps):
        best = [min(b, secs(n)) for b, n in zip(best, grid)]
    return list(zip(grid, best))


@torch.no_grad()
def measure(
    target,
    drafter,
    target_grid=TARGET_GRID,
    long_grid=LONG_GRID,
    drafter_grid=DRAFTER_GRID,
    extend_grid=EXTEND_GRID,
    context: int = 32,
    reps: int = 3,
    seed: int = 0,
) -> tuple[list[tuple], list[tuple]]:
    """Time verification over `target_grid` after a `context`-token prompt per request and over `long_grid`
    after LONG_CONTEXT tokens, and drafting over `drafter_grid` / `extend_grid`, on dummy requests (one packed
    prefill, then every point verifies or extends and rolls back), the fastest of `reps` sweeps over the whole
    grid per point (a burst of other work then slows one sweep, not every repetition of one point). Each
    drafting point is timed right after a target forward, as drafting runs in a step: timed back to back, the
    drafter's weights stayed in the caches (22 MB in bfloat16, 6 in q4, beside a 32 MB L3) and a q4 drafter's
    pass for one to eight requests came out 20-33% cheaper than after the forward that streams the target's
    weights (AMD EPYC, session 46), so probes and drafting looked cheaper than they are. -> (target points
    (R, N, QK, seconds), drafter points (Rd, Ld, Cx, seconds)), as StepCost takes them."""
    g = torch.Generator().manual_seed(seed)
    dev = target.lm_head.weight.device
    n_req = max(r for r, *_ in target_grid + drafter_grid + extend_grid)
    k_max = max(n for _, n in target_grid + long_grid)
    x_max = max([x for *_, x in extend_grid], default=0)
    vocab = target.config.vocab_size
    caches = [target.new_cache(1, context + k_max + 1) for _ in range(n_req)]
    prompts = [torch.randint(0, vocab, (context,), generator=g).to(dev) for _ in range(n_req)]
    _, feats = target.forward_packed(prompts, caches, logits_last_only=True)  # feats: per request [context, n*H]
    long = [target.new_cache(1, LONG_CONTEXT + k_max + 1) for _ in range(max([r for r, _ in long_grid], default=0))]
    if long:
        target.forward_packed([torch.randint(0, vocab, (LONG_CONTEXT,), generator=g).to(dev) for _ in long], long, logits_last_only=True)
    dcaches = [drafter.new_cache(1, context + x_max + 1) for _ in range(n_req)]
    drafter.extend_many(feats, dcaches)
    extra = [f[:x_max] for f in feats]  # [x_max, n*H] each: features to extend with

    def verify(r: int, n: int, pool: list) -> None:
        target.forward_packed([torch.randint(0, vocab, (n,), generator=g).to(dev) for _ in range(r)], pool[:r])
        for c in pool[:r]:
            c.crop(c.length - n)

    def draft(r: int, ld: int, x: int = 0) -> None:
        if x:
            drafter.extend_many([f[:x] for f in extra[:r]], dcaches[:r])
        h = drafter.draft_many(dcaches[:r], torch.randint(0, vocab, (r,), generator=g).to(dev), ld)  # [r, ld, H]
        drafter.logits(h[:, 1:])  # the policy reads every drafted position's confidence
        for c in dcaches[:r] if x else ():
            c.crop(c.length - x)

    verify(1, 1, caches)  # warm-up: first calls allocate
    if long:
        verify(1, 1, long)
    draft(1, 2)
    points = [(r, n, context, caches) for r, n in target_grid] + [(r, n, LONG_CONTEXT, long) for r, n in long_grid]
    blocks = [(r, min(ld, drafter.block_size), x) for r, ld, x in [(r, ld, 0) for r, ld in drafter_grid] + list(extend_grid)]
    tbest, dbest = [float("inf")] * len(points), [float("inf")] * len(blocks)

    def draft_after_forward(r: int, ld: int, x: int) -> float:
        verify(1, 1, caches)  # as in a step: the target's forward has just streamed its weights through the caches
        return _seconds(lambda: draft(r, ld, x))

    for _ in range(reps):
        tbest = [min(b, _seconds(lambda: verify(r, n, pool))) for b, (r, n, _, pool) in zip(tbest, points)]
        dbest = [min(b, draft_after_forward(r, ld, x)) for b, (r, ld, x) in zip(dbest, blocks)]
    return (
        [(r, r * n, attention_pairs([n] * r, [c] * r), t) for (r, n, c, _), t in zip(points, tbest)],
        [(r, ld, r * x, t) for (r, ld, x), t in zip(blocks, dbest)],
    )


def calibrate(target, drafter, context: int = 32, reps: int = 3, seed: int = 0) -> StepCost:
    """The step costs of these models on this machine: `measure` over the whole grids and the row staircase
    of whole forwards (`time_rows`). 58 s for SmolLM2 on two threads of the 2-core AVX-512 EPYC (session 41;
    31 s before the long-context points)."""
    target_points, drafter_points = measure(target, drafter, context=context, reps=reps, seed=seed)
    return StepCost(target_points, drafter_points, rows=time_rows(target, reps))


# a few points timed again when a cached calibration is loaded (`drift`): 8 requests verifying one token each
# and 8 each (past the knee), and drafting 8 requests (what a probe step or a small batch's drafting costs)
SPOT_TARGET, SPOT_DRAFTER = ((8, 1), (8, 8)), ((8, 2),)
SPOT_TOLERANCE = 0.3  # a cached point off by more than this share: the calibration is measured again
SPOT_REPS = 3  # sweeps over the points, each keeping its fastest (twice as many again where one is off)
SPOT_FLOOR = 2e-3  # seconds: cached points shorter than this are not compared (timer noise on small models)
# cached calibrations this process has checked (a bench builds an engine a cell) -> (target, drafter) speed found then:
# fresh / cached seconds, by which the cache is scaled (`StepCost.scaled`)
_CHECKED: dict[Path, tuple[float, float]] = {}


def drift(target, drafter, cost: StepCost) -> tuple[float | None, tuple[float, float]]:
    """How far a cached calibration is from this machine now: (the largest |fresh / cached - 1| over the SPOT_*
    points (timed as `measure` does, ~1 s for SmolLM2), those cached at SPOT_FLOOR seconds or more, None where
    none is; (target, drafter): each pass's fresh / cached seconds, the geometric mean over its compared points,
    1 where none is). The cache is keyed by processor model, and two VMs of one kind differed by 35-55% in the
    drafter's pass and in where the row staircase rose (AMD EPYC, session 49): a calibration measured on
    the other priced drafting too dear, and live refits correct the drafter's coefficients only where
    something drafts. Where a point is off, the points are timed once more and each keeps the faster of its
    two: the fastest of three sweeps still caught bursts of other work on a shared VM (8 requests drafting
    2 tokens, cached at 3.65 ms, timed 3.6-5.3 ms by successive checks): one check was off at six of six
    process starts in a slow hour, each measuring the grid anew (~30 s); a second look of three sweeps kept
    four of the six on the cache (session 51), and it takes six sweeps."""

    def seconds(target_points, drafter_points) -> dict:  # (pass, its point) -> seconds
        return {("t", *p[:3]): p[3] for p in target_points} | {("d", *p[:3]): p[3] for p in drafter_points}

    def ratios(fresh: dict) -> dict:  # (pass, its point) -> fresh / cached, the points cached at SPOT_FLOOR or more
        return {k: t / cached[k] for k, t in fresh.items() if cached.get(k, 0.0) >= SPOT_FLOOR}

    def worst(fresh: dict) -> float | None:
        off = [abs(r - 1.0) for r in ratios(fresh).values()]
        return max(off) if off else None

    cached = seconds(cost.points["target"], cost.points["drafter"])
    fresh = seconds(*measure(target, drafter, SPOT_TARGET, (), SPOT_DRAFTER, (), reps=SPOT_REPS))
    if (off := worst(fresh)) is not None and off > SPOT_TOLERANCE:
        again = seconds(*measure(target, drafter, SPOT_TARGET, (), SPOT_DRAFTER, (), reps=2 * SPOT_REPS))
        fresh = {k: min(t, again[k]) for k, t in fresh.items()}
        off = worst(fresh)
    logs = [[math.log(r) for k, r in ratios(fresh).items() if k[0] == kind] for kind in ("t", "d")]
    return off, tuple(math.exp(sum(v) / len(v)) if v else 1.0 for v in logs)


def processor(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (/proc/cpuinfo; the platform's where there is none)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        return next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine_key(target, drafter) -> dict:
    """What a calibration depends on: processor, threads, torch, the target's weights and both dtypes."""
    proc = processor(target.lm_head.weight.device)
    from adaflash.kernels.cpu_build import signature
    from adaflash.layers import MIN_ROWS, PAD_ROWS
    from adaflash.quant import model_form
    from adaflash.target import fingerprint

    return {
        "processor": proc,
        "isa": torch.backends.cpu.get_cpu_capability(),  # the vector code ATen runs (held lower by ATEN_CPU_CAPABILITY: scripts/as_avx2.py)
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "attention": "kv-pool",  # the engine's attention (ragged over one KV pool since issue 21): its step costs differ
        "rows": "forward",  # calibrations since the row staircase (time_rows) is timed on whole forwards
        "context": LONG_CONTEXT,  # calibrations since verification is also timed at long contexts (the QK feature)
        "kernels": signature(),  # the C++ kernels' sources and flags: other kernels, other step costs
        "drafts": "after-forward",  # calibrations since drafting points are timed after a target forward (caches emptied)
        "small_rows": [PAD_ROWS, MIN_ROWS],  # oneDNN calls of 1..PAD_ROWS rows padded to MIN_ROWS: they cost what 4 rows do
        "target": fingerprint(target),
        "target_dtype": model_form(target),
        "drafter": f"{drafter.config.num_layers}x{drafter.config.hidden_size}",
        "drafter_dtype": model_form(drafter),
        "draft_vocab": 0 if drafter.vocab is None else int(drafter.vocab.numel()),
    }


def load_or_calibrate(target, drafter, cache_dir: Path | None = None, refresh: bool = False) -> StepCost:
    """The cached calibration for this processor/model/dtypes where a few of its points, timed again
    (`drift`), are within SPOT_TOLERANCE of what it holds, its target and drafter timings scaled by how much
    faster or slower those points ran now; otherwise a fresh one (then cached). Unscaled, a calibration 15% off
    (SmolLM2 float32 on a 2-core Xeon: 8 requests of one token each cached at 46 ms, timed at 38-40 a session
    later) priced every plain step dearer, drafting's share of a step cheaper, and every fresh engine (a bench
    builds one a cell) started so: its verify model, refitted live, was still 7-9% over the forwards it priced
    after 80 steps at MT-Bench c=8."""
    from adaflash.target import cache_root

    key = machine_key(target, drafter)
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir or cache_root() / "cost") / f"{name}.json"
    if path.exists() and not refresh:
        try:
            cost = StepCost.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            cost = None  # unreadable: measure again
        if cost is not None:
            off, speed = (None, _CHECKED[path]) if path in _CHECKED else drift(target, drafter, cost)
            if off is None or off <= SPOT_TOLERANCE:
                log.info("step costs of this machine and models: cached in %s, timed now at %.2fx / %.2fx (target / drafter)", path, *speed)
                _CHECKED[path] = speed
                return cost.scaled(*speed)
            log.warning(  # another machine of this processor model wrote it, or this one is loaded now
                "the cached step costs in %s are %.0f%% off what this machine measures now: measuring them again", path, 100 * off
            )
    log.info("measuring the step costs of this machine and models for the cost policy (about a minute, once: kept in %s)", path)
    t0 = time.perf_counter()
    cost = calibrate(target, drafter)
    log.info(  # a server's first start on a machine takes this long more (58 s for SmolLM2 on two threads)
        "step costs of this machine and models measured in %.0f s%s",
        time.perf_counter() - t0,
        f", cached in {path}" if cost.plausible() else " (disturbed by other processes: not cached)",
    )
    if cost.plausible():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, **cost.to_json()}, indent=1) + "\n")
        tmp.replace(path)  # atomic: two servers starting together both write a whole file
        _CHECKED[path] = (1.0, 1.0)
    return cost
