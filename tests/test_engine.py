"""Batched engine: equals single-request generation (the engine at batch 1; greedy and sampling), every
policy lossless, a seeded sampled request is the target's own seeded sample whatever cuts its rounds,
token trees and prompt lookup batched, requests joining mid-flight, the token budget holds."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import greedy_reference, tiny_drafter, tiny_target

from adaflash.engine import Engine, single_request_engine
from adaflash.length_head import LengthHead, LengthHeadConfig
from adaflash.policies import ARPolicy, EMAPolicy, FixedPolicy, HeadPolicy
from adaflash.request import Request


def make_requests(n: int, seed: int, temperature: float = 0.0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [
        Request(
            f"r{i}",
            torch.randint(0, 64, (3 + (i * 5) % 11,), generator=g).tolist(),
            max_new_tokens=10 + 3 * i,
            temperature=temperature,
            seed=100 + i,
        )
        for i in range(n)
    ]


def head_policy(drafter) -> HeadPolicy:
    torch.manual_seed(0)
    return HeadPolicy(LengthHead(LengthHeadConfig(hidden_size=64, inner=16, block_size=drafter.block_size, min_len=1)))


@pytest.mark.parametrize("policy_name", ["fixed", "fixed3", "ema", "head", "ar"])
def test_batched_greedy_equals_single_and_plain(policy_name):
    target = tiny_target(6)
    drafter = tiny_drafter(target, 6)
    policy = {"fixed": FixedPolicy(), "fixed3": FixedPolicy(3), "ema": EMAPolicy(), "head": head_policy(drafter), "ar": ARPolicy()}[
        policy_name
    ]
    reqs = make_requests(7, 1)
    engine = Engine(target, drafter, policy, eos_ids=[5], max_batch=3, token_budget=40)
    states = engine.run(reqs)
    for r, s in zip(reqs, states):
        assert s.out == greedy_reference(target, r.prompt_ids, r.max_new_tokens, [5]), r.request_id
        assert s.finish_reason in ("stop", "length")
        assert all(1 <= rd.verify_len <= drafter.block_size for rd in s.rounds)
    assert engine.stats["max_step_tokens"] <= 40
    if policy_name == "fixed":
        for r, s in zip(reqs, states):
            sd = single_request_engine(target, drafter, [5]).generate(r.prompt_ids, r.max_new_tokens)
            assert [rd.accepted for rd in s.rounds] == [rd.accepted for rd in sd.rounds]


def test_policies_that_know_their_length_draft_only_that_much(monkeypatch):
    """fixedK and EMA know each step's verify length before drafting and ask for a block that long;
    the length head reads the drafted block, so it drafts the block length it was fitted on."""
    target = tiny_target(6)
    drafter = tiny_drafter(target, 6)
    seen = []
    real = drafter.draft_many

    def spy(caches, last, length=None):
        h = real(caches, last, length)
        seen.append((length, h.shape[1]))
        return h

    monkeypatch.setattr(drafter, "draft_many", spy)
    short_head = HeadPolicy(LengthHead(LengthHeadConfig(hidden_size=64, inner=16, block_size=3, min_len=1)))
    for policy, want in [
        (FixedPolicy(3), {3}),
        (FixedPolicy(), {drafter.block_size}),
        (head_policy(drafter), {drafter.block_size}),
        (short_head, {3}),
    ]:
        seen.clear()
        Engine(target, drafter, policy, eos_ids=[5], max_batch=3).run(make_requests(4, 3))
        assert {n for n, _ in seen} == want and all(n == got for n, got in seen), policy.name
    ema = EMAPolicy(init=1.0)  # (1 + 1) * 1.3 -> verify 3, rising with acceptance
    seen.clear()
    Engine(target, drafter, ema, eos_ids=[5], max_batch=3).run(make_requests(4, 3))
    assert seen[0] == (3, 3) and all(n == got <= drafter.block_size for n, got in seen)


def test_batched_sampling_equals_single_request_sampling():
    target = tiny_target(7, vocab=64, std=0.15)
    drafter = tiny_drafter(target, 7)
    reqs = make_requests(5, 2, temperature=0.9)
    states = Engine(target, drafter, FixedPolicy(), eos_ids=[], max_batch=2).run(reqs)
    for r, s in zip(reqs, states):
        sd = single_request_engine(target, drafter, []).generate(r.prompt_ids, r.max_new_tokens, temperature=0.9, seed=r.seed)
        assert s.out == sd.out


def test_token_budget_bounds_each_step_and_admission():
    target = tiny_target(8)
    drafter = tiny_drafter(target, 8)
    engine = Engine(target, drafter, FixedPolicy(), eos_ids=[], max_batch=8, token_budget=20)
    for r in make_requests(8, 3):
        engine.submit(r)
    seen_running = 0
    while not engine.idle:
        engine.step()
        seen_running = max(seen_running, len(engine.running))
        assert engine.demand() <= 20 + 6  # EMA demand of the admitted requests stays near the budget
    assert engine.stats["max_step_tokens"] <= 20
    assert seen_running < 8  # the budget, not max_batch, limited concurrency
    with pytest.raises(ValueError, match="token budget"):
        engine.submit(Request("big", [1] * 25))


def test_stop_callback_and_context_limit():
    target = tiny_target(9)
    drafter = tiny_drafter(target, 9)
    stop_after_four = lambda out: 4 if len(out) >= 4 else None  # noqa: E731
    (s,) = Engine(target, drafter, FixedPolicy(), eos_ids=[]).run([Request("a", [1, 2, 3], 30, stop=stop_after_four)])
    assert len(s.out) == 4 and s.finish_reason == "stop"
    with pytest.raises(ValueError, match="context"):
        Engine(target, drafter, FixedPolicy(), eos_ids=[]).submit(Request("b", [1] * 8190, 10))


def test_ignore_eos_runs_to_max_tokens_losslessly():
    """ignore_eos (the API's fixed-length option) commits EOS like any token and stops only at max_new_tokens;
    the output is still the target's own greedy decoding, now without an EOS stop."""
    target = tiny_target(6)
    drafter = tiny_drafter(target, 6)
    reqs = [r for r in make_requests(12, 1) if len(greedy_reference(target, r.prompt_ids, r.max_new_tokens, [5])) < r.max_new_tokens]
    assert reqs  # some answers do hit EOS early, so the flag is exercised
    for r in reqs:
        r.ignore_eos = True
    for s in Engine(target, drafter, FixedPolicy(), eos_ids=[5], max_batch=3).run(reqs):
        assert s.out == greedy_reference(target, s.req.prompt_ids, s.req.max_new_tokens, []) and s.finish_reason == "length"
        assert 5 in s.out


def test_swap_between_steps_keeps_running_requests_lossless():
    """A swap mid-generation: running requests keep their drafter, new ones get the new one; greedy
    output still equals plain decoding and no request fails."""
    import copy

    target = tiny_target(9)
    drafter = tiny_drafter(target, 9)
    other = copy.deepcopy(drafter)
    with torch.no_grad():
        for p in other.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    engine = Engine(target, drafter, FixedPolicy(), eos_ids=[], max_batch=4, version="1")
    reqs = [Request(f"r{i}", [1 + i, 2, 3], 24) for i in range(3)]
    for r in reqs[:2]:
        engine.submit(r)
    done = engine.step()
    engine.swap(other, version="2")
    engine.submit(reqs[2])
    while not engine.idle:
        done += engine.step()
    by_id = {s.req.request_id: s for s in done}
    assert engine.stats["swaps"] == 1 and engine.version == "2"
    assert [by_id[r.request_id].slot.version for r in reqs] == ["1", "1", "2"]
    for r in reqs:
        assert by_id[r.request_id].out == greedy_reference(target, r.prompt_ids, 24, [])
    traj = engine.trajectory(by_id["r2"], "w0")
    assert traj.drafter_version == "2" and traj.output_ids == by_id["r2"].out
    assert len(traj.rounds) == len(by_id["r2"].rounds) and all(rd.t_ns > 0 for rd in traj.rounds)


def live(cls) -> int:
    """Objects of `cls` still reachable after a full collection."""
    import gc

    gc.collect()
    return sum(type(o) is cls for o in gc.get_objects())


def test_finished_requests_and_swapped_out_drafters_are_freed():
    """The engine keeps nothing of a finished request: its KV caches are released when step() returns it,
    and a swapped-out drafter dies with the last request that used it (nothing else holds it)."""
    import weakref

    from adaflash.target import KVCache

    target = tiny_target(9)
    engine = Engine(target, tiny_drafter(target, 9), FixedPolicy(), eos_ids=[], max_batch=4, version="1")
    old = weakref.ref(engine.drafter)
    engine.submit(Request("old", [1, 2, 3], 30))
    engine.step()
    engine.swap(tiny_drafter(target, 10), version="2")  # "old" keeps running on version 1
    for i in range(3):
        engine.submit(Request(f"new{i}", [4, 5, 6 + i], 8))
    done = []
    while not engine.idle:
        done += engine.step()
        assert live(KVCache) == 2 * len(engine.running)  # target + drafter cache of each running request only
    assert {s.req.request_id: s.admitted for s in done} == {"old": True, "new0": True, "new1": True, "new2": True}
    assert old() is not None  # the returned state of "old" still names its drafter (version 1)
    done.clear()
    live(KVCache)  # a full collection
    assert old() is None and engine.version == "2"  # the engine held no reference to version 1 or its requests


def test_cancel_waiting_and_running():
    target = tiny_target(10)
    engine = Engine(target, tiny_drafter(target, 10), FixedPolicy(), eos_ids=[], max_batch=1)
    engine.submit(Request("run", [1, 2, 3], 40))
    engine.submit(Request("wait", [1, 2, 3], 40))
    engine.step()
    engine.cancel("run")
    engine.cancel("wait")
    done = engine.step()
    assert {s.req.request_id: s.finish_reason for s in done} == {"run": "cancelled", "wait": "cancelled"}
    assert engine.idle


@pytest.mark.parametrize("policy_name", ["fixed3", "head", "ema", "ar"])
def test_prompt_lookup_in_the_engine_is_lossless_and_replays_lookup_chain(policy_name):
    """With lookup on, a request whose text ends in an earlier n-gram verifies the tokens that followed
    it instead of drafting: output still equals plain decoding, and every round's source and drafts
    are exactly a replay of spec.lookup_chain over the committed text (drafter rounds otherwise).
    Only drafter rounds reach the trajectory buffer."""
    from adaflash.spec import lookup_chain

    target = tiny_target(7, std=0.15)  # falls into loops that lookup predicts
    drafter = tiny_drafter(target, 7)
    policy = {"fixed3": FixedPolicy(3), "ema": EMAPolicy(), "head": head_policy(drafter), "ar": ARPolicy()}[policy_name]
    reqs = make_requests(7, 4)
    engine = Engine(
        target, None if policy_name == "ar" else drafter, policy, eos_ids=[5], max_batch=3, token_budget=200, lookup=4, lookup_min=1
    )
    states = engine.run(reqs)
    n_lookup = n_drafter = 0
    for r, s in zip(reqs, states):
        assert s.out == greedy_reference(target, r.prompt_ids, r.max_new_tokens, [5]), r.request_id
        a = 1
        for rd in s.rounds:
            chain = lookup_chain(r.prompt_ids + s.out[:a], min(4, r.max_new_tokens - a - 1), min_ngram=1)
            assert rd.source == ("lookup" if chain else "drafter")
            if chain:
                assert rd.draft == chain and rd.verify_len == 1 + len(chain) and rd.pred != rd.pred
                n_lookup += 1
            else:
                n_drafter += 1
            a += rd.accepted + 1
        buffered = engine.trajectory(s, "w").rounds
        assert len(buffered) == sum(rd.source == "drafter" for rd in s.rounds)
    assert n_lookup > 10 and (n_drafter > 10 or policy_name == "ar")
    assert sum(rd.accepted for s in states for rd in s.rounds if rd.source == "lookup") > 0


@pytest.mark.parametrize("seeded", [True, False])
def test_prompt_lookup_sampling_keeps_target_distribution(seeded):
    """Tokens 2 and 3 of every request come from one lookup round (a deterministic proposal: q one-hot
    for the rejection rule of unseeded requests; seeded ones compare it with the target's own sample);
    their empirical distributions must match the target's exact marginals (chi-square, p = 0.001)."""
    from test_generate import _marginals

    from adaflash import engine as E

    E.ENTROPY.seed(0)  # unseeded requests' generators: repeatable statistics

    vocab = 8
    target = tiny_target(5, vocab=vocab, layers=2, std=0.25)
    prompt = [1, 5, 2, 0, 3, 4, 6, 7]  # every token occurs, so the first output token always has a match
    m2, m3 = _marginals(target, prompt, vocab)
    n = 1500
    reqs = [Request(f"s{i}", prompt, max_new_tokens=4, temperature=1.0, seed=i if seeded else None) for i in range(n)]
    engine = Engine(target, None, ARPolicy(), eos_ids=[], max_batch=100, token_budget=2000, lookup=2, lookup_min=1)
    states = engine.run(reqs)
    assert all(s.rounds[0].source == "lookup" for s in states)
    for j, exact in ((1, m2), (2, m3)):
        counts = torch.bincount(torch.tensor([s.out[j] for s in states]), minlength=vocab).double()
        expected = exact * n
        chi2 = ((counts - expected) ** 2 / expected.clamp(min=1e-9)).sum().item()
        assert chi2 < 24.3, (j, chi2, counts, expected)  # 7 degrees of freedom, p = 0.001
    accepted = sum(s.rounds[0].accepted > 0 for s in states)
    assert n * 0.05 < accepted < n * 0.95  # both the accept and the residual paths were exercised


def test_lookup_arguments_are_checked():
    target = tiny_target(6)
    with pytest.raises(ValueError, match="lookup must be >= 0"):
        Engine(target, None, ARPolicy(), eos_ids=[], lookup=-1)
    with pytest.raises(ValueError, match="lookup_min 1..3"):
        Engine(target, None, ARPolicy(), eos_ids=[], lookup=4, lookup_min=0)


@pytest.mark.parametrize("budget", [400, 14])
def test_batched_trees_with_lookup_are_lossless_and_batch_invariant(budget):
    """A tree engine with prompt lookup, greedy and sampling requests mixed: greedy output equals plain
    decoding and each greedy request accepts exactly what it accepts alone (the tree masks and the kept
    paths of one request do not leak into another's); seeded sampling requests verify trees too, the
    same tokens as alone. A tight token budget trims trees (and still holds). Tree rounds reach the trajectory buffer
    as the path the walk took: accepted drafts equal the target's, the next one differs."""
    target = tiny_target(7, std=0.15)  # falls into loops that lookup predicts
    drafter = tiny_drafter(target, 7)
    reqs = make_requests(6, 5)
    for r in reqs[::3]:
        r.temperature = 0.9
    kw = dict(eos_ids=[5], lookup=4, lookup_min=1, tree=5)
    engine = Engine(target, drafter, head_policy(drafter), max_batch=3, token_budget=budget, **kw)
    states = engine.run(reqs)
    assert engine.stats["max_step_tokens"] <= budget
    for r, s in zip(reqs, states):
        alone = Engine(target, drafter, head_policy(drafter), max_batch=1, **kw).generate(
            r.prompt_ids, r.max_new_tokens, r.temperature, r.seed
        )
        assert s.out == alone.out, r.request_id
        if r.temperature == 0:
            assert s.out == greedy_reference(target, r.prompt_ids, r.max_new_tokens, [5]), r.request_id
            if budget == 400:
                assert [rd.accepted for rd in s.rounds] == [rd.accepted for rd in alone.rounds]
        for a, b in zip(s.rounds, s.rounds[1:]):
            assert b.anchor == a.anchor + a.accepted + 1
        for rd in engine.trajectory(s, "w").rounds if r.temperature == 0 else []:
            n = rd.accepted
            assert rd.draft[:n] == rd.target[:n] and (len(rd.draft) == n or rd.draft[n] != rd.target[n])
    tree_rounds = [rd for r, s in zip(reqs, states) if r.temperature == 0 for rd in s.rounds]
    assert any(rd.verify_len > 2 and rd.accepted > 0 for rd in tree_rounds)


def test_admission_reads_what_rounds_verify_not_the_block_size():
    """A drafting engine whose rounds verify one token admits new requests as plain decoding does: a
    newcomer's expected verify tokens (what the token budget keeps room for) follow the engine's recent
    rounds. Counted as the whole block, they made it prefill the same prompts in more, smaller calls."""
    target = tiny_target(3)
    drafter = tiny_drafter(target, 3, block_size=8)
    reqs = [Request(f"r{i}", [1 + i % 7, 2, 3, 4, 5, 6, 7, 8, 9, 10], max_new_tokens=6 + i % 5) for i in range(24)]

    def admissions(engine: Engine) -> list[tuple[int, int]]:
        seen = []
        for r in reqs:
            engine.submit(r)
        while engine.waiting or engine.running:
            before = len(engine.waiting)
            engine.step()
            seen.append((engine.stats["steps"], before - len(engine.waiting)))
        return [s for s in seen if s[1]]

    plain = admissions(Engine(target, None, ARPolicy(), eos_ids=[], max_batch=8, token_budget=40))
    one = admissions(Engine(target, drafter, FixedPolicy(1), eos_ids=[], max_batch=8, token_budget=40))
    assert len(plain) > 3 and one == plain


class RandomPolicy(FixedPolicy):
    """Every decision a verify policy can make, drawn at random: which requests draft (`select`), the block
    length, each verify length and each lookup chain's kept prefix. Greedy output may depend on none of them."""

    name = "random"

    def __init__(self, seed: int):
        super().__init__()
        self.rng = random.Random(seed)

    def select(self, states, others=(0, 0)):
        return [self.rng.random() < 0.6 for _ in states]

    def draft_len(self, k_blk, head=None):
        return self.rng.randint(2, k_blk)

    def lengths(self, states, hidden, k_blk):
        return [self.rng.randint(1, hidden.shape[1]) for _ in states], [float("nan")] * len(states)

    def lookup_lengths(self, states, chains, others=0):
        return [self.rng.randint(0, n) for n in chains]


@pytest.mark.parametrize("seed", range(6))
def test_random_decisions_in_lockstep_with_plain_decoding_are_lossless(seed):
    """Any sequence of policy decisions, on an engine that takes its steps in turn with a plain-decoding
    engine on the same target (as `adaflash bench --interleave` runs them), with prompts prefilled beside
    verify rows, admission spread by a tight token budget and requests of every length: each greedy
    output equals plain greedy decoding. Both engines use the row-invariant attention kernel (head dim 32)."""
    rng = random.Random(seed)
    target = tiny_target(seed, std=0.15, head_dim=32)
    drafter = tiny_drafter(target, seed, block_size=8)
    budget = rng.choice([24, 40, 400])
    lookup = rng.choice([0, 3])
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 64, (rng.randint(2, 20),), generator=g).tolist() for _ in range(10)]
    new = [rng.randint(1, 14) for _ in prompts]
    engines = {
        "ar": Engine(target, None, ARPolicy(), eos_ids=[5], max_batch=rng.randint(1, 5), token_budget=budget),
        "x": Engine(target, drafter, RandomPolicy(seed), eos_ids=[5], max_batch=rng.randint(1, 5), token_budget=budget, lookup=lookup),
    }
    for m, e in engines.items():
        for i, (p, n) in enumerate(zip(prompts, new)):
            e.submit(Request(str(i), p, n))
    outs: dict[str, dict[str, list[int]]] = {m: {} for m in engines}
    while live := [m for m in engines if not engines[m].idle]:
        for m in rng.sample(live, len(live)):
            outs[m].update((s.req.request_id, s.out) for s in engines[m].step())
    for i, (p, n) in enumerate(zip(prompts, new)):
        ref = greedy_reference(target, p, n, [5])
        assert outs["ar"][str(i)] == ref and outs["x"][str(i)] == ref, (i, outs["x"][str(i)], ref)
    assert engines["x"].stats["max_step_tokens"] <= budget


