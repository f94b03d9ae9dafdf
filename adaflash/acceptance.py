"""Per-position acceptance of drafts, learnt online: the features, the labels a verified round gives, the
logistic regression refitted on them, and each request's running acceptance.

P(position j accepted | positions < j accepted) is a logistic regression over a few features: before drafting
(`prior_features`) the position and the request's running acceptance; after drafting (`block_features`) also the
drafter's own confidence at that position. Labels are free: every verified round labels its positions up to the
first rejection (`round_labels`; later ones are censored). The cost policy (adaflash.policy_cost) weighs these
probabilities against what a step costs; `adaflash policy-eval` scores them on held-out rounds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

EPS = 1e-4
PRIOR_NAMES = ("bias", "log_pos", "running")  # features before drafting
BLOCK_NAMES = PRIOR_NAMES + ("confidence",)  # after drafting


def as_np(t) -> np.ndarray:
    """A tensor (or array) as a float64 NumPy array: the cost policy runs every step on a few hundred numbers,
    where NumPy's per-call cost is a fraction of torch's."""
    return t.detach().double().numpy() if isinstance(t, torch.Tensor) else np.asarray(t, dtype=np.float64)


def _logit(p) -> np.ndarray:
    p = np.minimum(np.maximum(as_np(p), EPS), 1 - EPS)  # not np.clip: its wrapper costs more than the math here
    return np.log(p / (1 - p))


def confidence(logits: torch.Tensor) -> np.ndarray:
    """Draft logits [R, J, Vd] -> top-1 probability at each drafted position [R, J] (float64)."""
    return torch.softmax(logits, -1, dtype=torch.float32).amax(-1).double().numpy()  # one fused kernel, no float copy


@functools.lru_cache(maxsize=64)
def _log_pos(n_pos: int) -> np.ndarray:
    """[J] log of positions 1..J (read-only: shared by every step)."""
    out = np.log(np.arange(1, n_pos + 1, dtype=np.float64))
    out.flags.writeable = False
    return out


def prior_features(running, n_pos: int, d: int = 3) -> np.ndarray:
    """Running acceptance [R] -> features [R, J, d] of positions 1..J before drafting (PRIOR_NAMES; d > 3:
    further columns left to fill)."""
    run = _logit(running)  # [R]
    x = np.empty((run.shape[0], n_pos, d))
    x[..., 0] = 1.0
    x[..., 1] = _log_pos(n_pos)
    x[..., 2] = run[:, None]
    return x


def block_features(conf, running) -> np.ndarray:
    """Drafter confidence [R, J], running acceptance [R] -> features [R, J, 4] (BLOCK_NAMES); the prior
    features are its first three columns."""
    conf = as_np(conf)
    x = prior_features(running, conf.shape[1], 4)
    x[..., 3] = _logit(conf)
    return x


def round_labels(accepted, drafts, n_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """Accepted drafts [R] of drafts verified [R] -> (label [R, J] float64, 1 = accepted; seen [R, J] bool):
    positions up to the first rejection are observed, later ones are not (censored)."""
    accepted, drafts = np.asarray(accepted), np.asarray(drafts)
    j = np.arange(n_pos)[None]  # [1, J]: position j + 1
    return (j < accepted[:, None]).astype(np.float64), j < np.minimum(accepted + 1, drafts)[:, None]


class AcceptanceModel:
    """P(accepted) = sigmoid(theta . x), refitted online on every batch of labels: the Laplace update of
    a logistic regression (the posterior's mode, found by Newton steps, and its curvature as the new
    information). The information from past labels decays by `forget` per label toward the prior (mean
    theta0, weight `prior` per feature): the model remembers about 1 / (1 - forget) labels, so traffic of
    a new domain moves it within a few hundred labels (a few steps of a batch) and it never drifts where
    no label arrives."""

    def __init__(self, theta0: list[float], prior: float = 1.0, forget: float = 0.995, iters: int = 6, batch: int = 1):
        self.theta0 = np.array(theta0, dtype=np.float64)  # [d]; NumPy: a few tiny ops every step, where
        self.theta = self.theta0.copy()  # torch's per-call overhead was most of the policy's time
        self.prior, self.forget, self.iters = prior, forget, iters
        self.info = prior * np.eye(len(theta0))  # [d, d]
        self.batch = batch  # labels gathered before a refit (`update`)
        self._held: list[tuple[np.ndarray, np.ndarray]] = []

    @property
    def held(self) -> int:
        """Labels given to `update` and not yet fitted (a refit comes once `batch` are in)."""
        return sum(len(h[1]) for h in self._held)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Features [..., d] -> P(accepted) [...] (float64)."""
        return _sigmoid(as_np(x) @ self.theta)

    def update(self, x: np.ndarray, y: np.ndarray) -> None:
        """Observed features [n, d] with labels [n] in [0, 1] (a probability where the label is not seen).

        Newton steps to the mode of log-likelihood + the decayed Gaussian (theta - its mean, precision
        `info`) + the pull toward theta0, each step halved until the objective rises. One undamped step
        from the old mean overshot: with confident predictions (p = 0.94, curvature p(1 - p) small) and a
        round's features collinear (bias and running acceptance are constant within a request's block),
        a first round that accepted 3 of 7 drafts moved the prior model from P = 0.97 to 0.004 at
        position 1, and a request served at concurrency 1 stopped drafting for dozens of steps."""
        if x.shape[0] == 0:
            return
        self._held.append((as_np(x), as_np(y)))
        if self.held < self.batch:  # refit once `batch` labels are in: a refit costs the
            return  # same for 15 labels as for 60, and at concurrency 1 a step brings one round's
        xs, ys = (np.concatenate(a) for a in zip(*self._held))  # [n, d], [n]
        self._held = []
        decay = self.forget ** xs.shape[0]
        keep = (1 - decay) * self.prior
        old = decay * self.info  # [d, d] the past labels' information, decayed
        base = old + keep * np.eye(len(self.theta))
        mean = self.theta

        def objective(t: np.ndarray) -> float:
            z = xs @ t  # [n]
            dt, d0 = t - mean, t - self.theta0
            return float((ys * _logsig(z) + (1 - ys) * _logsig(-z)).sum() - 0.5 * dt @ old @ dt - 0.5 * keep * d0 @ d0)

        theta, best = mean, None
        for it in range(self.iters):
            p = _sigmoid(xs @ theta)  # [n]
            hess = base + xs.T @ (xs * (p * (1 - p))[:, None])  # [d, d]
            step = np.linalg.solve(hess, xs.T @ (ys - p) - old @ (theta - mean) - keep * (theta - self.theta0))  # [d]
            if it == 0 and float(np.abs(xs @ step).max()) < 0.25:  # a small move of every prediction: the step is the mode
                theta = theta + step
                break
            best = objective(theta) if best is None else best
            for _ in range(20):  # halve until the objective rises
                val = objective(theta + step)
                if val >= best:
                    break
                step = step / 2
            else:
                break
            theta, best = theta + step, val
            if float(np.abs(step).max()) < 1e-4:
                break
        p = _sigmoid(xs @ theta)
        self.theta, self.info = theta, base + xs.T @ (xs * (p * (1 - p))[:, None])


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # no overflow for any z


