"""Cost-aware verify lengths: per-position acceptance, learnt online, weighed against what a step costs.

Per step the policy picks, for every request, the verify length L (tokens incl. the anchor; 1 = plain
decoding) that maximises the batch's expected committed tokens per second:

    E = sum_i (1 + sum_{j < L_i} c_ij),   c_ij = prod_{m <= j} p_im     expected tokens committed
    T = t_T(R, sum_i L_i, context) + t_D(drafted requests, block length)       adaflash.cost.StepCost

p_ij = P(position j accepted | positions < j accepted). c_ij falls with j, so for any number n of drafts
verified the best are the n largest c_ij, prefixes of the blocks: one scan over the drafts by falling
c_ij, each prefix priced by the step-cost curve (flat below the knee where a forward is memory-bound,
then linear), finds the best n (adaflash.choice: the choice's pure functions). Plain decoding is always one
of the choices, so the policy can fall back to it.

Three acceptance models (`adaflash.acceptance.AcceptanceModel`, logistic regressions refitted on every
verified round: the labels are free, accepted positions 1, the first rejected 0, later ones unobserved):
- prompt-lookup chains (`lookup_lengths`): from the position and the request's running chain
  acceptance, the prefix of a request's chain worth verifying; a refused chain leaves the request to
  drafting or plain decoding (one chain token is verified as a probe after 4, 8, .. refusals);
- before drafting (`select`, `plan_drafts`): from the position and the request's running acceptance,
  which requests draft at all and how long a block the drafter runs. A request where no draft pays
  skips the drafter pass and verifies its anchor alone; it is drafted again as a probe after 4, 8, ..
  64 skipped steps (on every 4th step, so that probes share a drafter pass, and at most one request
  in 8 (or two) per step), verifying PROBE_DRAFTS drafts however unsure the drafter is (a probe is there
  to learn), so a request whose text turns predictable is picked up again; no request
  the plan would leave undrafted joins a probe's pass; the plan's drafting requests, every request that can
  draft, and nobody are then priced over scenarios of the requests' recent rounds, at the verify lengths each
  would leave (`CostPolicy._options`, `choose_block`), and the best of them is drafted at its best block;
- after drafting (`lengths`, `choose_lengths`): adds the drafter's own confidence per position (top-1
  probability over the draft vocabulary) and picks the verify lengths; the drafting cost is spent by
  then. (The length head's block prediction added nothing on held-out rounds where the confidence is
  known: `adaflash policy-eval`, docs/benchmarks.md.)
A prompt prefilled in the step is sunk: the choice maximises the rate of the step's decoding part
(`CostPolicy._decoding`). The step-cost model (adaflash.cost) prices the two passes; what they leave out (the step's other
work, everything else drafting brings) is learnt from whole steps (`Overrun`): each step's wall time
against what the model predicted without and with its drafts.
Greedy output is the target's whatever the lengths: the policy only decides how much is verified.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from adaflash.acceptance import AcceptanceModel, Running, block_features, confidence, prior_features, round_labels
from adaflash.choice import DraftPlan, choose_block, choose_lengths, plan_drafts
from adaflash.cost import StepCost, load_or_calibrate
from adaflash.policies import VerifyPolicy
from adaflash.request import RequestState

PROBE_SYNC = 4  # undrafted requests are probed on every 4th step only, together
PROBE_SHARE = 8  # at most one request in 8 (or two) is probed in a step
EXPLORE = 0.02  # probes spend at most this share of the time (see CostPolicy._probes) ...
PAYOFF_FLOOR = 0.125  # ... times the share of recent probes that paid, never below this
PAYOFF_FORGET = 0.9  # that share: over about the last 10 probes
PAYOFF_PLANS = 3  # a probe paid where its request then drafted at this many plans in a row, unforced
# a probe verifies this many drafts (where its request has room): labels to learn from, not a bet. With one draft
# a probe (position 1 accepted ~0.56 a probe on GSM8K, ~0.41 on MT-Bench) the policy found GSM8K's gain after MT-Bench
# 5 rounds into it; with three, in the third in one order of the traffic, though over five orders its median rounds
# stay at plain decoding (docs/benchmarks.md, "A probe verifies three drafts", "After a domain shift")
PROBE_DRAFTS = 3
LABEL_BATCH = 32  # labels the acceptance models gather before a refit
RECENT = 32  # a request's recent rounds whose block-model predictions the plans' block choice reads (`choose_block`) ...
SCENARIOS = 32  # ... as many as keep scenarios x drafting requests within this (a batch pools its requests' rounds)


def room(states, n_pos: int) -> np.ndarray:
    """[R, J] bool: the block positions 1..J each request can still commit (`RequestState.budget`: drafts beyond
    max_new_tokens are never verified): a plan counts no tokens there, and a request at its last token is no probe."""
    budget = np.array([s.budget for s in states], dtype=np.int64)  # [R]
    return np.arange(n_pos)[None] < budget[:, None]


def mean_context(states) -> float:
    """The tokens each request's verification attends to before its new ones (its prompt and output but the
    anchor), averaged: the step-cost model prices every verified token's attention at it."""
    return sum(len(s.req.prompt_ids) + len(s.out) - 1 for s in states) / max(len(states), 1)


