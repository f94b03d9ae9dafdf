"""Cost-aware verify policy: the step-cost model, the online acceptance model, the choice (checked
against brute force), and the policy in the engine: lossless, and plain decoding with a useless drafter."""

from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import tiny_drafter, tiny_target

from adaflash.acceptance import AcceptanceModel, Running, block_features, prior_features, round_labels
from adaflash.choice import choose_block, choose_lengths, plan_drafts
from adaflash.cost import (
    LONG_CONTEXT,
    LONG_GRID,
    SPOT_REPS,
    SPOT_TOLERANCE,
    TARGET_GRID,
    Linear,
    StepCost,
    attention_pairs,
    calibrate,
    drift,
    fit_knee,
    load_or_calibrate,
    rows_feature,
    solve_small,
)
from adaflash.engine import Engine
from adaflash.policies import ARPolicy
from adaflash.policy_cost import CostPolicy
from adaflash.request import DrafterSlot, Request, RequestState
from adaflash.stock_schedule import LiveProfile, batch_schedule, held_out_profile, stock_schedule

CHEAP = {"a": (0.01, 0.001, 0.0001), "d": (0.0005, 0.0001, 0.00001)}  # a machine where drafts pay if accepted at all


def linear_cost(a=(0.06, 0.01, 0.005), d=(0.005, 0.003, 0.0005)) -> StepCost:
    """A StepCost whose calibration points lie exactly on t_T = a0 + a1 R + a2 N, t_D = d0 + d1 Rd + d2 Rd Ld."""
    tp = [(r, r * n, a[0] + a[1] * r + a[2] * r * n) for r, n in [(1, 1), (1, 4), (1, 16), (4, 1), (4, 4), (8, 1), (8, 4)]]
    dp = [(r, ld, d[0] + d[1] * r + d[2] * r * ld) for r, ld in [(1, 2), (1, 16), (4, 4), (8, 2), (8, 8)]]
    return StepCost(tp, dp)


# ----------------------------------------------------------------------------- cost model
def test_linear_fit_recovers_coefficients_and_follows_live_steps():
    c = linear_cost()
    torch.testing.assert_close(torch.tensor(c.target.theta, dtype=torch.float64), torch.tensor([0.06, 0.01, 0.005], dtype=torch.float64))
    assert c.per_token == pytest.approx(0.005) and c.per_drafted == pytest.approx((0.005, 0.003, 0.0005))
    assert c.draft(0, 16) == 0.0  # no drafted request: no pass
    for _ in range(60):  # the machine got 30% slower at R = 8 with varying lengths: the fit follows
        for n in (8, 16, 24, 32):
            c.observe_verify(8, n, 1.3 * (0.06 + 0.08 + 0.005 * n))
    assert c.verify(8, 20) == pytest.approx(1.3 * (0.14 + 0.1), rel=0.03)
    assert c.per_token == pytest.approx(1.3 * 0.005, rel=0.05)


def test_knee_is_fitted_and_priced():
    """A memory-bound forward: flat up to 6 tokens, then 4 ms a token. The knee is found, the curve is
    flat below it, and a linear machine keeps knee 0 (its fit is unchanged)."""
    pts = [(r, r * n, 0.05 + 0.002 * r + 0.004 * max(r * n - 6, 0)) for r, n in TARGET_GRID]
    c = StepCost(pts, linear_cost().points["drafter"])
    assert fit_knee([(r, n, 0.0, t) for r, n, t in pts]) == 6 and c.knee == 6 and c.per_token == pytest.approx(0.004)
    curve = c.verify_curve(1, 1, 15)  # [16]: N = 1 .. 16
    assert curve[:6].tolist() == pytest.approx([0.052] * 6) and float(curve[-1]) == pytest.approx(0.052 + 0.004 * 10)
    assert linear_cost().knee == 0 and float(linear_cost().verify_curve(2, 2, 3)[-1]) == pytest.approx(linear_cost().verify(2, 5))


def test_attention_is_priced_by_context():
    """Verification that also costs 8 ms per thousand new-token x cached-token pairs (what a 17-token block
    at 300 tokens of context showed on the AVX2 machine): calibration points at two contexts recover that
    coefficient, the verify curve prices each token at the requests' context, and the same acceptance
    then verifies fewer tokens after a long context than after a short one."""
    a = (0.05, 0.002, 0.004, 0.008)
    pts = [(r, r * n, attention_pairs([n] * r, [c] * r)) for c, grid in ((32, TARGET_GRID), (LONG_CONTEXT, LONG_GRID)) for r, n in grid]
    c = StepCost([(r, n, qk, a[0] + a[1] * r + a[2] * n + a[3] * qk) for r, n, qk in pts], linear_cost().points["drafter"])
    assert c.per_pair == pytest.approx(0.008) and c.per_token == pytest.approx(0.004)
    short, long = c.verify_curve(1, 1, 15, context=32), c.verify_curve(1, 1, 15, context=1000)  # [16] each: N = 1 .. 16
    assert float(long[-1] - long[0]) == pytest.approx(15 * (0.004 + 0.008))
    assert float(short[-1] - short[0]) == pytest.approx(15 * (0.004 + 0.008 * 0.032))
    assert float(long[3]) == pytest.approx(c.verify(1, 4, attention_pairs([4], [1000])))
    cum = torch.full((1, 15), 0.8).cumprod(-1)  # P(position j accepted) = 0.8 each
    n_short = int(choose_lengths(cum, short, 1)[0][0])
    n_long = int(choose_lengths(cum, long, 1)[0][0])
    assert n_long < n_short


def test_linear_clips_outliers():
    lin = Linear(["1", "N"], [[1, 1], [1, 10]], [0.1, 1.0])
    lin.observe([1, 5], 100.0)  # one step stalled by another process
    assert lin(1, 5) < 0.55 * 1.6


def test_step_cost_json_round_trip():
    for c in (linear_cost(), staircase_cost()):
        back = StepCost.from_json(json.loads(json.dumps(c.to_json())))
        assert back.verify(5, 17) == pytest.approx(c.verify(5, 17)) and back.draft(3, 4, 9) == pytest.approx(c.draft(3, 4, 9))
        assert back.verify(32, 33) == pytest.approx(c.verify(32, 33))