def _logsig(z: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -z)


@dataclass
class Running:
    """Discounted per-request acceptance counts over verified positions (accepted, observed), shrunk
    toward the acceptance of all requests: what `running` means in the features."""

    decay: float = 0.8  # per round of this request
    strength: float = 4.0  # pseudo-observations of the global rate
    g_acc: float = 1.0  # global counts (decayed per batch or step, see `tick`), start at 0.5
    g_seen: float = 2.0
    g_max: float = 64.0  # the global counts hold at most this many observations (see `tick`)
    acc: dict[str, float] = field(default_factory=dict)
    seen: dict[str, float] = field(default_factory=dict)
    _labelled: bool = field(default=False, init=False, repr=False)  # `update` ran since the last `tick`

    def rate(self, ids: list[str]) -> np.ndarray:
        """[R] running conditional acceptance of these requests (float64)."""
        g = self.strength * self.g_acc / self.g_seen
        return np.array([(self.acc.get(i, 0.0) + g) / (self.seen.get(i, 0.0) + self.strength) for i in ids])

    def update(self, ids: list[str], acc: list[float], seen: list[float], batch_decay: float = 0.97) -> None:
        """Accepted [R] and observed [R] positions of one round per request."""
        for i, a, s in zip(ids, acc, seen):
            self.acc[i] = self.decay * self.acc.get(i, 0.0) + a
            self.seen[i] = self.decay * self.seen.get(i, 0.0) + s
        self.g_acc = batch_decay * self.g_acc + float(sum(acc))
        self.g_seen = batch_decay * self.g_seen + float(sum(seen))
        if self.g_seen > self.g_max:
            self.g_acc, self.g_seen = self.g_acc * self.g_max / self.g_seen, self.g_max
        self._labelled = True

    def tick(self, step_decay: float = 0.9) -> None:
        """Once per engine step: a step that labelled no round (nobody drafted) decays the global counts
        (their ratio kept, down to 2 observations' worth), and `update` caps them at g_max observations.
        Before, they decayed by 0.97 per labelled batch only and held hundreds of observations: the
        global rate stayed where the last traffic that drafted left it (after GSM8K at c=8, every new
        MT-Bench request started from GSM8K's 0.62, where MT-Bench's first drafts are accepted ~0.3, and
        drafted its first rounds at a loss, round after round). Now the few labels of new traffic (its
        first rounds, the probes) soon outweigh the old ones, in either direction of a shift."""
        if not self._labelled and self.g_seen > 2.0:
            f = max(step_decay, 2.0 / self.g_seen)
            self.g_acc, self.g_seen = f * self.g_acc, f * self.g_seen
        self._labelled = False

    def forget(self, ids: list[str]) -> None:
        for i in ids:
            self.acc.pop(i, None)
            self.seen.pop(i, None)