@pytest.mark.parametrize("seed", range(3))
def test_seeded_sampling_is_the_targets_own_seeded_sample(seed):
    """A seeded sampled request's text is plain sampled decoding's with the same seed, token for token,
    whatever cuts its rounds: the block or 3 tokens verified, EMA, random and cost-chosen lengths and
    plain steps, batch neighbours and a tight token budget, trees and prompt lookup. Drafts are accepted
    on the way (not a run of plain steps), and another seed gives another text."""
    from test_policy_cost import CHEAP, linear_cost

    from adaflash.policy_cost import CostPolicy

    target = tiny_target(seed, std=0.15)
    drafter = tiny_drafter(target, seed)
    reqs = make_requests(5, seed, temperature=0.9)
    plain = [s.out for s in Engine(target, None, ARPolicy(), eos_ids=[5], max_batch=1).run(reqs)]
    engines = {
        "fixed": Engine(target, drafter, FixedPolicy(), eos_ids=[5], max_batch=3),
        "fixed3-budget": Engine(target, drafter, FixedPolicy(3), eos_ids=[5], max_batch=4, token_budget=14),
        "ema": Engine(target, drafter, EMAPolicy(), eos_ids=[5], max_batch=2),
        "random-lookup": Engine(target, drafter, RandomPolicy(seed), eos_ids=[5], max_batch=5, lookup=3),
        "cost": Engine(target, drafter, CostPolicy(linear_cost(**CHEAP), drafter.block_size), eos_ids=[5], max_batch=3),
        "tree-lookup": Engine(target, drafter, FixedPolicy(), eos_ids=[5], max_batch=3, tree=5, lookup=4),
    }
    for name, engine in engines.items():
        states = engine.run(reqs)
        assert [s.out for s in states] == plain, name
        assert sum(rd.accepted for s in states for rd in s.rounds) > 0, name
    reseeded = [Request("x", r.prompt_ids, r.max_new_tokens, 0.9, 7) for r in reqs]
    assert [s.out for s in Engine(target, None, ARPolicy(), eos_ids=[5], max_batch=1).run(reseeded)] != plain