def tiles(n: int) -> float:
    """Linear layers that work in tiles of 16 rows, 20 ms a tile (a staircase), 10 ms for the weights."""
    return 0.01 + 0.02 * -(-n // 16)


def staircase_cost() -> StepCost:
    """A machine whose step is 50 ms + 1 ms per request + the tiles, with the rows measured."""
    rows = [(n, tiles(n)) for n in range(1, 65)] + [(n, tiles(n)) for n in range(68, 129, 4)]
    tp = [(r, r * n, 0.05 + 0.001 * r + tiles(r * n) - tiles(1)) for r, n in TARGET_GRID]
    dp = [(r, ld, cx, 0.004 + 0.0005 * r + 0.0001 * r * ld + 0.0002 * cx) for r, ld, cx in [(1, 2, 0), (8, 8, 0), (8, 4, 64), (32, 4, 128)]]
    return StepCost(tp, dp, rows=rows)


def test_rows_feature_interpolates_and_never_falls():
    g = rows_feature([(1, 0.010), (2, 0.012), (4, 0.011), (8, 0.020)])  # 2 and 4 rows out of order: averaged
    assert g.tolist() == pytest.approx([0.0, 0.0, 0.0015, 0.0015, 0.0015, 0.003625, 0.00575, 0.007875, 0.010])
    # one point that came out fast (a shared VM: the 9-row forward below the 1-row one) does not make every
    # smaller count free: the running minimum taken before priced 2-9 rows at nothing on that machine
    ms = [67.7, 67.0, 72.7, 75.0, 82.4, 84.0, 89.5, 69.5, 66.6, 86.3, 84.8, 86.5]
    g = rows_feature([(n, t / 1000) for n, t in enumerate(ms, 1)])
    assert g[9] > 0.010 and g[4] > 0.005 and bool((g[1:].diff() >= 0).all())
    c = staircase_cost()
    assert c.plausible()
    c.points["rows"][10:20] = [(n, 3 * t) for n, t in c.points["rows"][10:20]]  # a sweep disturbed for a while
    assert not c.plausible()


def test_a_measured_staircase_prices_the_tile_edge():
    """32 plain-decoding requests fill two tiles exactly: one more token costs a whole tile, 16 more no
    more than one; so drafts accepted at 0.3 pay where rows are free (28 requests) and not at the edge,
    and the knee model (a slope per token) cannot tell the two apart."""
    c = staircase_cost()
    assert c.knee == 0 and c.per_token == pytest.approx(1.0, rel=1e-3)
    assert c.verify(32, 33) - c.verify(32, 32) == pytest.approx(0.02, rel=1e-3) and c.verify(32, 48) == pytest.approx(c.verify(32, 33))
    assert c.verify(32, 200) > c.verify(32, 128)  # linear past the measured rows
    cum = torch.full((32, 15), 0.3, dtype=torch.float64).cumprod(-1)
    free = choose_lengths(cum[:28], c.verify_curve(28, 28, 28 * 15), 28)[0]
    edge = choose_lengths(cum, c.verify_curve(32, 32, 32 * 15), 32)[0]
    assert int((free - 1).sum()) == 4 and int((edge - 1).sum()) == 0


def test_drafting_prices_the_context_a_request_must_extend_first():
    """A request that skipped many steps extends its drafter cache with all their tokens before it drafts:
    the plan leaves it undrafted where the same drafts pay for a request that is up to date."""
    c = staircase_cost()
    assert c.per_context == pytest.approx(0.0002) and c.draft(2, 4, 100) == pytest.approx(c.draft(2, 4) + 0.02)
    cum = torch.full((2, 15), 0.9, dtype=torch.float64).cumprod(-1)
    extra = torch.tensor([0.0, 500.0]) * c.per_context  # request 1: 500 tokens behind
    p = plan_drafts(cum, c.verify_curve(2, 2, cum.numel()), 2, c.per_drafted, None, extra)
    assert p.draft.tolist() == [True, False]
    assert plan_drafts(cum, c.verify_curve(2, 2, cum.numel()), 2, c.per_drafted).draft.tolist() == [True, True]


def test_calibration_is_cached_per_machine(tmp_path, monkeypatch):
    target = tiny_target()
    drafter = tiny_drafter(target)
    real = calibrate(target, drafter, reps=1)  # the real sweep on tiny models: every point timed
    assert len(real.points["target"]) == len(TARGET_GRID) + len(LONG_GRID) and all(
        t > 0 for *_, t in real.points["target"] + real.points["drafter"]
    )
    assert {qk for r, n, qk, _ in real.points["target"] if (r, n) == (1, 1)} == {0.032, LONG_CONTEXT / 1000}  # both contexts timed
    assert any(cx > 0 for _, _, cx, _ in real.points["drafter"]) and real.points["rows"][-1][0] >= 128 and real.knee == 0
    calls, result = [], [linear_cost()]
    monkeypatch.setattr("adaflash.cost.calibrate", lambda *a, **k: calls.append(1) or result[0])
    first = load_or_calibrate(target, drafter, tmp_path)
    again = load_or_calibrate(target, drafter, tmp_path)
    assert len(calls) == 1 and again.verify(4, 9) == pytest.approx(first.verify(4, 9))
    (path,) = tmp_path.glob("*.json")
    assert json.loads(path.read_text())["key"]["threads"] == torch.get_num_threads()
    path.write_text("{broken")  # an unreadable cache is measured again
    load_or_calibrate(target, drafter, tmp_path)
    assert len(calls) == 2
    path.unlink()  # a sweep other processes disturbed (points off the linear fit) is used, not kept
    tp = [(1, 1, 0.5), (1, 4, 0.1), (1, 16, 0.3), (4, 4, 0.2), (4, 16, 0.2), (8, 8, 0.9), (8, 32, 0.3)]
    result[0] = StepCost(tp, linear_cost().points["drafter"])
    assert not result[0].plausible() and linear_cost().plausible()
    load_or_calibrate(target, drafter, tmp_path)
    assert len(calls) == 3 and not list(tmp_path.glob("*.json"))


def test_a_cached_calibration_is_timed_again_by_a_new_process_and_measured_anew_where_it_is_off(tmp_path, monkeypatch):
    """The cache is keyed by processor model, not machine (two VMs of one kind differed by 35-55% in drafting):
    a process that did not measure it itself times a few of its points again and recalibrates where one is
    more than SPOT_TOLERANCE off; points shorter than SPOT_FLOOR are not compared (timer noise)."""
    target = tiny_target()
    drafter = tiny_drafter(target)
    calls, result = [], [linear_cost()]  # its drafting point of 8 requests is 37 ms: the tiny drafter's is far less
    monkeypatch.setattr("adaflash.cost.calibrate", lambda *a, **k: calls.append(1) or result[0])
    load_or_calibrate(target, drafter, tmp_path)
    load_or_calibrate(target, drafter, tmp_path)  # the process that measured it trusts it
    assert len(calls) == 1
    assert drift(target, drafter, linear_cost())[0] > SPOT_TOLERANCE
    monkeypatch.setattr("adaflash.cost._CHECKED", {})  # a new process
    load_or_calibrate(target, drafter, tmp_path)
    assert len(calls) == 2
    result[0] = linear_cost(d=(1e-4, 1e-5, 1e-5))  # every drafting point under SPOT_FLOOR
    load_or_calibrate(target, drafter, tmp_path, refresh=True)
    assert len(calls) == 3 and drift(target, drafter, result[0]) == (None, (1.0, 1.0))
    monkeypatch.setattr("adaflash.cost._CHECKED", {})
    load_or_calibrate(target, drafter, tmp_path)
    assert len(calls) == 3


def test_a_spot_check_slowed_by_a_burst_is_timed_once_more_before_the_whole_grid_is(monkeypatch):
    """One spot check of three sweeps caught bursts of other work on a shared VM and measured the whole grid
    anew at four of six process starts: where a point is off, the points are timed again and each keeps
    the faster of its two timings; a machine that is slower in both checks still counts as off."""
    cached = {"target": [(8, 8, 0.5, 0.040), (8, 64, 4.0, 0.120)], "drafter": [(8, 2, 0, 0.004)]}

    def timings(scale):  # what `measure` returns for the spot points, `scale` times the cached seconds
        return [p[:3] + (scale * p[3],) for p in cached["target"]], [p[:3] + (scale * p[3],) for p in cached["drafter"]]

    for scales, expected in (([1.5, 1.05], 0.05), ([1.5, 1.45], 0.45), ([1.1], 0.1)):
        calls = []

        def measure(*args, scales=scales, calls=calls, **kw):
            calls.append(kw)
            return timings(scales[len(calls) - 1])

        monkeypatch.setattr("adaflash.cost.measure", measure)
        off, speed = drift(None, None, SimpleNamespace(points=cached))
        assert off == pytest.approx(expected) and speed == pytest.approx((1 + expected, 1 + expected))
        assert len(calls) == len(scales) and calls[-1]["reps"] == (3 if len(calls) == 1 else 6)


def test_a_cached_calibration_is_scaled_to_the_speed_its_spot_check_finds(tmp_path, monkeypatch):
    """A cache within SPOT_TOLERANCE is used at the machine's speed now: each pass's timings scaled by the
    geometric mean of its points' fresh / cached seconds (target 0.85 and 0.9 here, drafter 1.1); the process
    that checked it reuses that speed without timing again, and the file keeps what was measured."""
    target = tiny_target()
    drafter = tiny_drafter(target)
    cost = linear_cost(d=(0.004, 0.002, 0.001))  # drafting 8 requests of 2 tokens: 36 ms, over SPOT_FLOOR
    monkeypatch.setattr("adaflash.cost.calibrate", lambda *a, **k: cost)
    monkeypatch.setattr("adaflash.cost._CHECKED", {})
    load_or_calibrate(target, drafter, tmp_path)  # measured and cached: used as measured
    (path,) = tmp_path.glob("*.json")
    kept = path.read_text()
    fresh = {(8, 8): 0.85, (8, 32): 0.9}  # (R, N): as the spot points, 8 requests of 1 and 4 tokens
    calls = []

    def measure(target_, drafter_, target_grid, long_grid, drafter_grid, extend_grid, reps):
        calls.append(reps)
        tp = [p[:3] + (fresh[p[:2]] * p[3],) for p in cost.points["target"] if p[:2] in fresh]
        dp = [p[:3] + (1.1 * p[3],) for p in cost.points["drafter"] if p[:2] == (8, 2)]
        return tp, dp

    monkeypatch.setattr("adaflash.cost.measure", measure)
    monkeypatch.setattr("adaflash.cost._CHECKED", {})  # a new process
    got = load_or_calibrate(target, drafter, tmp_path)
    t_speed = (0.85 * 0.9) ** 0.5
    assert calls == [SPOT_REPS]
    assert got.verify(8, 8) == pytest.approx(t_speed * cost.verify(8, 8), rel=1e-6)
    assert got.verify(32, 64) == pytest.approx(t_speed * cost.verify(32, 64), rel=1e-6)
    assert got.draft(8, 2) == pytest.approx(1.1 * cost.draft(8, 2), rel=1e-6)
    again = load_or_calibrate(target, drafter, tmp_path)  # the same process: no second check, the same speed
    assert calls == [SPOT_REPS] and again.verify(8, 8) == pytest.approx(got.verify(8, 8))
    assert path.read_text() == kept


# ----------------------------------------------------------------------------- acceptance model
def test_round_labels_censor_after_the_first_rejection():
    y, seen = round_labels(torch.tensor([0, 2, 3]), torch.tensor([3, 4, 3]), 4)
    assert seen.tolist() == [[True, False, False, False], [True, True, True, False], [True, True, True, False]]
    assert (y * seen).tolist() == [[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]


def test_features_shapes_and_prior_starts_at_confidence():
    conf = torch.tensor([[0.9, 0.5, 0.2]])
    x = block_features(conf, torch.tensor([0.4]))  # [1, 3, 4]
    assert x.shape == (1, 3, 4) and prior_features(torch.tensor([0.4, 0.5]), 3).shape == (2, 3, 3)
    model = AcceptanceModel([0.0, 0.0, 0.0, 1.0])
    torch.testing.assert_close(torch.from_numpy(model.predict(x)), conf.double(), atol=1e-4, rtol=0)


def test_acceptance_model_learns_a_new_domain_within_a_few_batches():
    """The drafter's confidence is overconfident by a domain-specific shift: the model recovers it."""
    g = torch.Generator().manual_seed(0)
    model = AcceptanceModel([0.0, 0.0, 0.0, 1.0])
    for shift, batches in ((-1.0, 40), (-3.0, 8)):  # a first domain, then a harder one
        for _ in range(batches):
            conf = torch.rand(32, 4, generator=g) * 0.98 + 0.01
            x = block_features(conf, torch.full((32,), 0.5)).reshape(-1, 4)
            p = torch.sigmoid(torch.logit(conf.reshape(-1)) + shift)
            model.update(x, (torch.rand(len(p), generator=g) < p).double())
        conf = torch.full((1, 1), 0.8)
        want = float(torch.sigmoid(torch.logit(conf) + shift))
        assert float(model.predict(block_features(conf, torch.tensor([0.5])))[0, 0]) == pytest.approx(want, abs=0.08), shift


# ----------------------------------------------------------------------------- the choice
def brute_force(cum: torch.Tensor, secs: torch.Tensor, gain0: float) -> float:
    best = 0.0
    r, j = cum.shape
    for lens in itertools.product(range(j + 1), repeat=r):
        gain = gain0 + sum(float(cum[i, :n].sum()) for i, n in enumerate(lens))
        best = max(best, gain / float(secs[sum(lens)]))
    return best


@pytest.mark.parametrize("seed", range(8))
def test_choose_lengths_matches_brute_force(seed):
    """Linear costs (seeds 0-3) and costs flat up to a knee, then linear (4-7)."""
    g = torch.Generator().manual_seed(seed)
    cum = torch.rand(3, 4, generator=g, dtype=torch.float64).cumprod(-1)  # [R, J] non-increasing
    fixed_s, tok_s = 0.05 + 0.1 * float(torch.rand(1, generator=g)), 0.002 + 0.03 * float(torch.rand(1, generator=g))
    knee = 0 if seed < 4 else int(torch.randint(1, 8, (1,), generator=g))
    secs = fixed_s + tok_s * (torch.arange(13, dtype=torch.float64) - knee).clamp(min=0)  # [R*J + 1]
    lens, lam = choose_lengths(cum, secs, 3)
    got = (3 + sum(float(cum[i, : n - 1].sum()) for i, n in enumerate(lens.tolist()))) / float(secs[int((lens - 1).sum())])
    assert got == pytest.approx(brute_force(cum, secs, 3), rel=1e-9) and lam == pytest.approx(got)


def test_labels_wait_for_a_refit_and_the_models_learn_as_if_labelled_every_round():
    """`observe` labels verified rounds only once one of the acceptance models would refit (each holds labels until
    LABEL_BATCH are in); the models must come out as if every round were labelled and handed over on its step, the
    prior model learning the block model's P at unverified positions of rounds that saw no rejection."""
    from adaflash.policy_cost import _Pending

    rng = np.random.default_rng(0)
    policy = CostPolicy(linear_cost(), 16)
    block, prior = AcceptanceModel([0.0, 0.0, 0.0, 1.0], batch=32), AcceptanceModel([0.0, 0.0, 1.0], batch=32)
    waited = False
    for step in range(60):
        states, accepted, rounds = [], [], []
        for i in range(int(rng.integers(1, 4))):
            j = int(rng.integers(2, 8))
            d = int(rng.integers(0, j + 1))
            a = int(rng.integers(0, d + 1))
            x, p = rng.normal(size=(j, 4)), rng.uniform(0.05, 0.95, size=j)
            rid = f"s{step}r{i}"
            policy.pending[rid] = _Pending(x, p)
            states.append(SimpleNamespace(req=SimpleNamespace(request_id=rid), rounds=[SimpleNamespace(draft=[0] * d)]))
            accepted.append(a)
            rounds.append((x, p, a, d))
        policy.observe(states, accepted)
        policy.observe([], [])  # a step that verified no drafted round changes nothing
        waited |= bool(policy._unlabelled)
        xs, ys, ps, seens, risks = [], [], [], [], []
        for x, p, a, d in rounds:  # the reference: every round labelled and handed over on its step
            y, seen = round_labels([a], [d], len(p))
            y, seen = y[0], seen[0]
            xs.append(x), ys.append(y), ps.append(p), seens.append(seen)
            risks.append(seen | ~(seen & (y == 0)).any())
        x, y, p, seen, risk = (np.concatenate(v) for v in (xs, ys, ps, seens, risks))
        block.update(x[seen], y[seen])
        prior.update(x[risk, :3], np.where(seen, y, p)[risk])
        np.testing.assert_allclose(policy.block.theta, block.theta, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(policy.prior.theta, prior.theta, rtol=1e-12, atol=1e-12)
    assert waited and not np.allclose(prior.theta, [0.0, 0.0, 1.0])  # rounds waited, and refits happened


def plan(c: StepCost, cum: torch.Tensor, force=None):
    r = cum.shape[0]
    return plan_drafts(cum, c.verify_curve(r, r, cum.numel()), r, c.per_drafted, force)


def test_plan_drafts_falls_back_to_plain_decoding_when_drafts_do_not_pay():
    c = linear_cost()
    for r in (1, 8, 32):
        useless = torch.full((r, 15), 0.02, dtype=torch.float64).cumprod(-1)
        p = plan(c, useless)
        assert not p.draft.any() and p.block == 0 and p.lens.tolist() == [1] * r
        good = torch.full((r, 15), 0.8, dtype=torch.float64).cumprod(-1)
        p = plan(c, good)
        assert p.draft.all() and p.block >= 3 and p.rate > r / c.verify(r, r)
    force = torch.tensor([True, False])  # a probe drafts and verifies at least one draft anyway
    p = plan(c, torch.full((2, 15), 0.02, dtype=torch.float64).cumprod(-1), force)
    assert p.draft.tolist() == [True, False] and p.lens.tolist() == [2, 1] and p.block == 2


def test_plan_drafts_matches_brute_force():
    """Every subset of drafting requests, block length and prefix length, on small random cases."""
    g = torch.Generator().manual_seed(0)
    for case in range(6):
        r, j = 2, 3
        cum = torch.rand(r, j, generator=g, dtype=torch.float64).cumprod(-1)
        knee = case % 3 * 2
        secs = 0.05 + 0.01 * (torch.arange(r * j + 1, dtype=torch.float64) + r - knee).clamp(min=0)
        d = (0.004, 0.002 * case, 0.0005)
        got = plan_drafts(cum, secs, r, d)
        best = r / float(secs[0])
        for b in range(2, j + 2):
            for lens in itertools.product(range(b), repeat=r):
                m = sum(1 for n in lens if n)
                if m:
                    gain = r + sum(float(cum[i, :n].sum()) for i, n in enumerate(lens))
                    best = max(best, gain / (float(secs[sum(lens)]) + d[0] + m * (d[1] + d[2] * b)))
        assert got.rate == pytest.approx(best, rel=0.02), case  # the scan is greedy in requests' drafting cost


def _scan_loop(cum, secs, fixed_gain, draft_s, force, extra_s):
    """Reference for choice._scan: a plain loop over block lengths and prefixes of the ranked drafts."""
    r, n_pos = cum.shape
    best = None if bool(force.any()) else (fixed_gain / float(secs[0]), 0, [0] * r)
    for b in range(2, n_pos + 2):
        ranked = [(0, i, 0) for i in range(r) if force[i]]  # forced first drafts first, then by falling cum
        ranked += sorted(
            ((-float(cum[i, j]), i, j) for i in range(r) for j in range(b - 1) if not (j == 0 and force[i])), key=lambda t: t[0]
        )
        gain, cost_x, drafted, drafts = fixed_gain, 0.0, 0, [0] * r
        for n, (_, i, j) in enumerate(ranked, 1):
            gain += float(cum[i, j])
            drafts[i] += 1
            if j == 0:
                drafted, cost_x = drafted + 1, cost_x + float(extra_s[i])
            if n < max(int(force.sum()), 1):
                continue
            rate = gain / (float(secs[n]) + draft_s[0] + drafted * (draft_s[1] + draft_s[2] * b) + cost_x)
            if best is None or rate > best[0] * (1 + 1e-12):
                best = (rate, b, list(drafts))
    return best


def test_scan_matches_a_loop_over_blocks_and_prefixes():
    """The vectorised scan picks what a loop over every block length and ranked prefix picks: forced
    requests, per-request context costs and tied acceptances included."""
    from adaflash.choice import _scan

    g = torch.Generator().manual_seed(1)
    for case in range(60):
        r, j = int(torch.randint(1, 6, (1,), generator=g)), 6
        cond = torch.rand(r, j, generator=g, dtype=torch.float64) ** 0.3
        cum = ((cond * 4).round() / 4 if case % 2 else cond).cumprod(-1)
        secs = 0.05 + 0.004 * (torch.arange(r * j + 1, dtype=torch.float64) - 3).clamp(min=0)
        d = tuple(float(x) for x in torch.rand(3, generator=g, dtype=torch.float64) * torch.tensor([0.02, 0.004, 0.001]))
        force, extra = torch.rand(r, generator=g) < 0.2, torch.rand(r, generator=g, dtype=torch.float64) * 0.01
        got, (rate, block, drafts) = _scan(cum, secs, r, d, force, extra), _scan_loop(cum, secs, r, d, force, extra)
        assert got.rate == pytest.approx(rate, rel=1e-9) and got.block == block, case
        assert got.lens.tolist() == [1 + n for n in drafts], case


@pytest.mark.parametrize("seed", range(6))
def test_choose_block_matches_choose_lengths_per_block_and_scenario(seed):
    """For every block, each scenario's verify lengths are choose_lengths' over that block's drafts (the drafting
    spent); the block chosen has the most tokens per second summed over the scenarios."""
    rng = np.random.default_rng(seed)
    n_s, r, j = 3, 1 + seed % 3, 5
    cum = rng.random((n_s, r, j)).cumprod(-1)  # [S, R, J]
    secs = 0.02 + 0.004 * np.maximum(np.arange(r * j + 1) - (seed % 4), 0)  # [R*J + 1] flat to a knee, then linear
    spent = 0.003 + 0.0005 * r * np.arange(2, j + 2)  # [J] drafting seconds of blocks 2..J+1
    rates = []
    for b in range(2, j + 2):
        g = c = 0.0
        for s in range(n_s):
            lens, _ = choose_lengths(cum[s, :, : b - 1], secs[: r * (b - 1) + 1] + spent[b - 2], r)
            g += r + sum(float(cum[s, i, : n - 1].sum()) for i, n in enumerate(lens.tolist()))
            c += float(secs[int((lens - 1).sum())] + spent[b - 2])
        rates.append(g / c)
    assert choose_block(cum, secs, r, spent) == (2 + int(np.argmax(rates)), pytest.approx(max(rates)))


def test_the_block_grows_where_the_drafter_is_sure_in_some_rounds():
    """The prior's mean acceptance (0.5 a position) plans a short block; rounds where the drafter was sure (0.95 a
    position, half of them) make the verify choice take more drafts there, so the block is chosen longer."""
    c = linear_cost()
    j = 15
    prior = np.full((1, j), 0.5)
    secs = c.verify_curve(1, 1, j)
    spent = np.array([c.draft(1, b) for b in range(2, j + 2)])
    short = choose_block(prior.cumprod(-1)[None], secs, 1, spent)[0]
    assert short == plan_drafts(prior.cumprod(-1), secs, 1, c.per_drafted).block  # no rounds: the plan's own choice
    mixed = np.stack([np.full((1, j), p) for p in (0.95, 0.3, 0.95, 0.3)]).cumprod(-1)  # [S, 1, J] mean 0.625 a position
    assert choose_block(mixed, secs, 1, spent)[0] > short + 1


def test_longer_blocks_where_tokens_are_cheap():
    """The same acceptance verifies more per request at one request than at 32 (a CPU's tokens cost)."""
    c = linear_cost()
    cum = torch.full((32, 15), 0.7, dtype=torch.float64).cumprod(-1)
    one, many = plan(c, cum[:1]), plan(c, cum)
    assert one.block > many.block >= 2


def test_below_the_knee_a_single_request_verifies_its_likely_drafts():
    """Flat cost up to 8 tokens: one request verifies 7 drafts of a block accepted at 0.6 each (a linear
    model priced at 4 ms a token verifies fewer)."""
    pts = [(r, r * n, 0.05 + 0.002 * r + 0.004 * max(r * n - 8, 0)) for r, n in TARGET_GRID]
    knee, linear = StepCost(pts, linear_cost().points["drafter"]), linear_cost(a=(0.05, 0.002, 0.004))
    cum = torch.full((1, 15), 0.6, dtype=torch.float64).cumprod(-1)
    lens, _ = choose_lengths(cum, knee.verify_curve(1, 1, 15), 1)
    lens_linear, _ = choose_lengths(cum, linear.verify_curve(1, 1, 15), 1)
    assert int(lens[0]) >= 8 and int(lens_linear[0]) < int(lens[0])


# ----------------------------------------------------------------------------- in the engine
def requests(n: int, seed: int = 1) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [Request(f"r{i}", torch.randint(0, 64, (3 + (i * 5) % 11,), generator=g).tolist(), max_new_tokens=24 + 3 * i) for i in range(n)]


@pytest.mark.parametrize("ctx", [0.0, 300.0])
def test_batch_schedule_matches_brute_force_and_drafts_less_in_bigger_batches(ctx):
    """vLLM's knob (drafts per step by batch size): per B the K with the most expected tokens per second,
    priced as the engine prices a step; on a machine where every verified token costs (linear, no knee)
    a lone request drafts, a batch of 32 decodes plainly, and the ranges cover 1..max_batch. Where the
    drafter's pass runs at K = 0 too (vLLM's DFlash), K = 0 saves less and is chosen at fewer sizes."""
    c = linear_cost()
    cum = 0.5 ** np.arange(1, 8)  # [7] each draft accepted half the time, given the ones before
    ks = {}
    for always in (False, True):
        sched = batch_schedule(c, cum, 32, ctx, draft_always=always)
        assert sched[0][0] == 1 and sched[-1][1] == 32
        assert all(a[1] + 1 == b[0] and a[2] != b[2] for a, b in zip(sched, sched[1:]))  # contiguous, merged
        k_of = ks[always] = {b: k for lo, hi, k in sched for b in range(lo, hi + 1)}
        for b in range(1, 33):
            gain = [1 + cum[:k].sum() for k in range(8)]
            draft = [c.draft(b, k + 1, int(b * gain[k])) * (k > 0 or always) for k in range(8)]
            secs = [c.verify(b, b * (k + 1), b * (k + 1) * ctx / 1000) + d for k, d in zip(range(8), draft)]
            assert k_of[b] == int(np.argmax([b * g / t for g, t in zip(gain, secs)])), b
        assert k_of[1] >= 1 and all(k_of[b] >= k_of[b + 1] for b in range(1, 32))
    assert ks[False][32] == 0 and all(ks[True][b] >= ks[False][b] for b in range(1, 33))
    assert sum(ks[True].values()) > sum(ks[False].values())
    free = batch_schedule(linear_cost(a=(0.06, 0.01, 1e-6), d=(1e-6, 1e-6, 1e-6)), np.full(7, 0.9), 4)
    assert free == [(1, 4, 7)]  # tokens and drafting (nearly) free: the whole block at every batch size


def test_stock_schedule_reads_the_drafters_held_out_acceptance(tmp_path, monkeypatch):
    """The committed drafter's eval.json: P(first j drafts accepted) over its domains, falling with j; a
    drafter without one is priced with the cost policy's starting prior."""
    from adaflash.drafter import DEFAULT_DRAFTER

    cum = held_out_profile(DEFAULT_DRAFTER, 16)
    assert cum.shape == (15,) and 0.3 < cum[0] < 0.9 and np.all(np.diff(cum) <= 1e-9)
    assert held_out_profile(DEFAULT_DRAFTER, 8) is None and held_out_profile(tmp_path, 16) is None
    target = tiny_target()
    drafter = tiny_drafter(target)
    c = linear_cost()
    monkeypatch.setattr("adaflash.stock_schedule.load_or_calibrate", lambda t, d: c)  # the linear machine, not the tiny models timed
    sched = stock_schedule(target, drafter, tmp_path, 16)
    assert sched == batch_schedule(c, 0.5 ** np.arange(1, drafter.block_size), 16, draft_always=True)


def test_live_profile_learns_the_traffics_acceptance_from_verify_steps():
    """vLLM's per-step reports (drafts verified, accepted): positions up to the first rejection are labelled; with
    no steps the profile is the prior, after many it is the traffic's; positions never verified keep the prior's
    rate given the ones before; a reset (hot-swap) forgets the steps."""
    prior = 0.5 ** np.arange(1, 8)  # [7]
    live = LiveProfile(prior, strength=4.0)
    np.testing.assert_allclose(live.cum(), prior)
    live.observe([3, 3], [3, 1])  # all 3 accepted; 1 accepted, the 2nd rejected
    np.testing.assert_allclose(live.verified[:4], [2, 2, 1, 0]) and np.testing.assert_allclose(live.accepted[:4], [2, 1, 1, 0])
    for _ in range(400):  # traffic verifying 3 drafts: 7 steps in 10 accept all, the others 0, 1 and 2 of them
        live.observe([3] * 10, [3] * 7 + [0, 1, 2])
    p = live.cum() / np.concatenate([[1.0], live.cum()[:-1]])  # [7] rates given the ones before
    np.testing.assert_allclose(p[:3], [9 / 10, 8 / 9, 7 / 8], atol=0.01)
    np.testing.assert_allclose(p[3:], 0.5)  # positions 4-7: never verified, the prior's 1/2
    assert live.cum()[0] > 0.85 > prior[0]
    live.reset()
    np.testing.assert_allclose(live.cum(), prior)


def test_the_vllm_schedule_follows_the_traffic_and_goes_back_after_a_swap(tmp_path):
    """`serve --backend vllm --policy cost`: every `every` finished requests the schedule is re-chosen from the
    traffic's acceptance (vLLM's reports) and written whole for vLLM's scheduler; traffic that accepts every draft
    drafts at more batch sizes, traffic that accepts none at fewer; K never exceeds the start-up schedule's
    longest (vLLM sized its drafting for it); traffic like the prior changes nothing; a hot-swap goes back to the
    prior's schedule."""
    from adaflash.server.config import VLLMSection
    from adaflash.server.vllm_backend import ScheduleFollower

    with pytest.raises(ValueError, match="follow_every must be >= 0"):
        VLLMSection(follow_every=-1)
    c, prior = linear_cost(), 0.5 ** np.arange(1, 8)
    applied = tmp_path / "schedule.json.applied"
    applied.write_text('{"schedule": [[1, 32, 7]]}')  # an earlier server's
    f = ScheduleFollower(c, prior, 32, tmp_path / "schedule.json", every=4)
    start = f.schedule
    assert start == batch_schedule(c, prior, 32, draft_always=True)
    f.publish()
    assert [tuple(r) for r in json.loads((tmp_path / "schedule.json").read_text())["schedule"]] == start and not applied.exists()
    k_of = lambda sched: {b: k for lo, hi, k in sched for b in range(lo, hi + 1)}  # noqa: E731
    spec = lambda acc: {"per_step_drafted": [f.k_max] * 20, "per_step_accepted": [acc] * 20}  # noqa: E731
    assert [f.observe(spec(f.k_max), 200, 48) for _ in range(3)] == [False] * 3  # not before `every` requests
    f.profile.reset()
    as_prior = {"per_step_drafted": [3] * 8, "per_step_accepted": [0, 0, 0, 0, 1, 1, 2, 3]}  # each draft 1/2, given the ones before
    assert not any(f.observe(as_prior, 200, 48, 1 + i % 32) for i in range(40)) and f.schedule == start  # near-ties do not flip
    alone = ScheduleFollower(c, prior, 32, tmp_path / "alone.json", every=4)
    for _ in range(20):  # served alone, where the start-up schedule drafts its longest already: the batch sizes served decide
        alone.observe(spec(f.k_max), 200, 48, running=1)
    assert alone.updates == 0
    for i in range(20):
        f.observe(spec(f.k_max), 200, 48, running=1 + i % 32)
    good = k_of(f.schedule)
    assert f.updates >= 1 and all(good[b] >= k_of(start)[b] for b in good) and good != k_of(start)
    assert max(good.values()) <= f.k_max == max(k for *_, k in start)
    written = json.loads((tmp_path / "schedule.json").read_text())
    assert [tuple(r) for r in written["schedule"]] == f.schedule and "traffic" in written["tag"]
    assert not applied.exists()  # vLLM has not answered
    for i in range(40):
        f.observe(spec(0), 200, 48, running=1 + i % 32)
    bad = k_of(f.schedule)
    assert all(bad[b] <= k_of(start)[b] for b in bad) and sum(bad.values()) < sum(k_of(start).values())
    assert bad[32] == 0  # drafting stopped at the biggest batch: vLLM reports nothing there
    n, changed = 0, False
    while not changed and n < 1000:  # requests that verified no drafts: the evidence fades and drafting is tried again
        changed, n = f.observe(None, 200, 48, running=32), n + 1
    assert changed and 2 * f.every < n < 16 * f.every and k_of(f.schedule)[32] > 0, n
    assert f.reset("7") and k_of(f.schedule) == k_of(batch_schedule(c, prior, 32, f.context, draft_always=True))
    assert "version 7" in json.loads((tmp_path / "schedule.json").read_text())["tag"]


def test_cost_policy_is_lossless():
    target = tiny_target(6)
    drafter = tiny_drafter(target, 6)
    reqs = requests(6)
    plain = Engine(target, None, ARPolicy(), eos_ids=[5], max_batch=3).run(reqs)
    policy = CostPolicy(linear_cost(**CHEAP), drafter.block_size)
    states = Engine(target, drafter, policy, eos_ids=[5], max_batch=3, token_budget=40).run(reqs)
    assert [s.out for s in states] == [p.out for p in plain]
    assert any(rd.verify_len > 1 for s in states for rd in s.rounds)
    state = {name: value for name, _, _, value in policy.state()}  # what the server's /metrics shows of it
    assert 0 < state["traffic_acceptance"] < 1 and 0.5 <= state["drafting_cost_factor"] <= 4 and state["probes"] >= 0
    assert 0 <= state["step_cost_error"] < float("inf")  # steps were timed against the model's prediction


def test_the_engine_reports_each_steps_attention_pairs():
    """observe_timing's QK is what the verification attended: each request's verified tokens x the tokens its
    cache held before them (prompt and output but the anchor; a prefill none)."""
    target = tiny_target(6)
    drafter = tiny_drafter(target, 6)
    seen = []

    class Spy(CostPolicy):
        def observe_timing(self, verify, draft):
            seen.append(verify)
            super().observe_timing(verify, draft)

    policy = Spy(linear_cost(**CHEAP), drafter.block_size)
    states = Engine(target, drafter, policy, eos_ids=[], max_batch=1).run([Request("a", list(range(1, 21)), max_new_tokens=12)])
    (st,) = states
    assert seen[0][3] == 0.0 and len(seen) == 1 + len(st.rounds) > 2  # the prefill step, then a round a step
    for (r, n, _, qk), rd in zip(seen[1:], st.rounds):  # a round's anchor: the tokens cached before it
        assert (r, n) == (1, rd.verify_len) and qk == pytest.approx(rd.verify_len * rd.anchor / 1000)
    assert st.rounds[0].anchor == 20


def test_useless_drafter_falls_back_to_plain_decoding():
    """A fixed-logit drafter that always proposes a token the target never emits: within a few steps
    the policy verifies the anchor alone and would not draft a new request; output stays plain decoding's."""
    target = tiny_target(6)
    drafter = tiny_drafter(target, 6)
    reqs = requests(6)
    plain = Engine(target, None, ARPolicy(), eos_ids=[5], max_batch=3).run(reqs)
    bad = next(t for t in range(64) if all(t not in p.out for p in plain))
    vd = drafter.logits(torch.zeros(1, 64)).shape[-1]
    drafter.logits = lambda h: torch.full((*h.shape[:-1], vd), -10.0).index_fill_(-1, torch.tensor([bad]), 10.0)  # [..., Vd]
    policy = CostPolicy(linear_cost(**CHEAP), drafter.block_size)
    policy.timed = False  # CHEAP's step costs throughout: the acceptance alone must stop the drafting, whatever the load
    engine = Engine(target, drafter, policy, eos_ids=[5], max_batch=3, token_budget=40)
    drafted, real = [], drafter.draft_many  # (step, requests) of every drafter pass

    def spy(caches, last, length=None):
        drafted.append((engine.stats["steps"], len(caches)))
        return real(caches, last, length)

    drafter.draft_many = spy
    states = engine.run(reqs)
    assert [s.out for s in states] == [p.out for p in plain]
    assert all(rd.accepted == 0 for s in states for rd in s.rounds)
    assert drafted[0] == (1, 3)  # at first it drafts every request (a new drafter might be good; step 0 prefills them)
    late = [n for step, n in drafted if step >= engine.stats["steps"] // 3]
    assert sum(late) <= 0.1 * sum(len(s.rounds) for s in states)  # then only the probes draft: plain decoding
    fresh = [RequestState(r, DrafterSlot(drafter), None, None, torch.Generator()) for r in requests(3, seed=9)]
    assert policy.select(fresh) == [False, False, False]  # new requests are not drafted either
    assert dict((n, v) for n, _, _, v in policy.state())["traffic_acceptance"] < 0.2  # what /metrics tells an operator


def test_useless_lookup_chains_are_refused():
    """Prompts full of repeats give prompt-lookup chains every step; the tiny target never follows them.
    The cost policy stops verifying them (a probe now and then) and drafts or decodes instead, where
    whole chains are verified every step without it; greedy output stays plain decoding's either way."""
    from adaflash.policies import FixedPolicy

    target = tiny_target(6)
    drafter = tiny_drafter(target, 6)
    reqs = [Request(f"r{i}", [7 + i, 8, 9, 10] * 4, max_new_tokens=40) for i in range(4)]
    plain = Engine(target, None, ARPolicy(), eos_ids=[], max_batch=4).run(reqs)

    def chain_tokens(policy) -> tuple[int, int]:
        engine = Engine(target, drafter, policy, eos_ids=[], max_batch=4, lookup=6, lookup_min=1)
        states = engine.run(reqs)
        assert [s.out for s in states] == [p.out for p in plain]
        late = [rd for s in states for rd in s.rounds[len(s.rounds) // 2 :] if rd.source == "lookup"]
        early = [rd for s in states for rd in s.rounds[: len(s.rounds) // 2] if rd.source == "lookup"]
        verified = sum(rd.verify_len - 1 for rd in early + late)
        assert sum(rd.accepted for rd in early + late) <= 0.2 * verified  # the chains are (nearly) useless here
        return sum(rd.verify_len - 1 for rd in early), sum(rd.verify_len - 1 for rd in late)

    fixed_early, fixed_late = chain_tokens(FixedPolicy())
    cost_early, cost_late = chain_tokens(CostPolicy(linear_cost(), drafter.block_size))
    assert fixed_late >= 40 and cost_early > 0 and cost_late <= 0.15 * fixed_late


def test_skipped_requests_are_probed_with_backoff(monkeypatch):
    from adaflash import policy_cost

    policy = CostPolicy(linear_cost(), 16)
    for _ in range(30):  # the running acceptance says nothing pays
        policy.running.update(["a"], torch.tensor([0.0]), torch.tensor([1.0]))
    policy.prior = AcceptanceModel([0.0, 0.0, 1.0], prior=1e6)  # pinned: P = running acceptance
    policy.explore = float("inf")  # the exploration budget saved up in full (256 steps' share)
    st = [RequestState(Request("a", [1, 2, 3]), DrafterSlot(None), None, None, torch.Generator())]
    drafted = [i for i in range(40) if policy.select(st)[0]]
    assert drafted == [7, 19, 39]  # after 4 skipped steps, then 8, then 16, each on the next 4th step
    late = [RequestState(Request(r, [1, 2, 3]), DrafterSlot(None), None, None, torch.Generator()) for r in ("b", "c")]
    policy.running.update(["b", "c"], torch.tensor([0.0, 0.0]), torch.tensor([30.0, 30.0]))
    policy.select(late[:1])  # "b" joins a step before "c": their probes still fall on the same step
    picks = [policy.select(late) for _ in range(12)]
    assert [i for i, p in enumerate(picks) if any(p)] == [i for i, p in enumerate(picks) if all(p)] != []
    many = [RequestState(Request(f"m{i}", [1, 2, 3]), DrafterSlot(None), None, None, torch.Generator()) for i in range(32)]
    policy.running.update([s.req.request_id for s in many], torch.zeros(32), torch.full((32,), 30.0))
    for s in many[:8]:  # eight requests have waited longer than the rest
        policy.skipped[s.req.request_id] = 40
    monkeypatch.setattr(policy_cost, "EXPLORE", 0.5)  # a budget for more probes than the share allows (256 steps' share is capped)
    picks = [policy.select(many) for _ in range(8)]
    first = next(p for p in picks if any(p))
    assert sum(first) == 4 and all(first[:4]) and not any(first[8:])  # a probe step takes one request in 8, the longest skipped


def test_a_probe_drafts_the_probed_request_alone():
    """A probe step pays a drafter pass for the probed request; requests the plan leaves undrafted do not join
    it, though in marginal prices (the pass already paid) their drafts would: measured, such joiners cost more
    than they committed (docs/benchmarks.md, "Where nothing pays")."""
    import math

    def batch(p: float, steps: int) -> tuple[CostPolicy, list]:
        policy = CostPolicy(staircase_cost(), 16)
        policy.prior = AcceptanceModel([math.log(p / (1 - p)), 0.0, 0.0], prior=1e6)  # P = p at every position
        policy.explore = float("inf")
        st = [RequestState(Request(f"r{i}", [1, 2, 3], 64), DrafterSlot(None), None, None, torch.Generator()) for i in range(8)]
        for s in st:
            policy.skipped[s.req.request_id] = 1  # each decoded plainly at its last plan
        policy.skipped["r0"] = 40  # due for a probe
        policy.steps = steps  # select counts this step: a probe step where it is a multiple of PROBE_SYNC
        return policy, st

    policy, st = batch(0.15, 4)
    assert not any(policy.select(st))  # no probe step: drafting does not pay at P = 0.15
    policy, st = batch(0.15, 3)
    assert policy.select(st) == [True] + [False] * 7 and policy.forced == {"r0"}  # the probe alone (all 8 joined it before)
    policy, st = batch(0.3, 3)
    assert all(policy.select(st))  # where the plan drafts them anyway, they still draft beside the probe


def test_a_probe_verifies_enough_drafts_to_learn_from():
    """A probe is there to learn whether its request's drafts are accepted: it drafts a block of at least
    PROBE_DRAFTS + 1 and verifies PROBE_DRAFTS drafts (fewer where its request has less room left), however
    unsure the drafter is; a request drafting beside it verifies what pays. One draft a probe told GSM8K
    (position 1 accepted ~0.56 a probe) from MT-Bench (~0.41) only after many probes: after MT-Bench the
    policy found GSM8K's gain 5 rounds into it, with three drafts in round 3 (docs/benchmarks.md)."""
    from adaflash.policy_cost import PROBE_DRAFTS, PROBE_SYNC

    policy = CostPolicy(staircase_cost(), 16)
    policy.prior = AcceptanceModel([math.log(0.15 / 0.85), 0.0, 0.0], prior=1e6)  # P = 0.15: drafting does not pay
    policy.explore = float("inf")
    new = [64, 2] + [64] * 6  # r1 can commit two more tokens: one draft past its anchor
    st = [RequestState(Request(f"r{i}", [1, 2, 3], n), DrafterSlot(None), None, None, torch.Generator()) for i, n in enumerate(new)]
    for s in st:
        policy.skipped[s.req.request_id] = 1
    policy.skipped["r0"] = policy.skipped["r1"] = 40  # both due for a probe
    policy.steps = PROBE_SYNC - 1  # select counts this step: a probe step
    picks = policy.select(st)
    assert picks == [True, True] + [False] * 6 and policy.forced == {"r0", "r1"}
    block = policy.draft_len(16)
    assert block >= PROBE_DRAFTS + 1
    logits = torch.zeros(2, block - 1, 8)  # [R, J, Vd]: an unsure drafter (top-1 probability 1/8 everywhere)
    lens, _ = policy.lengths(st[:2], torch.zeros(2, block, 4), 16, logits)
    assert lens == [PROBE_DRAFTS + 1, 2]


def test_probes_spend_at_most_their_share_of_the_time():
    """Where drafting never pays, probes cost at most EXPLORE of the step time (and one probe's worth):
    a request that must first extend its drafter cache with 400 tokens is probed less often."""
    from adaflash.policy_cost import EXPLORE, PROBE_DRAFTS

    def probes(pending: int) -> tuple[int, float]:
        policy = CostPolicy(staircase_cost(), 16)
        policy.prior = AcceptanceModel([-9.0, 0.0, 0.0], prior=1e6)  # nothing is ever accepted
        st = [RequestState(Request(f"r{i}", [1, 2, 3]), DrafterSlot(None), None, None, torch.Generator()) for i in range(8)]
        for s in st:
            s.add_context(torch.zeros(pending, 4))
        n, spent = 0, 0.0
        for _ in range(400):
            picks = policy.select(st)
            n += sum(picks)
            k = PROBE_DRAFTS  # a probe's drafts verified, its block one longer
            verified = policy.cost.verify(8, 8 + k) - policy.cost.verify(8, 8)
            one = policy.cost.draft(1, k + 1, pending) - policy.cost.per_drafted[0] + verified
            spent += sum(picks) * one + any(picks) * policy.cost.per_drafted[0]
        return n, spent

    (n_short, spent), (n_long, _) = probes(10), probes(400)
    assert spent <= EXPLORE * 400 * staircase_cost().verify(8, 8) + 0.1 and 0 < n_long < n_short


def test_probes_that_keep_finding_nothing_are_spent_less_often(monkeypatch):
    """Where every probe finds drafting still does not pay, the exploration budget shrinks with the
    probes' payoff (to PAYOFF_FLOOR of EXPLORE); so it does where a probe's lucky acceptance makes its
    request draft at one plan and stop (scored at that plan alone, it counted as paid); where probes lead
    to lasting drafting it keeps nearly its full share."""
    from adaflash import policy_cost

    def run(mode: str) -> tuple[float, int]:
        """mode: what a probe finds: "nothing" (rejected), "once" (accepted; the request drafts at its next
        plan, then its text turns unpredictable), "keeps" (accepted, and the text stays predictable)."""
        policy = CostPolicy(staircase_cost(), 16)
        policy.prior = AcceptanceModel([0.0, 0.0, 1.0], prior=1e6)  # pinned: P = running acceptance
        st = [RequestState(Request(f"r{i}", [1, 2, 3]), DrafterSlot(None), None, None, torch.Generator()) for i in range(8)]
        ids = [s.req.request_id for s in st]
        policy.running.g_acc, policy.running.g_seen = 0.0, 1e6  # the traffic's acceptance: nothing
        probes = 0
        for step in range(1200):
            picks = policy.select(st)
            probes += len(policy.forced) if step >= 600 else 0
            for i, p in zip(ids, picks):
                if i in policy.forced:
                    policy.running.acc[i], policy.running.seen[i] = (0.0, 1e3) if mode == "nothing" else (1e3, 1e3)
                elif p and mode == "once":
                    policy.running.acc[i], policy.running.seen[i] = 0.0, 1e3
        return policy.payoff, probes

    payoff, late = run("nothing")
    assert payoff < 2 * policy_cost.PAYOFF_FLOOR
    assert run("once")[0] < 2 * policy_cost.PAYOFF_FLOOR
    assert run("keeps")[0] > 0.8  # every probe paid (few are made: their requests keep drafting)
    monkeypatch.setattr(policy_cost, "PAYOFF_PLANS", 1)  # scored at the first plan: a lucky probe counts as paid
    assert run("once")[0] > 0.8
    monkeypatch.setattr(policy_cost, "PAYOFF_FLOOR", 1.0)  # the budget's share never shrinks: probes at their full share
    assert 0 < late < 0.4 * run("nothing")[1]


def test_a_fresh_engines_probes_that_find_nothing_soon_spend_less():
    """A fresh engine knows nothing of whether probes pay: its payoff starts at one in two, five probes that
    find nothing bring it below a fifth (from 1 falling 10% a probe, it was still 0.59), and three that pay
    lift it again."""
    policy = CostPolicy(staircase_cost(), 16)
    assert policy.payoff == 0.5

    def score(rid: str, paid: bool) -> None:
        policy._probed[rid] = 0
        for _ in range(3 if paid else 1):  # paid: drafted at PAYOFF_PLANS plans in a row, unforced
            policy._score_probes([rid], [paid], [False])
        assert rid not in policy._probed

    for i in range(5):
        score(f"a{i}", False)
    assert policy.payoff < 0.2
    for i in range(3):
        score(f"b{i}", True)
    assert policy.payoff > 0.4


def _verify_a_round(policy: CostPolicy, states: list, top: float) -> None:
    """One drafted block of 16 for `states` whose drafter gave every position top-1 probability `top` (the block model
    starts as P = that confidence): `lengths` records it among the requests' recent rounds."""
    logits = torch.zeros(len(states), 15, 8)  # [R, J, Vd]: top-1 probability `top`, the rest shared by 7 others
    logits[..., 0] = math.log(top * 7 / (1 - top))
    policy.lengths(states, torch.zeros(len(states), 16, 4), 16, logits)


def test_the_plans_draft_longer_blocks_after_rounds_the_drafter_was_sure_of():
    """The prior (P 0.6 a position) plans a short block; after rounds whose drafts the drafter was sure of (the
    block model's P 0.97 a position), the block is chosen for what the verify choice then took there: longer.
    Rounds it was unsure of bring it back."""
    policy = CostPolicy(linear_cost(), 16)
    policy.prior = AcceptanceModel([0.4, 0.0, 0.0], prior=1e6)  # P = sigmoid(0.4) = 0.6
    st = [RequestState(Request("r0", [1, 2, 3], 200), DrafterSlot(None), None, None, torch.Generator())]

    def block_after(top: float, rounds: int) -> int:
        for _ in range(rounds):
            _verify_a_round(policy, st, top)
        policy._last = None
        policy.select(st)
        return policy.draft_len(16)

    before = block_after(0.5, 0)
    assert before == plan(linear_cost(), torch.full((1, 15), 0.6, dtype=torch.float64).cumprod(-1)).block + 1  # no rounds: plan + slack
    sure = block_after(0.97, 16)
    assert sure > before + 2
    assert block_after(0.2, 32) < sure


def test_a_request_drafts_where_its_rounds_pay_at_the_verify_choice_though_the_prior_says_not():
    """The prior (P 0.3 a position) leaves a lone request undrafted. Where its rounds alternate between drafts the
    drafter is sure of (P 0.97) and drafts it is not (0.05), the verify choice takes the sure ones whole and the
    others not at all: that pays, and the request drafts; where it is never sure (0.3), it does not."""
    dear = linear_cost(a=(0.06, 0.01, 0.02))  # 20 ms a verified token
    policy = CostPolicy(dear, 16)
    policy.prior = AcceptanceModel([-0.85, 0.0, 0.0], prior=1e6)  # P = sigmoid(-0.85) = 0.3
    st = [RequestState(Request("r0", [1, 2, 3], 200), DrafterSlot(None), None, None, torch.Generator())]
    assert not plan(dear, torch.full((1, 15), 0.3, dtype=torch.float64).cumprod(-1)).draft.any()

    def drafts_after(tops: list[float]) -> bool:
        policy.recent.clear()
        for top in tops:
            _verify_a_round(policy, st, top)
        policy._last = None
        return policy.select(st)[0]

    assert not drafts_after([0.3] * 16)
    assert drafts_after([0.97, 0.05] * 8)


def test_a_plain_step_at_a_requests_last_token_does_not_hold_the_next_request_plain():
    """A request at its last token cannot commit a draft, so its step is plain; the next request (concurrency 1)
    drafts from its first step, not after the plain plan is held until a probe."""
    policy = CostPolicy(linear_cost(), 16)
    last = RequestState(Request("r0", [1, 2, 3], 1), DrafterSlot(None), None, None, torch.Generator())  # budget 0
    assert policy.select([last]) == [False]
    new = RequestState(Request("r1", [1, 2, 3], 50), DrafterSlot(None), None, None, torch.Generator())
    assert [policy.select([new]) for _ in range(3)] == [[True]] * 3


def _never_pays() -> CostPolicy:
    """A cost policy whose prior model says drafting never pays."""
    policy = CostPolicy(staircase_cost(), 16)
    policy.prior = AcceptanceModel([-6.0, 0.0, 0.0], prior=1e6)
    return policy


def _count_plans(policy: CostPolicy) -> list:
    """-> a list that grows by one with every full plan `policy.select` makes (each prices its verify curve once)."""
    plans = []
    real = CostPolicy._priced
    policy._priced = lambda secs: (plans.append(1), real(policy, secs))[1]
    return plans


def test_undrafted_batch_skips_planning_without_changing_a_decision():
    """Between probe steps a batch where nobody drafted is not planned again (the policy's work stays off
    the step where drafting does not pay): the same picks, probes and back-offs as planning every step."""
    from adaflash.policy_cost import PROBE_SYNC

    def run(plan_every_step: bool) -> tuple[list, dict, int]:
        policy = _never_pays()
        st = [RequestState(Request(f"r{i}", [1, 2, 3]), DrafterSlot(None), None, None, torch.Generator()) for i in range(8)]
        picks, planned = [], _count_plans(policy)
        for step in range(200):
            if plan_every_step:
                policy._last = None
            batch = st[: 8 if step < 120 else 6]  # two requests finish
            picks.append(policy.select(batch))
        return picks, dict(policy.skipped), len(planned)

    fast, slow = run(False), run(True)
    assert fast[0] == slow[0] and fast[1] == slow[1]
    assert any(any(p) for p in fast[0])  # probes still happen
    assert slow[2] == 200 and fast[2] < 200 * 2 // PROBE_SYNC  # planned on probe steps, the step after a probe and batch changes only


def test_a_probe_step_with_nobody_due_holds_the_plain_plan():
    """A probe step the exploration budget affords plans again only where some request's probe back-off has
    elapsed: with nobody due, a full plan there finds nothing to probe (at MT-Bench c=8: 72 of 383 steps planned
    so, ~1.2 ms each, for 8 probes). Once one is due, the step plans and probes it."""
    from adaflash.policy_cost import PROBE_SYNC

    policy = _never_pays()
    batch = [RequestState(Request(f"r{i}", [1, 2, 3]), DrafterSlot(None), None, None, torch.Generator()) for i in range(8)]
    count = _count_plans(policy)
    assert not any(policy.select(batch)) and len(count) == 1  # step 1: the first plan, nobody drafts
    policy.steps = PROBE_SYNC - 1  # the next select is a probe step ...
    policy.explore = 1.0  # ... and the budget holds far more than a probe (select caps it at 256 steps' share)
    assert policy.explore > policy.overrun.k * policy.cost.per_drafted[0]
    assert not any(policy.select(batch)) and len(count) == 1  # nobody's back-off has elapsed: held
    policy.skipped["r3"] = policy.probe_every.get("r3", 4)  # r3's has
    policy.steps = 2 * PROBE_SYNC - 1
    assert policy.select(batch) == [i == 3 for i in range(8)] and len(count) == 2  # planned: r3 probed


def test_a_plain_plan_holds_through_batch_changes_until_labels_or_a_smaller_batch():
    """Where nothing pays, a batch whose requests come and go (one finishes, the next joins: its prefill step,
    then its first round) is not planned at every change: the plain plan holds until a round is labelled,
    the batch shrinks, or a probe step can afford a probe. The picks, probes and back-offs stay those of
    planning every step."""
    from adaflash.policy_cost import PROBE_SYNC

    def run(plan_every_step: bool) -> tuple[list, dict, int, CostPolicy]:
        policy = _never_pays()
        st = [RequestState(Request(f"r{i}", [1, 2, 3]), DrafterSlot(None), None, None, torch.Generator()) for i in range(80)]
        picks, planned = [], _count_plans(policy)
        for step in range(200):
            if plan_every_step:
                policy._last = None
            first = step // 3  # a request leaves and a new one joins every third step
            picks.append(policy.select(st[first : first + 8]))
        return picks, dict(policy.skipped), len(planned), policy

    held, every = run(False), run(True)
    assert held[0] == every[0] and {i: held[1][i] for i in every[1]} == every[1]  # (requests that left are forgotten at the next plan)
    assert any(any(p) for p in held[0])  # probes still happen
    assert every[2] == 200 and held[2] < 200 // PROBE_SYNC + 2 * held[3].probes  # probe steps and the step after a probe

    policy = held[3]
    batch = [RequestState(Request(f"n{i}", [1, 2, 3]), DrafterSlot(None), None, None, torch.Generator()) for i in range(9)]
    count = _count_plans(policy)

    def select(states) -> int:
        """-> full plans made by a select on a step that is no probe step"""
        before, policy.steps = len(count), 4 * (policy.steps // 4 + 1)  # select adds 1: no probe step
        assert not any(policy.select(states))
        return len(count) - before

    policy._last = None
    assert select(batch[:8]) == 1
    assert select(batch[1:9]) == 0  # one request left, another joined: held
    assert select(batch[:7]) == 1  # a smaller batch: planned again
    assert select(batch[1:8]) == 0
    policy.labelled += 1  # a round was labelled since
    assert select(batch[2:9]) == 1


def test_solve_small_matches_torch():
    """The step-cost fits solve their 2-4 unknowns in floats: the same solution as torch.linalg.solve."""
    g = torch.Generator().manual_seed(0)
    for d in (1, 2, 3, 4):
        x = torch.randn(12, d, generator=g, dtype=torch.float64)
        a, b = x.T @ x + 1e-6 * torch.eye(d, dtype=torch.float64), torch.randn(d, generator=g, dtype=torch.float64)
        a[0] *= 1e-3  # badly scaled rows (seconds against seconds squared) need the pivoting
        torch.testing.assert_close(torch.tensor(solve_small(a.tolist(), b.tolist()), dtype=torch.float64), torch.linalg.solve(a, b))


def test_overrun_learns_what_drafting_really_costs():
    """Whole steps that took 8 ms more than the passes' models said, plus twice the predicted drafting
    cost: o and k are found; drafting steps alone (no plain step yet) cannot tell o from k, and their
    overrun is drafting's (k): o is paid by plain decoding too, and raised by drafting steps it made plain
    decoding look as dear as drafting (an engine's first steps kept every request drafting)."""
    from adaflash.policy_cost import Overrun

    g = torch.Generator().manual_seed(0)
    ov = Overrun()
    for i in range(200):
        e = 0.0 if i % 3 == 0 else 0.01 + 0.04 * float(torch.rand(1, generator=g))
        ov.update(e, 0.008 + 2.0 * e + 0.002 * float(torch.randn(1, generator=g)))
    assert 1.6 < ov.k < 2.1 and ov.o + 0.03 * ov.k == pytest.approx(0.068, rel=0.05)  # k shrunk a little toward 1 by its prior
    same = Overrun()
    for _ in range(50):
        same.update(0.02, 0.03)
    assert same.o == 0.0 and 1.35 < same.k < 1.5  # 0.03 s for 0.02 predicted: k 1.5, shrunk toward 1 by its prior
    # the same drafting steps after three plain ones that took 2 ms over the model: o = 2 ms, and drafting's
    # 8 ms over its prediction is k's (1.3, shrunk toward 1 by its prior), not o's, though the plain steps
    # are 30 drafting steps old
    pinned = Overrun()
    for _ in range(3):
        pinned.update(0.0, 0.002)
    for _ in range(30):
        pinned.update(0.02, 0.03)
    assert pinned.o == pytest.approx(0.002, abs=1e-9) and 1.3 < pinned.k < 1.4
    # one plain step stalled by 355 ms, then only drafting steps (every step looked cheap to draft beside that
    # o, so no plain step came to correct it): o holds while that step is recent, then the drafting steps
    # (8 ms over the model plus 1.5x the predicted drafting cost) set both
    trap = Overrun()
    trap.update(0.0, 0.355)
    for i in range(100):
        e = 0.01 + 0.04 * float(torch.rand(1, generator=g))
        trap.update(e, 0.008 + 1.5 * e)
        if i == 10:
            assert trap.o == pytest.approx(0.355)
    assert trap.o < 0.02 and 1.2 < trap.k < 1.6


def test_steps_that_prefill_a_prompt_leave_the_overrun_and_the_verify_model_alone():
    """A step that prefilled a prompt overran its model by a second (a first step's one-off work): the plans sink
    a prompt's cost, so that step must not set o; nor refit the verify model, whose rows are decoding's (a
    prompt's skip the LM head: refitted on them, decoding's rows looked cheaper than they are). The decoding
    step after it does both."""
    policy = CostPolicy(linear_cost(), 16)
    theta = list(policy.cost.target.theta)
    policy.prompts(1, 200)
    policy.observe_timing((2, 201, 0.5, 0.0), None)
    policy.observe_step(0.5 + 1.0)
    assert policy.overrun.plain == [0.0, 0.0] and policy.overrun.o == 0.0 and policy.cost.target.theta == theta
    model = policy.cost.verify(2, 2, 0.0)  # what the model said before this step refits it
    policy.observe_timing((2, 2, 0.05, 0.0), None)
    policy.observe_step(model + 0.004)
    assert policy.overrun.o == pytest.approx(0.004, rel=1e-6) and policy.cost.target.theta != theta


# ----------------------------------------------------------------------------- offline evaluation
def test_eval_metrics_against_plain_definitions():
    from adaflash.pipelines.policy_eval import auc, r2, reliability

    score, label = torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert auc(score, label) == pytest.approx(0.75)  # 3 of the 4 (positive, negative) pairs ordered
    assert r2(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 3.0])) == 1.0
    assert r2(torch.full((3,), 2.0), torch.tensor([1.0, 2.0, 3.0])) == 0.0  # the mean explains nothing
    rel = reliability(torch.tensor([[0.05, 0.95], [0.05, 0.95]]), torch.tensor([0, 2]))  # position 2 seen once
    assert [(b["n"], b["observed"]) for b in rel] == [(2, 0.5), (1, 1.0)]


def test_evaluate_scores_held_out_requests_only():
    """Synthetic blocks whose acceptance follows the drafter's confidence: the confidence model separates
    them on the held-out half, the prior model (no confidence) cannot."""
    from adaflash.pipelines.policy_eval import Block, evaluate

    g = torch.Generator().manual_seed(0)
    blocks = []
    for req in range(40):
        for t in range(12):
            conf = torch.rand(5, generator=g) * 0.98 + 0.01
            ok = torch.rand(5, generator=g) < conf
            acc = int(ok.long().cumprod(0).sum())
            blocks.append(Block(req, "d" if req < 20 else "e", 1000 * t + req, conf, float("nan"), acc))
    rep = evaluate(blocks, 6)
    assert rep["fit_blocks"] == 240 and rep["models"]["confidence"]["all"]["blocks"] == 240
    assert rep["models"]["confidence"]["all"]["auc_pos1"] > 0.8 > rep["models"]["prior"]["all"]["auc_pos1"]
    assert rep["models"]["confidence"]["all"]["r2_accepted"] > 0.3 and "length_head" not in rep
    assert set(rep["models"]["confidence"]["domains"]) == {"d", "e"}


def test_engine_leaves_unselected_requests_undrafted():
    """VerifyPolicy.select: a request the policy leaves out verifies its anchor alone that step, the policy
    sees the rest of the step (prompt-lookup rounds) as `others`, and greedy output stays plain decoding's."""
    from adaflash.policies import FixedPolicy

    calls = []

    class EveryOther(FixedPolicy):
        def select(self, states, others=(0, 0)):
            calls.append((len(states), others))
            return [i % 2 == 0 for i in range(len(states))]

    target = tiny_target(6)
    drafter = tiny_drafter(target, 6)
    reqs = requests(5)
    plain = Engine(target, None, ARPolicy(), eos_ids=[5], max_batch=3).run(reqs)
    engine = Engine(target, drafter, EveryOther(4), eos_ids=[5], max_batch=3, lookup=3, lookup_min=1)
    states = engine.run(reqs)
    assert [s.out for s in states] == [p.out for p in plain]
    assert all(n + others[0] <= 3 and others[1] >= others[0] for n, others in calls)
    assert any(others[0] > 0 and others[1] > others[0] for _, others in calls)  # lookup chains counted with their tokens
    drafter_rounds = [r for s in states for r in s.rounds if r.source == "drafter"]
    assert sum(r.verify_len == 1 for r in drafter_rounds) >= sum(n // 2 for n, _ in calls)  # the left-out ones


def test_undrafted_requests_cost_the_drafter_nothing():
    """The drafter cache takes a request's new context only when it drafts: with a policy that drafts
    nobody the drafter is never called, and one that drafts every other step extends each request
    once per drafting step with everything since; output stays plain decoding's either way."""
    from adaflash.policies import FixedPolicy

    class Every(FixedPolicy):
        def __init__(self, period):
            super().__init__(3)
            self.period, self.calls = period, 0

        def select(self, states, others=(0, 0)):
            self.calls += 1
            return [self.period > 0 and self.calls % self.period == 0] * len(states)

    target = tiny_target(6)
    drafter = tiny_drafter(target, 6)
    reqs = requests(4)
    plain = Engine(target, None, ARPolicy(), eos_ids=[5], max_batch=2).run(reqs)
    for period in (0, 2):
        extended, real = [], drafter.extend_many

        def spy(feats, caches, real=real, extended=extended):
            extended.append([f.shape[0] for f in feats])
            return real(feats, caches)

        drafter.extend_many = spy
        states = Engine(target, drafter, Every(period), eos_ids=[5], max_batch=2).run(reqs)
        drafter.extend_many = real
        assert [s.out for s in states] == [p.out for p in plain]
        drafted_steps = sum(r.verify_len > 1 for s in states for r in s.rounds)
        if period == 0:
            assert extended == [] and drafted_steps == 0
        else:
            assert 0 < len(extended) <= drafted_steps + len(reqs) and any(n > 1 for call in extended for n in call)


def test_a_long_prompt_to_extend_does_not_keep_a_request_from_drafting():
    """Extending a request's drafter cache with its prompt is paid once for all its drafted steps, so the plan
    spreads it over the steps the request has left: 8 requests with 400 prompt tokens each, drafts accepted
    at 0.6, draft where they have 256 tokens to go. With 2 tokens to go the whole extension falls on this step
    and they do not. (Charged whole to one step, it kept such requests at plain decoding for good.)"""

    def picks(max_new: int) -> list[bool]:
        policy = CostPolicy(staircase_cost(), 16)
        policy.prior = AcceptanceModel([0.4, 0.0, 0.0], prior=1e6)  # P = 0.6 at every position
        st = [RequestState(Request(f"r{i}", [1, 2, 3], max_new), DrafterSlot(None), None, None, torch.Generator()) for i in range(8)]
        for s in st:
            s.add_context(torch.zeros(400, 4))
        return policy.select(st)

    assert all(picks(256)) and not any(picks(2))


def test_a_request_that_stopped_drafting_pays_its_pending_context_whole():
    """The same 8 requests with 400 tokens to extend and 256 to go: new ones draft (the extension spread over
    their drafted steps), but once they decoded plainly at their last plan, the extension falls whole on the
    step that would draft them again, so they do not (a probe step drew every such request in at a fraction
    of its context's cost)."""
    policy = CostPolicy(staircase_cost(), 16)
    policy.prior = AcceptanceModel([0.4, 0.0, 0.0], prior=1e6)  # P = 0.6 at every position
    st = [RequestState(Request(f"r{i}", [1, 2, 3], 256), DrafterSlot(None), None, None, torch.Generator()) for i in range(8)]
    for s in st:
        s.add_context(torch.zeros(400, 4))
    assert all(policy.select(st))
    policy._last = None  # plan again
    for s in st:
        policy.skipped[s.req.request_id] = 1  # each decoded plainly at its last plan
    assert not any(policy.select(st))


def test_a_batch_that_decoded_plainly_drafts_again_together_where_its_rounds_pay():
    """The same 8 requests, decoded plainly at their last plan, after rounds the drafter was sure of (the block
    model's P 0.9 a position): all of them drafting again pays, their extensions spread over the steps they have
    left (256 tokens), and they draft together; with 2 tokens left each would pay its extension in this step, and
    none does. Priced whole for such a switch too, a batch that once fell to plain decoding stayed there where
    drafting paid (code at c=32: 92% of rounds undrafted, 1.004x plain against 1.07-1.08x, `policy_ab` 2 runs).
    The switch must beat plain decoding by more than the step-cost model's recent error: a model off by 10x
    whole steps switches nobody."""

    def picks(max_new: int, step_error: float = float("nan")) -> list[bool]:
        policy = CostPolicy(staircase_cost(), 16)
        policy.prior = AcceptanceModel([0.4, 0.0, 0.0], prior=1e6)  # P = 0.6 at every position
        st = [RequestState(Request(f"r{i}", [1, 2, 3], max_new), DrafterSlot(None), None, None, torch.Generator()) for i in range(8)]
        for _ in range(4):
            _verify_a_round(policy, st, 0.9)
        for s in st:
            s.add_context(torch.zeros(400, 4))
            policy.skipped[s.req.request_id] = 1  # each decoded plainly at its last plan
        policy.step_error = step_error
        return policy.select(st)

    assert all(picks(256)) and all(picks(256, 0.02)) and not any(picks(2))
    assert not any(picks(256, 10.0))


def test_the_traffics_running_acceptance_follows_new_traffic_that_seldom_drafts():
    """New requests start from the traffic's running acceptance. Where the traffic turns to a domain that
    hardly drafts, its few labels must soon outweigh the old traffic's many: the global counts hold at most
    g_max observations, and decay in steps that label nothing (their ratio kept, down to 2 observations)."""
    run = Running()
    for _ in range(50):  # old traffic: 16 positions a step, 10 accepted
        run.tick()
        run.update(["a"], [10.0], [16.0])
    assert run.g_seen == run.g_max and run.rate(["new"])[0] == pytest.approx(10 / 16)
    for _ in range(20):  # steps where nobody drafts: the weight decays, the rate stays
        run.tick()
    assert run.rate(["new"])[0] == pytest.approx(10 / 16) and 2.0 <= run.g_seen < 0.2 * run.g_max
    run.tick()
    run.update(["b"], [0.0], [2.0])  # one probe of the new traffic, rejected at once
    assert run.rate(["new"])[0] < 0.5  # 0.61 where the old counts kept their weight
    for _ in range(200):
        run.tick()
    assert run.g_seen == pytest.approx(2.0) and run.g_acc > 0  # never below 2 observations' worth


def test_the_traffics_running_chain_acceptance_loses_weight_in_steps_without_chain_labels():
    """The same for prompt-lookup chains: `lookup_lengths` runs once a step with chains and ticks the chain
    counts, so after a traffic whose chains were accepted, steps whose chains are all refused (no labels)
    leave the old rate's weight at 2 observations, and the new traffic's first rejected chain moves it."""
    policy = CostPolicy(linear_cost(), 16)
    for _ in range(50):  # old traffic: 4 chain tokens verified a step, 3 accepted
        policy.running_chain.update(["a"], [3.0], [4.0])
    assert policy.running_chain.g_seen == policy.running_chain.g_max
    st = [RequestState(Request(f"r{i}", [1, 2, 3], 64), DrafterSlot(None), None, None, torch.Generator()) for i in range(4)]
    for _ in range(40):  # chains offered, nothing verified comes back labelled
        policy.lookup_lengths(st, [4] * 4)
    assert policy.running_chain.g_seen < 4.0 and policy.running_chain.rate(["new"])[0] == pytest.approx(0.75, abs=0.01)
    policy.running_chain.update(["b"], [0.0], [1.0])  # one chain of the new traffic, rejected at once
    policy.lookup_lengths(st, [4] * 4)
    assert policy.running_chain.rate(["new"])[0] < 0.5  # ~0.74 where the old counts kept their weight


def test_a_prompt_prefilled_in_the_step_does_not_make_drafts_look_cheap():
    """31 requests decode beside a 300-token prompt on a machine where a verified draft costs what it costs
    whatever the step holds (t_T = 60 ms + 10 ms a request + 5 ms a token): drafts accepted at 0.4 bring
    ~44 tokens/s against decoding's ~59 and do not pay. Priced whole, the prefill makes the step's rate ~16
    tokens/s and every request drafted; told it is a prompt (sunk), the policy decodes plainly as it does in
    the same step without the prompt. Prompt-lookup chains (no drafting cost) are judged the same way."""

    def batch():
        return [RequestState(Request(f"r{i}", [1, 2, 3], 64), DrafterSlot(None), None, None, torch.Generator()) for i in range(31)]

    def picks(prompt: bool, others=(1, 300)) -> list[bool]:
        policy = CostPolicy(linear_cost(), 16)
        policy.prior = AcceptanceModel([float(np.log(0.4 / 0.6)), 0.0, 0.0], prior=1e6)  # P = 0.4 at every position
        policy.prompts(*(others if prompt else (0, 0)))
        return policy.select(batch(), others)

    assert all(picks(prompt=False))  # the old mistake: the prefill's 1.5 s made 0.4-accepted drafts look worth it
    assert not any(picks(prompt=True)) and not any(picks(prompt=False, others=(0, 0)))

    def chain(prompt: bool) -> list[int]:
        policy = CostPolicy(linear_cost(), 16)
        policy.chain = AcceptanceModel([float(np.log(0.25 / 0.75)), 0.0, 0.0], prior=1e6)  # a chain token: 5 ms for 0.25 tokens
        policy.prompts(*((1, 300) if prompt else (0, 0)))
        return policy.lookup_lengths(batch(), [4] * 31, others=1)

    assert not any(chain(prompt=True)) and not any(chain(prompt=False))


def test_the_engine_tells_the_policy_its_prompts():
    from adaflash.policies import FixedPolicy

    seen = []

    class Spy(FixedPolicy):
        def prompts(self, requests, tokens):
            seen.append((requests, tokens))

    target = tiny_target(6)
    reqs = [Request(f"r{i}", list(range(7, 7 + 3 + i)), max_new_tokens=4) for i in range(3)]
    Engine(target, tiny_drafter(target, 6), Spy(3), eos_ids=[], max_batch=2).run(reqs)
    assert seen[0] == (2, 3 + 4) and (1, 5) in seen and all(t >= 3 * r for r, t in seen)


def test_the_overrun_factor_prices_the_drafting_pass_not_the_verification():
    """Steps where drafting costs twice what the drafting pass's model says (the work around the pass), and the
    verification what its own model says, teach k = 2 for drafting; the verify curve the plans read stays the
    measured one (plus o), not scaled by k."""
    policy = CostPolicy(staircase_cost(), 16)
    for _ in range(60):
        plain_s = policy.cost.verify(32, 32)
        policy.observe_timing((32, 32, plain_s, 0.0), None)  # a plain step, as predicted: pins o = 0
        policy.observe_step(plain_s)
        verify_s, draft_s = policy.cost.verify(32, 128), policy.cost.draft(32, 4, 128)
        policy.observe_timing((32, 128, verify_s, 0.0), (32, 4, draft_s, 128))  # (requests, tokens, s, QK), (drafted, block, s, context)
        policy.observe_step(verify_s + 2 * draft_s)  # as much again around the drafting pass
    assert policy.overrun.o == pytest.approx(0.0, abs=1e-6) and policy.overrun.k == pytest.approx(2.0, rel=0.1)
    secs = policy.cost.verify_curve(32, 32, 15)
    assert np.allclose(policy._priced(secs), secs)


def test_one_round_does_not_throw_the_prior_model_past_its_labels():
    """The Laplace update takes the posterior's mode (damped Newton steps), not one undamped step: a
    round that accepted 3 drafts of 7 verified (the rest labelled 0.3) left a single
    step's prior model at P = 0.004 for position 1 where it was 0.97, and a request served alone stopped
    drafting for dozens of steps. After the update the model sits at the mode: the objective's gradient
    is zero there, and position 1 is still likely."""
    model = AcceptanceModel([0.0, 0.0, 1.0])  # as CostPolicy's prior model starts
    run = torch.tensor([0.94])
    x = prior_features(run, 15)[0]  # [15, 3]
    y = torch.tensor([1.0, 1.0, 1.0, 0.0] + [0.3] * 11, dtype=torch.float64)
    before = model.theta.copy()
    model.update(x, y)
    p1 = float(model.predict(prior_features(run, 1))[0, 0])
    assert 0.5 < p1 < 0.97
    xs, t = x, model.theta
    p = 1 / (1 + np.exp(-(xs @ t)))
    decay = model.forget**15
    grad = xs.T @ (y.numpy() - p) - decay * 1.0 * (t - before) - (1 - decay) * 1.0 * (t - model.theta0)
    assert np.abs(grad).max() < 1e-3


def test_the_prior_model_learns_only_positions_at_risk():
    """The prior model is P(accepted | every earlier draft accepted): a position after a rejection is not at
    risk and is left out (the block model's guess there is an extrapolation: a drafter rejected at position
    1 every round taught the prior that later positions pass, and it kept drafting); positions past the
    verified ones of a round that accepted all it verified are at risk and learn the block model's P."""
    from types import SimpleNamespace as NS

    from adaflash.policy_cost import _Pending

    pol = CostPolicy(linear_cost(), 16)
    x = block_features(np.full((1, 15), 0.9), np.array([0.5]))[0]  # [15, 4]
    state = lambda rid: NS(req=NS(request_id=rid), rounds=[NS(draft=[0] * 4)])  # noqa: E731  (4 drafts verified)
    pol.pending = {"a": _Pending(x, np.full(15, 0.7)), "b": _Pending(x, np.full(15, 0.7))}
    pol.observe([state("a"), state("b")], [1, 4])  # a: rejected at position 2; b: all 4 accepted
    assert not pol.block._held and not pol.prior._held  # labelled once a model would refit on them
    pol._hand_over()
    ((xb, yb),) = pol.block._held  # seen labels only
    assert yb.tolist() == [1.0, 0.0] + [1.0] * 4
    ((xp, yp),) = pol.prior._held
    assert yp.tolist() == [1.0, 0.0] + [1.0] * 4 + [0.7] * 11  # a's positions 3-15 left out; b's 5-15 at risk
    assert np.array_equal(xp[:, 1], np.log([1, 2, 1, 2, 3, 4, *range(5, 16)]))


def test_no_tokens_are_counted_past_a_requests_last():
    """Drafts beyond max_new_tokens are never verified: a request at its last token is neither drafted nor
    probed (a probe there spent a drafter pass and its context's extension on nothing), and one with two
    tokens to go is planned one draft at most."""

    def request(max_new: int, out: int) -> RequestState:
        st = RequestState(Request("a", [1, 2, 3], max_new), DrafterSlot(None), None, None, torch.Generator())
        st.out = [7] * out
        return st

    def planned(max_new: int, out: int) -> tuple[bool, int]:
        policy = CostPolicy(linear_cost(**CHEAP), 16)
        policy.prior = AcceptanceModel([4.0, 0.0, 0.0], prior=1e6)  # P = 0.98 at every position: drafts pay
        st = [request(max_new, out)]
        return policy.select(st)[0], policy.draft_len(16)  # the block the drafter runs: the plan's + slack 1

    assert planned(64, 10) == (True, 16) and planned(12, 10) == (True, 3) and planned(11, 10)[0] is False

    def probed(max_new: int, out: int) -> bool:
        policy = CostPolicy(linear_cost(**CHEAP), 16)
        policy.prior = AcceptanceModel([-9.0, 0.0, 0.0], prior=1e6)  # nothing is accepted: only a probe drafts
        policy.explore = float("inf")
        policy.skipped["a"] = 40
        st = [request(max_new, out)]
        return any(policy.select(st)[0] for _ in range(4))

    assert probed(64, 10) and not probed(11, 10)