# ----------------------------------------------------------------------------- the policy
class Overrun:
    """What the step-cost model misses, learnt from whole steps: W - t_T(R, the step's tokens as verified) =
    o + k * E, W the step's wall time, E the seconds the model predicted the drafting pass to take. o is the
    step's work outside both passes (selection, proposing, commits); k how far off the predicted cost of
    drafting is, all it brings included (drafting from scattered pool rows, the draft logits, proposing and
    checking drafts: on a 2-core CPU at concurrency 32 drafting cost about twice what its model said, and at
    concurrency 1 about 1.8x). The verification itself is not scaled: its own model is refitted on every
    step, and scaling its increments by a k learnt from the drafting pass made verifying one more token look
    up to 1.8x dearer than it is, so the policy verified 2.9 tokens a round at concurrency 1 where a fixed 6
    committed more (HumanEval `cost-lookup` 0.84x -> 0.95x the best fixed length).
    Least squares, pulled toward o = 0, k = 1 by `weight` steps' worth of evidence at E = `scale`
    seconds. Steps without drafts (E = 0) and with drafts are remembered apart, each kind forgetting
    per step of its own kind (memory ~1 / (1 - forget) such steps): o is the plain steps' mean overrun
    while they hold at least `plain_min` steps' worth, and k fits the drafting steps' rest. Where nearly
    every step drafts, the few plain ones still pin o, so what drafting costs beyond its prediction lands
    in k (which decides whether to draft) rather than in o (which both choices pay). The plain steps'
    evidence also ages by `plain_age` per drafting step, and once it holds less than `plain_min` steps'
    worth, o and k are both fitted on the drafting steps, o never above what the plain steps showed (0
    before any): o is paid by plain decoding too, so drafting steps may lower it but not raise it. Fitted
    freely there, an engine's first steps (every request drafting, no plain step yet) set o to what
    drafting overran by: at GSM8K c=32 the first wave's all-drafting steps took 120-260 ms where a plain
    step takes 60, o rose to 71-86 ms, plain decoding looked as dear as drafting, and all 32 requests
    drafted for 8 more steps (2-3% of the cell's time); charged to k, that overrun makes drafting dearer
    and the next plan decodes plainly, whose steps then measure o.
    Before, one plain step pinned o for as long as no other came: under another process's load, a first
    step that overran by 355 ms set o there, every step then looked cheap to draft beside it, so every
    step drafted and no plain step came to correct it (MT-Bench c=8: 88% of rounds drafted at ~0.88x
    plain decoding)."""

    def __init__(
        self,
        forget: float = 0.95,
        weight: float = 4.0,
        scale: float = 0.02,
        k_max: float = 4.0,
        plain_age: float = 0.98,
        plain_min: float = 0.5,
    ):
        self.forget, self.k_max, self.plain_age, self.plain_min = forget, k_max, plain_age, plain_min
        self.p0 = (1e-9, weight * scale**2)  # prior information on o and k (diagonal), pulling toward (0, 1)
        self.plain = [0.0, 0.0]  # plain steps: (count, sum of W'), forgetting; Python floats: this runs every step
        self.drafted = [0.0, 0.0, 0.0, 0.0, 0.0]  # drafting steps: sums of 1, E, E^2, W', E * W'
        self.theta = (0.0, 1.0)  # (o, k)

    def update(self, excess: float, seconds: float) -> None:
        """One step: predicted drafting seconds E, measured W - t_T(plain) seconds."""
        f = self.forget
        if excess <= 0:
            self.plain = [f * self.plain[0] + 1.0, f * self.plain[1] + seconds]
        else:
            x = (1.0, excess, excess * excess, seconds, excess * seconds)
            self.drafted = [f * s + v for s, v in zip(self.drafted, x)]
            self.plain = [self.plain_age * self.plain[0], self.plain_age * self.plain[1]]
        (n_p, w_p), (n_d, e, e2, w_d, ew) = self.plain, self.drafted
        o = w_p / n_p if n_p > 0 else 0.0  # what plain steps overran by (none seen: 0)
        if n_p < self.plain_min:  # no plain step lately: both from the drafting steps, o never above the plain steps'
            a11, a12, a22 = n_d + self.p0[0], e, e2 + self.p0[1]
            b1, b2 = w_d, ew + self.p0[1]
            o = min(o, (a22 * b1 - a12 * b2) / (a11 * a22 - a12 * a12))
        self.theta = (o, (ew - o * e + self.p0[1]) / (e2 + self.p0[1]))  # k fits the drafting steps' rest (prior k = 1)

    @property
    def o(self) -> float:
        return max(self.theta[0], 0.0)

    @property
    def k(self) -> float:
        return min(max(self.theta[1], 0.5), self.k_max)


@dataclass
class _Kept:
    """A plan `select` keeps for the next steps (see `CostPolicy._last`)."""

    key: tuple  # (request ids, others, prompts) it was made for
    draft: list[bool]  # which requests drafted
    block: int  # the block length the drafter ran
    secs: np.ndarray  # the priced verify curve
    fixed: int  # the tokens the step commits anyway
    step_s: float  # the step's seconds
    requests: int  # requests in the step, those verified besides the drafting ones included
    labelled: int  # rounds labelled before it (`CostPolicy.labelled`)


@dataclass
class _Pending:
    """A drafted request's features this step, labelled once it is verified."""

    x: np.ndarray  # [J, 4] block features (the prior features first)
    p: np.ndarray  # [J] the block model's predictions


def _verified(pending: dict, states, accepted, running: Running, n_pos) -> list[tuple[object, int, int, int]]:
    """The verified rounds of `states` with an entry in `pending` (popped) -> [(entry, drafts accepted, drafts
    verified, n_pos(entry) positions)], not labelled yet (`_labels`); the rounds that verified drafts update
    `running` (a round that accepted a of d verified drafts observed min(a + 1, d) positions, all accepted but
    a rejection). What observe and observe_lookup share."""
    rows, ids, acc_n, seen_n = [], [], [], []
    for s, a in zip(states, accepted):
        rid = s.req.request_id
        entry = pending.pop(rid, None)
        if entry is None:
            continue
        drafts, j = len(s.rounds[-1].draft) if s.rounds else 0, n_pos(entry)
        rows.append((entry, a, drafts, j))
        if drafts:
            ids.append(rid)
            acc_n.append(float(min(a, drafts, j)))
            seen_n.append(float(_seen(a, drafts, j)))
    if ids:
        running.update(ids, acc_n, seen_n)
    return rows


