"""Single-request generation, the engine at batch 1: greedy chains and token trees (with a prompt-lookup
branch) == plain greedy decoding; sampling keeps the target distribution, seeded or not."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import greedy_reference, tiny_drafter, tiny_target

from adaflash.engine import Engine, single_request_engine
from adaflash.policies import FixedPolicy


def generate(target, drafter, prompt, max_new, eos, temperature=0.0, seed=0, **kw):
    """One request through a fresh single-request engine -> its RequestState (out, rounds, tau)."""
    return single_request_engine(target, drafter, eos, **kw).generate(prompt, max_new, temperature, seed)


def committed_ok(st) -> bool:
    """Every round committed its accepted drafts + 1 (the last one possibly cut short by EOS or max_new_tokens)."""
    per_round = [r.accepted + 1 for r in st.rounds]
    return sum(per_round[:-1]) + min(1, len(per_round)) <= len(st.out) - 1 <= sum(per_round)


class OracleDrafter:
    """Fixed-output mock with the engine's drafter interface: drafts the target's true greedy
    continuation, corrupting each position with probability `noise`, so rounds accept every possible
    prefix length. Its "block states" are the draft logits themselves ([L, V], `logits` is the identity)."""

    block_size = 6
    vocab = None  # drafts from the whole vocabulary (no draft vocabulary)

    def __init__(self, reference: list[int], vocab: int, noise: float, seed: int, second: float = 0.0):
        self.reference, self.vocab_size, self.noise, self.second = reference, vocab, noise, second
        self.rng = random.Random(seed)

    class Cache:
        length = 0

    def new_pool(self, rows=0):  # the engine's drafter pool: `take` hands out a position counter
        return self

    def take(self, capacity):
        return self.Cache()

    def extend_many(self, feats, caches):
        for f, c in zip(feats, caches):
            c.length += f.shape[0]

    def logits(self, h):
        return h

    def draft_many(self, caches, last_tokens, length=None):
        n = (length or self.block_size) - 1
        out = torch.zeros(len(caches), n + 1, self.vocab_size)  # [R, L, V]: position 0 is the anchor
        for i, cache in enumerate(caches):
            for j in range(n):
                pos = cache.length + 1 + j  # the anchor sits at position cache.length
                tok = self.reference[pos] if pos < len(self.reference) else 0
                if self.rng.random() < self.noise:
                    if self.second and self.rng.random() < self.second:
                        out[i, 1 + j, tok] = 6.0  # the true token drafted second best (a tree can still take it)
                    tok = (tok + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
                out[i, 1 + j, tok] = 8.0  # peaked, like a trained drafter's
        return out


@pytest.mark.parametrize("seed", range(12))
def test_greedy_dflash_equals_plain_decoding(seed):
    target = tiny_target(seed)
    drafter = tiny_drafter(target, seed)
    prompt = torch.randint(0, 64, (3 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
    eos = [seed % 64] if seed % 3 == 0 else []  # some runs stop on EOS mid-block
    ar = greedy_reference(target, prompt, 40, eos)
    for verify_len in (None, 2, 4):
        sd = generate(target, drafter, prompt, 40, eos, verify_len=verify_len)
        assert sd.out == ar
        assert committed_ok(sd)
    for noise in (0.0, 0.3, 0.7):
        oracle = OracleDrafter(prompt + ar, 64, noise, seed)
        sd = generate(target, oracle, prompt, 40, eos)
        assert sd.out == ar
        if noise == 0.0 and len(ar) == 40:
            assert sd.tau > 4  # near-perfect drafts commit nearly whole blocks
        assert committed_ok(sd)


@pytest.mark.parametrize("seed", range(6))
def test_greedy_tree_dflash_equals_plain_decoding(seed):
    """Tree verification commits exactly plain greedy decoding's tokens, and takes second-best drafts a
    chain cannot (an oracle whose corrupted positions keep the true token at rank 2). A seeded sampling
    request in a tree engine verifies trees: the same tokens as the chain engine's for its seed."""
    target = tiny_target(seed)
    drafter = tiny_drafter(target, seed)
    prompt = torch.randint(0, 64, (3 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
    eos = [seed % 64] if seed % 3 == 0 else []
    ar = greedy_reference(target, prompt, 40, eos)
    for n in (1, 4, 24):
        sd = generate(target, drafter, prompt, 40, eos, tree=n)
        assert sd.out == ar
        assert committed_ok(sd) and all(r.verify_len <= 1 + n for r in sd.rounds)
    chain = generate(target, OracleDrafter(prompt + ar, 64, 0.4, seed, second=1.0), prompt, 40, eos)
    tree = generate(target, OracleDrafter(prompt + ar, 64, 0.4, seed, second=1.0), prompt, 40, eos, tree=16)
    assert chain.out == ar and tree.out == ar
    if len(ar) >= 20:
        assert tree.tau > chain.tau
    sampled = generate(target, drafter, prompt, 12, eos, temperature=0.8, seed=seed, tree=4, lookup=4)
    assert sampled.out == generate(target, drafter, prompt, 12, eos, temperature=0.8, seed=seed, lookup=4).out
    with pytest.raises(ValueError, match="tree must be >= 0"):
        single_request_engine(target, drafter, eos, tree=-1)
    with pytest.raises(ValueError, match="needs a drafting policy"):
        single_request_engine(target, None, eos, tree=4)


@pytest.mark.parametrize("seed", range(6))
def test_tree_with_lookup_commits_exactly_what_the_lookup_predicts(seed):
    """A drafter that is always wrong with a one-node tree: every accepted draft comes from the lookup
    branch, so rounds and committed tokens equal a replay of spec.lookup_chain over the plain output;
    the output is plain decoding's."""
    from adaflash.spec import lookup_chain

    target = tiny_target(seed)
    prompt = torch.randint(0, 64, (3 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
    prompt = prompt + prompt  # a repeated prompt: some continuations are in it
    eos = [seed % 64] if seed % 3 == 0 else []
    out = greedy_reference(target, prompt, 40, eos)
    for lookup in (1, 4, 15):
        sd = generate(target, OracleDrafter(prompt + out, 64, 1.0, seed), prompt, 40, eos, tree=1, lookup=lookup)
        assert sd.out == out
        a, rounds = 1, 0  # out[0] comes from the prefill
        while a < len(out):
            chain = lookup_chain(prompt + out[:a], min(lookup, 5, 40 - a - 1))  # OracleDrafter blocks are 6
            n = next((j for j, t in enumerate(chain) if a + j >= len(out) or out[a + j] != t), len(chain))
            a, rounds = a + n + 1, rounds + 1
        assert len(sd.rounds) == rounds and committed_ok(sd)


def test_max_new_tokens_and_stats():
    target = tiny_target(3)
    prompt = [1, 2, 3]
    ar = greedy_reference(target, prompt, 17, [])
    oracle = OracleDrafter(prompt + ar, 64, 0.0, 0)
    sd = generate(target, oracle, prompt, 17, [])
    assert len(sd.out) == 17 == len(ar)
    assert sd.out == ar
    assert all(r.accepted >= 1 for r in sd.rounds if r.draft)  # block position 1 always accepted
    assert sum(r.accepted for r in sd.rounds) + len(sd.rounds) >= 16


def test_context_limit_is_checked():
    target = tiny_target()
    with pytest.raises(ValueError, match="exceeds the target's context"):
        generate(target, None, [1] * 8190, 10, [])


def _marginals(target, prompt: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact target distributions of the 2nd and 3rd generated tokens (temperature 1)."""

    def next_probs(seq):
        logits, _ = target(torch.tensor([seq]), target.new_cache(1), logits_last_only=True)
        return torch.softmax(logits[0, -1].double(), -1)

    p1 = next_probs(prompt)
    m2, m3 = torch.zeros(vocab, dtype=torch.float64), torch.zeros(vocab, dtype=torch.float64)
    for x1 in range(vocab):
        p2 = next_probs(prompt + [x1])
        m2 += p1[x1] * p2
        for x2 in range(vocab):
            m3 += p1[x1] * p2[x2] * next_probs(prompt + [x1, x2])
    return m2, m3


@pytest.mark.parametrize("seeded", [True, False])
def test_sampling_dflash_keeps_target_distribution(seeded):
    """Tokens 2 and 3 come from a speculative round (2 drafts verified with the rejection rule, or for a
    seeded request compared with the target's own sample of the position's noise); their empirical
    distributions must match the target's exact marginals (chi-square, p=0.001)."""
    from adaflash import engine as E

    E.ENTROPY.seed(0)  # unseeded requests' generators: repeatable statistics
    vocab = 8
    target = tiny_target(5, vocab=vocab, layers=2, std=0.25)
    drafter = tiny_drafter(target, 7, block_size=4)
    prompt = [1, 5, 2]
    m2, m3 = _marginals(target, prompt, vocab)
    n = 1500
    c2, c3 = torch.zeros(vocab), torch.zeros(vocab)
    accepted = 0
    engine = Engine(target, drafter, FixedPolicy(), eos_ids=[], max_batch=1)
    for s in range(n):
        res = engine.generate(prompt, 3, temperature=1.0, seed=s if seeded else None)
        c2[res.out[1]] += 1
        c3[res.out[2]] += 1
        accepted += sum(r.accepted for r in res.rounds)
    for counts, exact in ((c2, m2), (c3, m3)):
        expected = exact * n
        chi2 = ((counts.double() - expected) ** 2 / expected.clamp(min=1e-9)).sum().item()
        assert chi2 < 24.3, (chi2, counts, expected)  # 7 degrees of freedom, p = 0.001
    assert accepted > n * 0.05  # the accept path was exercised (~180 / ~100 acceptances here), not only the residual


def test_bf16_drafter_beside_fp32_target_stays_lossless():
    target = tiny_target(11)
    drafter = tiny_drafter(target, 11).to(torch.bfloat16)
    drafter.attach(target, torch.bfloat16)  # its own bf16 copy of the shared embedding / LM head
    prompt = [3, 1, 4, 1, 5]
    assert generate(target, drafter, prompt, 30, []).out == greedy_reference(target, prompt, 30, [])
    assert target.lm_head.weight.dtype == torch.float32
