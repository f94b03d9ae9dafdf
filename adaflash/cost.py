"""What an engine step costs on this machine, measured once and kept up to date from live steps.

A step's wall time is modelled as linear in what it does (seconds):

    verification   (target.forward_packed)       t_T = a0 + a1 * R + a2 * max(N - knee, 0)   R requests, N tokens verified
    drafting       (draft_many + draft logits)   t_D = d0 + d1 * Rd + d2 * Rd * Ld            Rd requests drafted, blocks of Ld

The knee is the roofline's shape: a forward over few token rows is bound by reading the weights, so
rows are nearly free until the batch becomes compute-bound (a single request's forward over 1 or 8
tokens costs the same on a CPU), then each row costs a2 (one more row through every linear). a1 is the
per-request attention work. The knee is fitted on the calibration points (the candidate with the
smallest relative residual; 0 gives a model linear in N); on a GPU it lies far out. The cost-aware
verify policy (adaflash.policy_cost) reads the step's seconds as a function of the tokens it verifies.

`calibrate` times a small grid of both passes (a few seconds) on dummy caches. `load_or_calibrate`
keeps that under the user cache (`cache_root()/cost/`), keyed by CPU/GPU model, torch threads, the
target's fingerprint and both dtypes, so a restart on the same machine measures nothing (a calibration
that does not fit the linear model, disturbed by other processes, is used but not kept). Live steps
then refit the coefficients (`Linear.observe`: least squares with exponential forgetting, pulled
toward the calibration so directions live traffic never varies, e.g. R at a steady concurrency, keep
their measured values instead of drifting), so the model follows a machine whose load changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


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
        self._a0 = self.prior_weight * x.T @ x + self.ridge * torch.eye(d, dtype=torch.float64)  # [d, d] prior information
        self._b0 = self.prior_weight * x.T @ y  # [d]
        self._a, self._b = torch.zeros(d, d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)  # live information
        self._solve()

    def _solve(self) -> None:
        self.theta = torch.linalg.solve(self._a0 + self._a, self._b0 + self._b)  # [d]

    def __call__(self, *x: float) -> float:
        return float(torch.tensor(x, dtype=torch.float64) @ self.theta)

    def observe(self, x: list[float], y: float) -> None:
        """One live measurement: y seconds for features x."""
        xt = torch.tensor(x, dtype=torch.float64)  # [d]
        pred = max(float(xt @ self.theta), 1e-9)
        y = min(max(y, (1 - self.clip) * pred), (1 + self.clip) * pred)
        self._a = self.forget * self._a + torch.outer(xt, xt)
        self._b = self.forget * self._b + xt * y
        self._solve()

    def coef(self, name: str, floor: float = 0.0) -> float:
        """One coefficient, at least `floor` (a fit on noisy steps can go slightly negative)."""
        return max(float(self.theta[self.names.index(name)]), floor)


KNEES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)  # candidate knees (tokens per step) of the verify cost


def fit_knee(points: list[tuple[int, int, float]]) -> int:
    """The knee of t = a0 + a1 R + a2 max(N - knee, 0) that fits (R, N, seconds) points best, by least
    squares on relative errors; near-ties go to the smaller knee (the linear model, knee 0, when it fits)."""
    y = torch.tensor([t for *_, t in points], dtype=torch.float64)  # [n]
    w = 1.0 / y  # relative errors: a 50 ms and a 500 ms point count alike
    best, best_err = 0, float("inf")
    for k in KNEES:
        x = torch.tensor([[1.0, r, max(n - k, 0)] for r, n, _ in points], dtype=torch.float64)  # [n, 3]
        if k and not bool((x[:, 2] > 0).any()):
            break  # no point beyond this knee: its slope is not measured
        theta = torch.linalg.lstsq(x * w[:, None], y * w).solution  # [3]
        if float(theta[2]) <= 0:
            continue
        err = float((((x @ theta) - y) * w).square().sum())
        if err < 0.99 * best_err - 1e-12:  # a larger knee must fit clearly better (knees <= min N are the same model)
            best, best_err = k, err
    return best


class StepCost:
    """The two linear models; `verify(R, N)` and `draft(Rd, Ld)` in seconds (0 drafted = no pass)."""

    def __init__(self, target_points: list[tuple[int, int, float]], drafter_points: list[tuple[int, int, float]], forget: float = 0.97):
        self.points = {"target": list(target_points), "drafter": list(drafter_points)}
        self.knee = fit_knee(self.points["target"])
        self.target = Linear(["1", "R", "N"], [self._x(r, n) for r, n, _ in target_points], [t for *_, t in target_points], forget)
        self.drafter = Linear(
            ["1", "Rd", "RdLd"], [[1.0, r, r * ld] for r, ld, _ in drafter_points], [t for *_, t in drafter_points], forget
        )

    def _x(self, r: int, n: int) -> list[float]:
        """Verify-cost features: 1, R, tokens beyond the knee."""
        return [1.0, float(r), float(max(n - self.knee, 0))]

    def verify(self, r: int, n: int) -> float:
        return max(self.target(*self._x(r, n)), 1e-6)

    def verify_curve(self, r: int, n: int, extra: int) -> torch.Tensor:
        """[extra + 1] seconds of verifying N = n .. n + extra tokens over r requests (non-decreasing)."""
        beyond = (torch.arange(n, n + extra + 1, dtype=torch.float64) - self.knee).clamp(min=0)  # [extra + 1]
        a0, a1 = float(self.target.theta[0]), float(self.target.theta[1])
        return (a0 + a1 * r + self.per_token * beyond).clamp(min=1e-6)

    def draft(self, rd: int, ld: int) -> float:
        return max(self.drafter(1.0, rd, rd * ld), 0.0) if rd else 0.0

    @property
    def per_token(self) -> float:
        """Seconds one more verified token beyond the knee adds to a step (never below a microsecond)."""
        return self.target.coef("N", 1e-6)

    @property
    def per_drafted(self) -> tuple[float, float, float]:
        """(per pass, per drafted request, per drafted block row) seconds."""
        return self.drafter.coef("1"), self.drafter.coef("Rd"), self.drafter.coef("RdLd")

    def observe_verify(self, r: int, n: int, seconds: float) -> None:
        self.target.observe(self._x(r, n), seconds)

    def observe_draft(self, rd: int, ld: int, seconds: float) -> None:
        if rd:
            self.drafter.observe([1.0, rd, rd * ld], seconds)

    def plausible(self, tol: float = 0.35) -> bool:
        """Every calibration point within `tol` of the fit and the marginal costs positive: a sweep that
        other processes disturbed fails this, and is then used but not cached."""
        ok = self.target.coef("N") > 0 and self.target.coef("R") > 0 and self.drafter.coef("RdLd") >= 0
        fits = [(self.verify(r, n), t) for r, n, t in self.points["target"]]
        fits += [(self.draft(r, ld), t) for r, ld, t in self.points["drafter"]]
        return ok and all(abs(f - t) <= tol * t for f, t in fits)

    def to_json(self) -> dict:
        return {"target": self.points["target"], "drafter": self.points["drafter"]}

    @classmethod
    def from_json(cls, d: dict, forget: float = 0.97) -> "StepCost":
        return cls([tuple(p) for p in d["target"]], [tuple(p) for p in d["drafter"]], forget)


# ----------------------------------------------------------------------------- calibration
# (requests, tokens each), up to the batch sizes the engine serves (a fit only interpolates well)
TARGET_GRID = ((1, 1), (1, 4), (1, 8), (1, 16), (1, 32), (4, 1), (4, 4), (8, 1), (8, 4), (8, 8), (16, 1), (32, 1), (32, 2))
DRAFTER_GRID = ((1, 2), (1, 16), (4, 4), (8, 2), (8, 8), (32, 2), (32, 4))  # (requests drafted, block length)


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


@torch.no_grad()
def calibrate(target, drafter, context: int = 32, reps: int = 3, seed: int = 0) -> StepCost:
    """Time verification and drafting over TARGET_GRID / DRAFTER_GRID on dummy requests with a
    `context`-token prompt each (one packed prefill, then every point verifies and rolls back), the
    fastest of `reps` sweeps over the whole grid per point (a burst of other work then slows one sweep,
    not every repetition of one point). About 8 s for SmolLM2 on two idle CPU cores."""
    g = torch.Generator().manual_seed(seed)
    dev = target.lm_head.weight.device
    n_req = max(r for r, _ in TARGET_GRID + DRAFTER_GRID)
    k_max = max(n for _, n in TARGET_GRID)
    vocab = target.config.vocab_size
    caches = [target.new_cache(1, context + k_max + 1) for _ in range(n_req)]
    prompts = [torch.randint(0, vocab, (context,), generator=g).to(dev) for _ in range(n_req)]
    _, feats = target.forward_packed(prompts, caches, logits_last_only=True)  # feats: per request [context, n*H]
    dcaches = [drafter.new_cache(1, context + 1) for _ in range(n_req)]
    drafter.extend_many(feats, dcaches)

    def verify(r: int, n: int) -> None:
        target.forward_packed([torch.randint(0, vocab, (n,), generator=g).to(dev) for _ in range(r)], caches[:r])
        for c in caches[:r]:
            c.crop(c.length - n)

    def draft(r: int, ld: int) -> None:
        h = drafter.draft_many(dcaches[:r], torch.randint(0, vocab, (r,), generator=g).to(dev), ld)  # [r, ld, H]
        drafter.logits(h[:, 1:])  # the policy reads every drafted position's confidence

    verify(1, 1)  # warm-up: first calls allocate
    draft(1, 2)
    blocks = [(r, min(ld, drafter.block_size)) for r, ld in DRAFTER_GRID]
    tbest, dbest = [float("inf")] * len(TARGET_GRID), [float("inf")] * len(blocks)
    for _ in range(reps):
        tbest = [min(b, _seconds(lambda: verify(r, n))) for b, (r, n) in zip(tbest, TARGET_GRID)]
        dbest = [min(b, _seconds(lambda: draft(r, ld))) for b, (r, ld) in zip(dbest, blocks)]
    return StepCost([(r, r * n, t) for (r, n), t in zip(TARGET_GRID, tbest)], [(r, ld, t) for (r, ld), t in zip(blocks, dbest)])


def machine_key(target, drafter) -> dict:
    """What a calibration depends on: processor, threads, torch, the target's weights and both dtypes."""
    dev = target.lm_head.weight.device
    if dev.type == "cuda":
        proc = torch.cuda.get_device_name(dev)
    else:
        proc = platform.processor() or platform.machine()
        try:
            proc = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name"))
        except (OSError, StopIteration):
            pass
    from adaflash.quant import weight_format
    from adaflash.target import fingerprint

    return {
        "processor": proc,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "attention": "kv-pool",  # the engine's attention (ragged over one KV pool since issue 21): its step costs differ
        "target": fingerprint(target),
        "target_dtype": str(target.lm_head.weight.dtype) + ("" if (fmt := weight_format(target)) == "float" else f"+{fmt}"),
        "drafter": f"{drafter.config.num_layers}x{drafter.config.hidden_size}",
        "drafter_dtype": str(drafter.fc.weight.dtype),
        "draft_vocab": 0 if drafter.vocab is None else int(drafter.vocab.numel()),
    }


def load_or_calibrate(target, drafter, cache_dir: Path | None = None, refresh: bool = False) -> StepCost:
    """The cached calibration for this machine/model/dtypes, or a fresh one (then cached)."""
    from adaflash.target import cache_root

    key = machine_key(target, drafter)
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir or cache_root() / "cost") / f"{name}.json"
    if path.exists() and not refresh:
        try:
            return StepCost.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            pass  # unreadable: measure again
    cost = calibrate(target, drafter)
    if cost.plausible():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, **cost.to_json()}, indent=1) + "\n")
        tmp.replace(path)  # atomic: two servers starting together both write a whole file
    return cost