def _seen(a: int, d: int, j: int) -> int:
    """Positions a round that accepted a of d verified drafts (of a J-position block) labels: to the first rejection."""
    return min(a + 1, d, j)


def _at_risk(a: int, d: int, j: int) -> int:
    """Positions such a round teaches the prior model (`CostPolicy.observe`): those seen where it saw a rejection,
    all J where not."""
    return _seen(a, d, j) if a < min(d, j) else j


def _latest(ring: np.ndarray, n: int, k: int) -> np.ndarray:
    """A ring [RECENT, J] written n times -> its latest min(k, n, RECENT) rows, latest first."""
    m = min(k, n, len(ring))
    return ring[(n - 1 - np.arange(m)) % len(ring)]


def _labels(rows) -> tuple[np.ndarray, np.ndarray]:
    """Rows of `_verified` -> (label [n], seen [n]) over their positions in order (`round_labels`)."""
    out = [round_labels([a], [d], j) for _, a, d, j in rows]  # ([1, J], [1, J]) each
    return np.concatenate([y[0] for y, _ in out]), np.concatenate([s[0] for _, s in out])


class CostPolicy(VerifyPolicy):
    """Verify lengths (and whether to draft) by expected committed tokens per second, see the module doc."""

    name, timed, reads_logits = "cost", True, True

    def __init__(self, cost: StepCost, block_size: int, slack: int = 1, forget: float = 0.995, prior: float = 1.0):
        self.cost, self.k_blk, self.slack = cost, block_size, slack
        # refitted once LABEL_BATCH labels are in (a few rounds at concurrency 1, every step at 8 or more)
        self.block = AcceptanceModel([0.0, 0.0, 0.0, 1.0], prior, forget, batch=LABEL_BATCH)  # starts as P = the drafter's confidence
        self.prior = AcceptanceModel([0.0, 0.0, 1.0], prior, forget, batch=LABEL_BATCH)  # starts as P = the running acceptance
        self.running = Running()
        self.chain = AcceptanceModel([0.0, 0.0, 1.0], prior, forget, batch=LABEL_BATCH)  # lookup chains: position, running chain acceptance
        self.running_chain = Running()
        self.chain_pending: dict[str, np.ndarray] = {}  # request -> [J, 3] features of its verified chain
        self.chain_refused: dict[str, int] = {}  # request -> chains refused since its last verified one
        self._chained: list[str] = []  # requests with a lookup chain this step (alive, though not drafting)
        self.pending: dict[str, _Pending] = {}
        self.skipped: dict[str, int] = {}  # request -> steps skipped since it last drafted
        self.probe_every: dict[str, int] = {}
        self.steps = 0  # `select` calls: probes fall on every PROBE_SYNC-th
        self.forced: set[str] = set()
        self._batch: tuple[int, int] | None = None  # this step's (requests, tokens) with every drafting request at its anchor
        self._secs: np.ndarray | None = None  # this step's priced verify curve (its decoding part), from `select`
        self._fixed = 0  # tokens that step commits anyway (one per decoding request)
        self._prompts = (0, 0)  # (requests, tokens) prefilled in this step (`prompts`)
        self._block = block_size
        self.overrun = Overrun()
        self.explore = 0.0  # seconds the next probes may cost (EXPLORE of every step's, saved up)
        # recent probes that paid (their request then drafted at PAYOFF_PLANS plans in a row, unforced) and
        # all scored, both forgetting PAYOFF_FORGET a scored probe: where probes keep finding nothing (a domain
        # the drafter cannot follow) they are spent less often (`payoff`), down to PAYOFF_FLOOR of EXPLORE; one
        # that pays raises it again
        self.paid, self.scored = 0.0, 0.0
        self._probed: dict[str, int] = {}  # probed request -> drafting plans since, until it is scored
        self.probes = 0  # requests probed so far
        self.step_error = float("nan")  # recent decoding steps' |wall - predicted| / wall, averaged (`state`)
        self._excess: tuple[float, float] | None = None  # this step's (t_T without drafts, E) for observe_step
        # the last plan: until the next probe step (at most PROBE_SYNC - 1 steps) the same batch keeps it
        # without planning again. Where nobody drafted nothing it reads moves (only rounds that verify drafts move the acceptance models
        # and running rates; the context a request would extend only grows); where requests draft, the
        # running rates move a little a round and the verify lengths are still chosen every step
        # (`lengths`), so only whether to draft and the block length lag by up to three steps. The plan
        # is most of the policy's time at low concurrency: about 0.4 ms of a c=1 step, most of it
        # refilling caches the target forward emptied. A plan that drafted nobody (a settled plain state) holds
        # further, through batch changes too (`_holds_plain`)
        self._last: _Kept | None = None
        self.labelled = 0  # verified drafted rounds so far (`observe`): labels move the models a plan reads
        # verified rounds not labelled yet (`_verified` rows): labelling them (NumPy) waits until one of the models they
        # go to would refit, as each holds its labels until LABEL_BATCH are in. At concurrency 1 that is every few
        # steps; labelling each round on its step, each NumPy call slowed by caches the target's forward had emptied,
        # cost HumanEval at c=1 about 0.25% (the policy's work with fixed6's choices: 0.977 -> 0.979x fixed6)
        self._unlabelled: list[tuple] = []
        self._unlabelled_seen = self._unlabelled_risk = 0  # their labels for the block model (`_seen`) and the prior (`_at_risk`)
        self._unlabelled_chains: list[tuple] = []
        self._unlabelled_chain_seen = 0  # their labels for the chain model; all three summed as rounds come, not every step
        # request (None: the traffic's) -> ([RECENT, K-1] the block model's conditional P of its last rounds, NaN past
        # each round's block; rounds written so far): what the verify choice saw, for the plans (`_options`)
        self.recent: dict[str | None, tuple[np.ndarray, int]] = {}

    @classmethod
    def for_models(cls, target, drafter) -> "CostPolicy":
        """With the cached (or a fresh) calibration of these models' step costs on this machine."""
        return cls(load_or_calibrate(target, drafter), drafter.block_size)

    # -- before drafting
    def select(self, states: list[RequestState], others: tuple[int, int] = (0, 0)) -> list[bool]:
        """Which of `states` draft this step; `others`: (requests, tokens) the step verifies besides them
        (prompt-lookup chains). Sets the block length `draft_len` returns."""
        ids = [s.req.request_id for s in states]
        self.steps += 1
        self.running.tick()
        n_req, n_tok = len(states) + others[0], len(states) + others[1]
        self._batch = (n_req, n_tok)
        key = (ids, others, self._prompts)
        last = self._last  # see `_last`
        if last is not None and (self.steps % PROBE_SYNC and last.key == key or self._holds_plain(n_req, n_tok, ids, states)):
            self._block, self._secs, self._fixed, step_s = last.block, last.secs, last.fixed, last.step_s
            draft = last.draft if len(last.draft) == len(ids) else [False] * len(ids)  # a plain plan held through a batch change
            self._save_explore(step_s)
            self.forced = set()
            for i, d in zip(ids, draft):
                self._after_plan(i, d)
            self._chained = []
            return list(draft)
        xp = prior_features(self.running.rate(ids), self.k_blk - 1)  # [R, K-1, 3]
        fits = room(states, self.k_blk - 1)  # [R, K-1]
        cond = self.prior.predict(xp)  # [R, K-1]
        cum = np.cumprod(cond, -1) * fits  # [R, K-1]
        ctx = mean_context(states)
        secs = self._priced(self.cost.verify_curve(n_req, n_tok, cum.size, ctx))  # [R*(K-1) + 1]
        step_s = float(secs[0])
        secs, fixed = self._decoding(secs, n_req, n_tok, ctx)
        self._secs, self._fixed = secs, fixed  # `lengths` reads them: the models do not change before the step is timed
        draft_s, extend_s = self._drafting_prices(states)  # (pass, request, row), [R]
        extra_s, spread_s = self._extend_charge(ids, states, extend_s, cum)  # [R], [R]
        self._save_explore(step_s)
        force = self._probes(ids, self._probe_cost(extend_s, draft_s, secs), draft_s[0], fits[:, 0])
        if force.any():  # a probe's pass drafts the probed and those that draft anyway, no others joining on it for free:
            # in marginal pricing they paid, measured they did not (MT-Bench at c=8: probe steps drafted 3.4 requests a step for
            # 1.6 probed, 15 ms over a plain step for 1.2 tokens; code at c=32: 0.970x -> 1.002x plain, 3 runs)
            cum = cum * (force | plan_drafts(cum, secs, fixed, draft_s, None, extra_s).draft)[:, None]  # [R, K-1]
        plan = plan_drafts(cum, secs, fixed, draft_s, force, extra_s)
        draft, self._block = self._options(plan, force, ids, cond, fits, secs, fixed, draft_s, (extra_s, spread_s))
        if force.any():
            self._block = max(self._block, min(self.k_blk, PROBE_DRAFTS + 1))
        draft = draft.tolist()
        kept = _Kept(key, draft, self._block, secs, fixed, step_s, n_req, self.labelled)
        # a probe is one step; and a plan that drafted nobody because nobody could commit a draft (every request at its
        # last token) says nothing of the next requests: held, it kept each new request at concurrency 1 from drafting
        # for its first three steps (HumanEval: 4.7% of the steps undrafted, ~2% of the tokens a step)
        self._last = None if force.any() or not fits[:, 0].any() else kept
        self._score_probes(ids, draft, force.tolist())
        self.forced = {i for i, f in zip(ids, force.tolist()) if f}
        for i, d in zip(ids, draft):
            self._after_plan(i, d)
        self._prune(ids + self._chained)
        self._chained = []
        return draft

    def _options(self, plan: DraftPlan, force, ids, cond, fits, secs, fixed, draft_s, extra_s) -> tuple[np.ndarray, int]:
        """(which requests draft [R] bool, the block the drafter runs), chosen for the verify choice each would leave:
        the plan's drafting requests, every request that can draft, and (no probe forced) nobody, each at the block
        whose verify lengths pay best over scenarios of the requests' recent rounds (`_scenarios`, `choose_block`).
        The plan priced drafting on the prior's mean acceptance; a drafted round's verify lengths follow the
        drafter's confidence, long where it is sure and at the anchor where it is not, and pay more than at the
        mean. At concurrency 1 on HumanEval the plans' blocks went from 5 or 7 (the prior's best plus `slack`) to
        6 in 94% of drafting steps: 0.967 -> 0.990x `fixed6` (`policy_ab`, 2 runs). Before any round was verified:
        the plan, at its block plus `slack`.
        extra_s: ([R] the plan's extension charges, [R] the extensions spread over each request's drafted steps left,
        `_extend_charge`). Every request drafting is a switch of the whole batch, which keeps drafting while it pays:
        priced with the spread extensions (charged whole as in the plan, a batch that once decoded plainly never
        drafted again: code at c=32, 92% of rounds undrafted, 1.004x plain where drafting gave 1.07-1.08x), and taken only
        where it beats the others by more than the step-cost model's recent error on whole steps (`step_error`): at
        MT-Bench c=8 switches priced 1-8% ahead of plain decoding measured level with it."""
        if None not in self.recent:
            return plan.draft, min(self.k_blk, plan.block + self.slack) if plan.block else 2
        best = (-np.inf, plan.draft, 2) if force.any() else (fixed / float(secs[0]), np.zeros_like(plan.draft), 2)
        can = fits[:, 0]  # [R] requests that can still commit a draft
        blocks = np.arange(2, cond.shape[1] + 2)  # [J]
        options = [(plan.draft, extra_s[0], 0.0)]  # (who drafts, their extension charges, the margin to beat the best by)
        if not force.any() and (can != plan.draft).any():  # the whole batch switching (step_error NaN before a timed step)
            options.append((can, extra_s[1], self.step_error if self.step_error == self.step_error else 0.0))
        for d, ext, margin in options:
            if d.any():
                idx = np.flatnonzero(d)  # [D]
                spent = draft_s[0] + len(idx) * (draft_s[1] + draft_s[2] * blocks) + float(ext[idx].sum())  # [J]
                b, rate = choose_block(self._scenarios(idx, ids, cond, fits), secs, fixed, spent)
                if rate > best[0] * (1 + margin):
                    best = (rate, d, min(self.k_blk, b))
        return best[1], best[2]

    def _scenarios(self, d: np.ndarray, ids, cond, fits) -> np.ndarray:
        """cum [S, D, J] of the drafting requests `d`: scenario s gives each its s-th latest round's block-model
        predictions, beyond the rounds it has the traffic's rounds before as many latest ones (at concurrency 1
        its own and the request's before it; a request without rounds of its own, the traffic's from its place
        in the batch on, so that no single round stands for every new request), beyond those none; the prior's
        `cond` [R, J] past the block a round drafted and in scenarios without a round."""
        n_pos, n_s = cond.shape[1], max(1, min(RECENT, SCENARIOS // len(d)))
        rows = [self.recent.get(ids[i]) for i in d]
        none = np.full((RECENT, n_pos), np.nan)
        rings = np.stack([r[0] if r else none for r in rows])  # [D, RECENT, J]
        n = np.array([r[1] if r else 0 for r in rows])  # [D] rounds each has written
        own = np.minimum(n, n_s)[:, None]  # [D, 1]
        s = np.arange(n_s)[None]  # [1, S]
        traffic = np.vstack([_latest(*self.recent[None], RECENT), none[:1]])  # [T + 1, J]: the last row none
        at = np.minimum(np.where(own > 0, s, np.arange(len(d))[:, None] * n_s + s), len(traffic) - 1)  # [D, S] traffic rows
        mine = rings[np.arange(len(d))[:, None], (n[:, None] - 1 - s) % RECENT]  # [D, S, J] its own latest rounds
        seen = np.where((s < own)[..., None], mine, traffic[at])  # [D, S, J]
        conds = np.where(np.isnan(seen), cond[d][:, None], seen).transpose(1, 0, 2)  # [S, D, J]
        return np.cumprod(conds, -1) * fits[d][None]  # [S, D, J]

    def _holds_plain(self, n_req: int, n_tok: int, ids: list[str], states: list[RequestState]) -> bool:
        """The last plan drafted nobody and nothing it read has moved enough to draft now, whatever the batch: no
        round has been labelled since (only labels move the acceptance models and running rates; a new request
        plans with the traffic's rate, as the last plan's requests did), the step has at least as many requests
        (fewer make a step cheaper, and drafting may pay again: re-planned at once), and no probe can be made (on
        a probe step, `_probes` would find nobody due, or the budget short of the first due request's probe).
        Where nothing pays the plan then runs about once per probe instead of at every batch change (a new
        request's prefill and its first round re-planned twice per request: 41% of MT-Bench's steps at c=8,
        ~0.45 ms each) or at every probe step whose budget held a drafter pass (65 of 382 steps at MT-Bench
        c=8, ~1.2 ms each, for 9 probes: the probe of a request skipped for long extends its drafter cache with
        all it wrote since, which the budget seldom holds)."""
        last = self._last
        if any(last.draft) or last.labelled != self.labelled or n_req < last.requests:
            return False
        if self.steps % PROBE_SYNC:
            return True
        due = self._due(ids, [s.budget > 0 for s in states])
        if not due:
            return True
        draft_s, extend_s = self._drafting_prices(states)  # (pass, request, row), [R]
        secs = self.cost.verify_curve(n_req, n_tok, min(PROBE_DRAFTS, len(states) * (self.k_blk - 1)), mean_context(states))
        first = due[0]  # the one `_probes` tries first
        return self._explore_after(last.step_s) < draft_s[0] + float(self._probe_cost(extend_s[first : first + 1], draft_s, secs)[0])

    def _drafting_prices(self, states: list[RequestState]) -> tuple[tuple[float, float, float], np.ndarray]:
        """(seconds per drafter pass, per drafted request, per drafted block row; [R] seconds each request's pending
        context takes to extend its drafter cache), the step-cost model's prices scaled by the overrun's k."""
        k = self.overrun.k
        pending = np.array([float(s.context_tokens) for s in states])  # [R] tokens to extend
        return tuple(k * d for d in self.cost.per_drafted), pending * (k * self.cost.per_context)

    @staticmethod
    def _probe_cost(extend_s: np.ndarray, draft_s: tuple[float, float, float], secs: np.ndarray) -> np.ndarray:
        """[R] seconds probing each request adds, paid whole: its drafting (draft_s as `plan_drafts` takes it), the
        context it extends first (extend_s [R]) and the PROBE_DRAFTS drafts it verifies, its block one longer
        (secs: the step's verify curve, only its increments read)."""
        n = min(PROBE_DRAFTS, secs.size - 1)
        return extend_s + draft_s[1] + (n + 1) * draft_s[2] + float(secs[n] - secs[0])

    def _extend_charge(self, ids: list[str], states: list[RequestState], extend_s, cum) -> tuple[np.ndarray, np.ndarray]:
        """([R] seconds of extending each request's drafter cache (extend_s [R]) charged to this step, [R] the same
        spread over every request's drafted steps left, for a switch of the whole batch: `_options`). The
        extension is paid once for all the request's later drafted steps: charged whole, a new request
        (its whole prompt pending) would never start drafting, so a request that drafted at its last plan,
        or is new, has it spread over the drafted steps it has left at the expected tokens a step (cum
        [R, J]). A request that decoded plainly at its last plan has shown no sign that it will keep
        drafting and pays it whole: spread, a probe step (its drafter pass paid by the probe) drew the
        plainly decoding requests of the batch into drafting at a fraction of their contexts' cost
        (MT-Bench after GSM8K at c=8: 8 of 8 requests extending ~250 tokens each for 1.1 tokens expected,
        a step twice as long as a plain one): the plan charges that whole."""
        left = np.array([float(max(1, s.budget + 1)) for s in states])  # [R] tokens to go
        horizon = np.maximum(left / (1.0 + cum.sum(-1)), 1.0)  # [R] drafted steps left at the expected tokens a step
        idle = np.array([self.skipped.get(i, 0) > 0 for i in ids])  # [R] decoded plainly at its last plan
        spread = extend_s / horizon
        return np.where(idle, extend_s, spread), spread

    @property
    def payoff(self) -> float:
        """The share of recent probes that paid, as a fresh engine knows nothing of it: one paid probe in two
        beside the scored ones (the mean of a uniform prior updated with them). It started at 1, as if every
        probe before the first had paid, and fell 10% a probe that found nothing: where nothing pays a
        fresh engine spent its first ~20 probes near EXPLORE's full share (MT-Bench at c=8: 22-24 probes
        a cell of 380 steps, ~1% of its time, none paid). Now 5 such probes bring it to 0.16 (was 0.59);
        probes that keep paying hold it near 0.9 (0.92 after many; few, as where their requests keep drafting,
        leave it nearer the prior: 0.87 in the test), where it was 1."""
        return (self.paid + 1.0) / (self.scored + 2.0)

    def _save_explore(self, step_s: float) -> None:
        """Add EXPLORE (times the probes' recent payoff) of a step of `step_s` seconds to the probes'
        budget, saved up over 256 steps at most."""
        self.explore = self._explore_after(step_s)

    def _explore_after(self, step_s: float) -> float:
        """The probes' budget once a step of `step_s` seconds has added its share (`_save_explore`)."""
        share = EXPLORE * max(PAYOFF_FLOOR, self.payoff)
        return min(self.explore + share * step_s, 256 * share * step_s)

    def _score_probes(self, ids: list[str], draft: list[bool], force: list[bool]) -> None:
        """A request probed earlier and planned now unforced: its probe paid once PAYOFF_PLANS plans in a
        row have drafted it, and did not where one leaves it undrafted first. Scored at the first plan
        (paid if it drafted), one or two lucky acceptances of a probe counted as paid though the request
        drafted a plan or two and stopped, and kept the budget near its full share where nothing paid
        (MT-Bench at c=8: the probes and what they set off cost 1.3%; scored over 3 plans, 0.982 ->
        0.991x plain)."""
        for i, d, f in zip(ids, draft, force):
            if i in self._probed and not f:
                self._probed[i] += int(d)
                if d and self._probed[i] < PAYOFF_PLANS:
                    continue
                self.paid, self.scored = PAYOFF_FORGET * self.paid + float(d), PAYOFF_FORGET * self.scored + 1.0
                del self._probed[i]
        self._probed.update((i, 0) for i, f in zip(ids, force) if f)

    def prompts(self, requests, tokens):
        self._prompts = (requests, tokens)

    def _decoding(self, secs: np.ndarray, n_req: int, n_tok: int, context: float) -> tuple[np.ndarray, int]:
        """The step's priced seconds [M] with n_req requests verifying n_tok tokens (the step's prompts
        included) -> (those seconds less what its prompts add [M], the tokens its decoding requests commit
        anyway). The plans maximise the rate of the step's decoding part, the prompts' cost sunk: a
        prefill is paid whatever is drafted, and a draft committed now is worth the time it saves later
        at decoding's rate. A whole step's rate, dragged down by a prefill (AIME at concurrency 32: a
        570 ms step where decoding steps took 186), took drafts that decoding steps would not (the drafts
        of 28% of rounds, position 1 accepted 41%: 0.94x plain decoding). The drafts' own seconds stay
        the whole step's: past the knee a prompt makes every draft verified beside it cost its token."""
        p_req, p_tok = self._prompts
        if not p_req or p_req >= n_req:
            return secs, n_req
        full, base = (float(self.cost.verify_curve(r, n, 0, context)[0]) for r, n in ((n_req, n_tok), (n_req - p_req, n_tok - p_tok)))
        return secs - max(full - base, 0.0), n_req - p_req

    def _priced(self, secs: np.ndarray) -> np.ndarray:
        """Verify seconds [M] -> the step's seconds as learnt from whole steps: the work outside the
        passes added (the drafting pass, priced apart, carries the overrun factor k)."""
        return secs + self.overrun.o

    def _probes(self, ids: list[str], cost: np.ndarray, d_pass: float, can: np.ndarray) -> np.ndarray:
        """[R] bool: requests probed this step: those whose back-off has elapsed, on a step of the shared
        cadence (the probes of many requests then share one drafter pass instead of each paying one in
        a step of its own), at most one in PROBE_SHARE of the batch (or two), the longest skipped
        first, as far as the exploration budget (`explore`, EXPLORE of every step's time) pays for
        them: cost [R] the seconds each would add (its drafting, the context it extends first, the
        PROBE_DRAFTS tokens it verifies), d_pass those of the drafter pass they share; can [R] bool: requests that can
        still commit a draft (a probe at a request's last token verified nothing). Exploring so costs at most
        EXPLORE of the time where drafting does not pay, and PAYOFF_FLOOR of that where recent probes
        found nothing that paid."""
        force = np.zeros(len(ids), dtype=bool)
        if self.steps % PROBE_SYNC:
            return force
        due = self._due(ids, can)
        spend = d_pass
        for j in due[: max(2, len(ids) // PROBE_SHARE)]:
            if spend + float(cost[j]) > self.explore:
                break
            spend += float(cost[j])
            force[j] = True
        if force.any():
            self.explore -= spend
            self.probes += int(force.sum())
        return force

    def _due(self, ids: list[str], can) -> list[int]:
        """Indices of `ids` whose probe back-off has elapsed, among those that can still commit a draft (can [R] bool),
        in the order `_probes` tries them: the longest skipped first (ties in batch order)."""
        due = [j for j, i in enumerate(ids) if can[j] and self.skipped.get(i, 0) >= self.probe_every.get(i, 4)]
        return sorted(due, key=lambda j: -self.skipped.get(ids[j], 0))

    def _after_plan(self, rid: str, drafts: bool) -> None:
        if rid in self.forced:  # a probe: if it still does not pay, wait twice as long for the next
            self.probe_every[rid] = min(64, 2 * self.probe_every.get(rid, 4))
            self.skipped[rid] = 0
        elif drafts:
            self.probe_every.pop(rid, None)
            self.skipped[rid] = 0
        else:
            self.skipped[rid] = self.skipped.get(rid, 0) + 1

    def _prune(self, live: list[str]) -> None:
        """Forget requests that are no longer running."""
        live = set(live)
        gone = [i for i in self.skipped if i not in live]
        for i in gone:
            self.skipped.pop(i, None)
            self.probe_every.pop(i, None)
            self.pending.pop(i, None)
            self._probed.pop(i, None)
            self.recent.pop(i, None)
        self.running.forget(gone)
        gone = [i for i in self.chain_refused if i not in live]
        for i in gone:
            self.chain_pending.pop(i, None)
            self.chain_refused.pop(i, None)
        self.running_chain.forget(gone)

    def draft_len(self, k_blk, head=None):
        return min(self._block, k_blk)

    def state(self):
        """Why the policy drafts as much as it does: the traffic's acceptance it plans with, what exploring
        costs and finds, and how well the step-cost model predicts this machine's steps."""
        g, o = self.running, self.overrun
        return [
            (
                "traffic_acceptance",
                "gauge",
                "the traffic's running P(a draft is accepted | the ones before were): new requests plan with it",
                g.g_acc / g.g_seen,
            ),
            ("probes", "counter", "undrafted requests drafted as probes, to see whether drafting pays again", float(self.probes)),
            ("probe_payoff", "gauge", "share of recent probes whose request then kept drafting", self.payoff),
            (
                "exploration_share",
                "gauge",
                "share of the time probes may spend now (falls where they find nothing)",
                EXPLORE * max(PAYOFF_FLOOR, self.payoff),
            ),
            ("step_overrun_seconds", "gauge", "a step's work outside the target and drafter passes, learnt from whole steps", o.o),
            ("drafting_cost_factor", "gauge", "drafting's cost against the step-cost model's price, learnt from whole steps", o.k),
            (
                "step_cost_error",
                "gauge",
                "recent decoding steps' |wall time - predicted| / wall time, ~50 steps (NaN: none yet); "
                "large: the calibration does not fit this machine now",
                self.step_error,
            ),
        ]

    # -- prompt lookup
    def lookup_lengths(self, states, chains, others=0):
        """Each chain's prefix worth verifying, by the same rate test as drafts: the chain model's
        per-position acceptance (position, the request's running chain acceptance) against the step's
        cost curve. A refused chain leaves its request to `select` (drafting or plain decoding); after 4,
        8, .. 64 refusals in a row one token of it is verified anyway (a probe, so the model keeps labels)."""
        ids = [s.req.request_id for s in states]
        self._chained = ids
        self.running_chain.tick()  # as `select` ticks `running`: the old traffic's chain labels lose weight while none come
        n_pos = max(chains)
        xp = prior_features(self.running_chain.rate(ids), n_pos)  # [R, J, 3]
        cum = self.chain.predict(xp).cumprod(-1) * (np.arange(n_pos)[None] < np.array(chains)[:, None])  # [R, J]
        n_req = len(states) + others
        n_tok, ctx = n_req + self._prompts[1] - self._prompts[0], mean_context(states)
        secs, fixed = self._decoding(self.cost.verify_curve(n_req, n_tok, cum.size, ctx), n_req, n_tok, ctx)
        lens, _ = choose_lengths(cum, secs, fixed)
        out = []
        for i, n, x, c in zip(ids, (lens - 1).tolist(), xp, chains):  # x [J, 3]
            refused = self.chain_refused.get(i, 0)
            if not n and refused >= 4 and refused & (refused - 1) == 0:  # a probe at 4, 8, 16, ..
                n = 1
            self.chain_refused[i] = 0 if n else min(refused + 1, 64)
            if n:
                self.chain_pending[i] = x[:n]
            out.append(min(n, c))
        return out

    def observe_lookup(self, states, accepted):
        """Label each verified chain's positions (censored after the first rejection) and refit the chain model."""
        new = _verified(self.chain_pending, states, accepted, self.running_chain, len)  # entries: features [J, 3]
        if not new:
            return
        self._unlabelled_chains += new
        self._unlabelled_chain_seen += sum(_seen(*r[1:]) for r in new)
        if self.chain.held + self._unlabelled_chain_seen < self.chain.batch:
            return  # the model would only hold them
        rows, self._unlabelled_chains, self._unlabelled_chain_seen = self._unlabelled_chains, [], 0
        y, seen = _labels(rows)  # [n], [n]
        self.chain.update(np.concatenate([x for x, *_ in rows])[seen], y[seen])

    # -- after drafting
    def lengths(self, states, hidden, k_blk, logits=None):
        """hidden [R, L, H] drafted block states, logits [R, L-1, Vd] their draft logits (computed here
        when not given) -> verify lengths in 1..L (a forced probe PROBE_DRAFTS + 1, as far as its request has room)."""
        ids = [s.req.request_id for s in states]
        n_pos = hidden.shape[1] - 1
        if n_pos < 1:
            return [1] * len(states), [float("nan")] * len(states)
        conf = confidence(states[0].slot.drafter.logits(hidden[:, 1:]) if logits is None else logits)  # [R, J]
        x = block_features(conf, self.running.rate(ids))  # [R, J, 4]
        cond = self.block.predict(x)  # [R, J]
        fits = room(states, n_pos)  # [R, J]
        cum = np.cumprod(cond, -1) * fits  # [R, J]
        n_req, n_tok = self._batch or (len(states), len(states))  # without `select` (an engine that drafts everyone): these alone
        spent = self.overrun.k * self.cost.draft(len(states), hidden.shape[1])  # drafting is spent by now
        secs, fixed = self._secs, self._fixed  # [>= R*J + 1]
        if secs is None or secs.size <= cum.size:
            ctx = mean_context(states)
            secs, fixed = self._decoding(self._priced(self.cost.verify_curve(n_req, n_tok, cum.size, ctx)), n_req, n_tok, ctx)
        lens = choose_lengths(cum, secs[: cum.size + 1] + spent, fixed)[0]  # [R]
        if self.forced:
            probes = np.minimum(PROBE_DRAFTS, fits.sum(-1)) + 1  # [R] the anchor and the drafts a probe verifies
            lens = np.where([i in self.forced for i in ids], np.maximum(lens, probes), lens)
        for j, i in enumerate(ids):
            self.pending[i] = _Pending(x[j], cond[j])
            for key in (i, None):  # the request's and the traffic's
                ring, n = self.recent.get(key) or (np.full((RECENT, self.k_blk - 1), np.nan), 0)
                ring[n % RECENT, :n_pos] = cond[j]
                ring[n % RECENT, n_pos:] = np.nan
                self.recent[key] = (ring, n + 1)
        return lens.tolist(), [float("nan")] * len(states)

    def observe(self, states, accepted):
        """Label each verified round's positions and refit both acceptance models (the rounds kept unlabelled until
        one of the models would refit on them: `_unlabelled`, `_hand_over`). Where a drafted position
        was not verified in a round that accepted every draft it verified, the prior model learns what the
        block model predicted there: so a request whose drafts are never worth verifying stops being
        drafted. Positions after a rejection are not at risk (see the comment below) and left out."""
        new = _verified(self.pending, states, accepted, self.running, lambda p: len(p.p))
        if not new:  # nothing verified: no model can have come closer to a refit
            return
        self.labelled += len(new)
        self._unlabelled += new
        self._unlabelled_seen += sum(_seen(*r[1:]) for r in new)
        self._unlabelled_risk += sum(_at_risk(*r[1:]) for r in new)
        if self.block.held + self._unlabelled_seen >= self.block.batch or self.prior.held + self._unlabelled_risk >= self.prior.batch:
            self._hand_over()  # a model would refit on them: until then both would only hold them

    def _hand_over(self) -> None:
        """Label the rounds `observe` kept and hand them to both acceptance models."""
        rows, self._unlabelled = self._unlabelled, []
        self._unlabelled_seen = self._unlabelled_risk = 0
        x = np.concatenate([p.x for p, *_ in rows])  # [n, 4]
        y, seen = _labels(rows)  # [n], [n]
        self.block.update(x[seen], y[seen])
        # positions after a rejection are left out: their condition (every earlier draft accepted) failed,
        # so they say nothing about P(accepted | earlier accepted), and the block model's guess there is
        # an extrapolation (a drafter rejected at position 1 every round taught the prior that later
        # positions pass, and it kept drafting)
        risk = np.concatenate([np.arange(j) < _at_risk(a, d, j) for _, a, d, j in rows])  # [n]: a prefix of each round
        p_block = np.concatenate([p.p for p, *_ in rows])  # [n]
        self.prior.update(x[risk, :3], np.where(seen, y, p_block)[risk])

    def observe_timing(self, verify, draft):
        """Refit the step-cost model on the step just run, after noting what it predicted drafting adds
        (for observe_step). Not on a step that prefilled a prompt: a prompt's rows skip the LM head and
        attend to each other (pairs the QK feature leaves out), and the plans price decoding's rows, which do
        neither; refitted on both, the model learnt that rows cost less than decoding's do (SmolLM2 in q4 at
        c=32: the row coefficient fell 14% over one wave's prefill steps, from the calibration's 0.92 ms a
        row where 32 requests' rows cost 1.0-1.2 ms)."""
        r, n, _, qk = verify
        plain = self.cost.verify(r, n, qk)  # the verification as run: its own model is refitted on every decoding step
        excess = self.cost.draft(draft[0], draft[1], draft[3]) if draft else 0.0
        self._excess = (plain, excess)
        if not self._prompts[0]:
            self.cost.observe_verify(*verify)
        if draft is not None:
            self.cost.observe_draft(*draft)

    def observe_step(self, seconds):
        """Refit the overrun (o, k) on the whole step (clipped: one step stalled by another process, or the
        first of a new shape, must not set o for many steps where plain steps are rare). Steps that
        prefilled a prompt are left out: the plans sink a prompt's cost (`_decoding`), and what its model
        misses there (a first step's one-off work, hundreds of milliseconds) says nothing about decoding."""
        if self._excess is not None and not self._prompts[0]:
            plain, excess = self._excess
            err = abs(seconds - (plain + self.overrun.o + self.overrun.k * excess)) / max(seconds, 1e-9)  # predicted before the refit
            self.step_error = err if self.step_error != self.step_error else 0.98 * self.step_error + 0.02 * err
            over = min(max(seconds - plain, -0.5 * plain), 0.5 * plain + self.overrun.k_max * excess)
            self.overrun.update(excess, over)
        self._excess, self._batch, self._secs, self._prompts = None, None, None, (0, 0)
