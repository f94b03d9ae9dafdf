"""Batched engine: equals single-request generation (greedy and sampling), every policy lossless,
requests joining mid-flight, the token budget holds."""

from __future__ import annotations

import pytest
import torch

from adaflash.engine import ARPolicy, EMAPolicy, Engine, FixedPolicy, HeadPolicy, Request
from adaflash.generate import generate_ar, generate_dflash
from adaflash.length_head import LengthHead, LengthHeadConfig
from conftest import tiny_drafter, tiny_target


def make_requests(n: int, seed: int, temperature: float = 0.0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [Request(f"r{i}", torch.randint(0, 64, (3 + (i * 5) % 11,), generator=g).tolist(), max_new_tokens=10 + 3 * i,
                    temperature=temperature, seed=100 + i) for i in range(n)]


def head_policy(drafter) -> HeadPolicy:
    torch.manual_seed(0)
    return HeadPolicy(LengthHead(LengthHeadConfig(hidden_size=64, inner=16, block_size=drafter.block_size, min_len=1)))


@pytest.mark.parametrize("policy_name", ["fixed", "fixed3", "ema", "head", "ar"])
def test_batched_greedy_equals_single_and_plain(policy_name):
    target = tiny_target(6)
    drafter = tiny_drafter(target, 6)
    policy = {"fixed": FixedPolicy(), "fixed3": FixedPolicy(3), "ema": EMAPolicy(), "head": head_policy(drafter),
              "ar": ARPolicy()}[policy_name]
    reqs = make_requests(7, 1)
    engine = Engine(target, drafter, policy, eos_ids=[5], max_batch=3, token_budget=40)
    states = engine.run(reqs)
    for r, s in zip(reqs, states):
        ar = generate_ar(target, r.prompt_ids, r.max_new_tokens, [5])
        assert s.out == ar.output_ids, r.request_id
        assert s.finish_reason in ("stop", "length")
        assert all(1 <= rd.verify_len <= drafter.block_size for rd in s.rounds)
    assert engine.stats["max_step_tokens"] <= 40
    if policy_name == "fixed":
        for r, s in zip(reqs, states):
            sd = generate_dflash(target, drafter, r.prompt_ids, r.max_new_tokens, [5])
            assert [rd.accepted for rd in s.rounds] == sd.accepted_per_round


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
    for policy, want in [(FixedPolicy(3), {3}), (FixedPolicy(), {drafter.block_size}), (head_policy(drafter), {drafter.block_size}),
                         (short_head, {3})]:
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
        sd = generate_dflash(target, drafter, r.prompt_ids, r.max_new_tokens, [], temperature=0.9, seed=r.seed)
        assert s.out == sd.output_ids


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
    engine.step()
    engine.swap(other, version="2")
    engine.submit(reqs[2])
    while not engine.idle:
        engine.step()
    by_id = {s.req.request_id: s for s in engine.finished}
    assert engine.stats["swaps"] == 1 and engine.version == "2"
    assert [by_id[r.request_id].slot.version for r in reqs] == ["1", "1", "2"]
    for r in reqs:
        ar = generate_ar(target, r.prompt_ids, 24, [])
        assert by_id[r.request_id].out == ar.output_ids
    traj = engine.trajectory(by_id["r2"], "w0")
    assert traj.drafter_version == "2" and traj.output_ids == by_id["r2"].out
    assert len(traj.rounds) == len(by_id["r2"].rounds) and all(rd.t_ns > 0 for rd in traj.rounds)


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
