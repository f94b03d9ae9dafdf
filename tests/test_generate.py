"""Generation loops: greedy DFlash == plain greedy decoding; sampling keeps the target distribution."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_drafter, tiny_target

from adaflash.generate import generate_ar, generate_dflash


class OracleDrafter:
    """Fixed-output mock: drafts the target's true greedy continuation, corrupting each position with
    probability `noise`, so rounds accept every possible prefix length."""

    block_size = 6
    vocab = None  # drafts from the whole vocabulary (no draft vocabulary)

    def __init__(self, reference: list[int], vocab: int, noise: float, seed: int, second: float = 0.0):
        self.reference, self.vocab_size, self.noise, self.second = reference, vocab, noise, second
        self.rng = random.Random(seed)

    class Cache:
        length = 0

    def new_cache(self, batch=1, capacity=0):
        return self.Cache()

    def extend_context(self, feats, cache):
        cache.length += feats.shape[1]

    def draft(self, cache, last_token, n_logits=None):
        n = n_logits or self.block_size - 1
        logits = torch.zeros(1, n, self.vocab_size)
        for j in range(n):
            pos = cache.length + 1 + j  # the anchor sits at position cache.length
            tok = self.reference[pos] if pos < len(self.reference) else 0
            if self.rng.random() < self.noise:
                if self.second and self.rng.random() < self.second:
                    logits[0, j, tok] = 6.0  # the true token drafted second best (a tree can still take it)
                tok = (tok + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
            logits[0, j, tok] = 8.0  # peaked, like a trained drafter's
        return logits, None


@pytest.mark.parametrize("seed", range(12))
def test_greedy_dflash_equals_plain_decoding(seed):
    target = tiny_target(seed)
    drafter = tiny_drafter(target, seed)
    prompt = torch.randint(0, 64, (3 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
    eos = [seed % 64] if seed % 3 == 0 else []  # some runs stop on EOS mid-block
    ar = generate_ar(target, prompt, 40, eos)
    for verify_len in (None, 2, 4):
        sd = generate_dflash(target, drafter, prompt, 40, eos, verify_len=verify_len)
        assert sd.output_ids == ar.output_ids
        assert sd.target_forwards == sd.rounds + 1
    for noise in (0.0, 0.3, 0.7):
        oracle = OracleDrafter(prompt + ar.output_ids, 64, noise, seed)
        sd = generate_dflash(target, oracle, prompt, 40, eos)
        assert sd.output_ids == ar.output_ids
        if noise == 0.0 and len(ar.output_ids) == 40:
            assert sd.tau > 4  # near-perfect drafts commit nearly whole blocks
        assert sd.committed == len(sd.output_ids) - 1


@pytest.mark.parametrize("seed", range(6))
def test_greedy_tree_dflash_equals_plain_decoding(seed):
    """Tree verification commits exactly plain greedy decoding's tokens, and takes second-best drafts a
    chain cannot (an oracle whose corrupted positions keep the true token at rank 2)."""
    target = tiny_target(seed)
    drafter = tiny_drafter(target, seed)
    prompt = torch.randint(0, 64, (3 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
    eos = [seed % 64] if seed % 3 == 0 else []
    ar = generate_ar(target, prompt, 40, eos)
    for n in (1, 4, 24):
        sd = generate_dflash(target, drafter, prompt, 40, eos, tree=n)
        assert sd.output_ids == ar.output_ids
        assert sd.target_forwards == sd.rounds + 1 and sd.committed == len(sd.output_ids) - 1
    chain = generate_dflash(target, OracleDrafter(prompt + ar.output_ids, 64, 0.4, seed, second=1.0), prompt, 40, eos)
    tree = generate_dflash(target, OracleDrafter(prompt + ar.output_ids, 64, 0.4, seed, second=1.0), prompt, 40, eos, tree=16)
    assert chain.output_ids == ar.output_ids and tree.output_ids == ar.output_ids
    if len(ar.output_ids) >= 20:
        assert tree.tau > chain.tau
    with pytest.raises(ValueError, match="greedy"):
        generate_dflash(target, drafter, prompt, 8, eos, temperature=0.8, tree=4)
    with pytest.raises(ValueError, match="lookup needs a token tree"):
        generate_dflash(target, drafter, prompt, 8, eos, lookup=4)


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
    ar = generate_ar(target, prompt, 40, eos)
    out = ar.output_ids
    for lookup in (1, 4, 15):
        sd = generate_dflash(target, OracleDrafter(prompt + out, 64, 1.0, seed), prompt, 40, eos, tree=1, lookup=lookup)
        assert sd.output_ids == out
        a, rounds = 1, 0  # out[0] comes from the prefill
        while a < len(out):
            chain = lookup_chain(prompt + out[:a], min(lookup, 5, 40 - a - 1))  # OracleDrafter blocks are 6
            n = next((j for j, t in enumerate(chain) if a + j >= len(out) or out[a + j] != t), len(chain))
            a, rounds = a + n + 1, rounds + 1
        assert sd.rounds == rounds and sd.committed == len(out) - 1


def test_max_new_tokens_and_stats():
    target = tiny_target(3)
    prompt = [1, 2, 3]
    ar = generate_ar(target, prompt, 17, [])
    oracle = OracleDrafter(prompt + ar.output_ids, 64, 0.0, 0)
    sd = generate_dflash(target, oracle, prompt, 17, [])
    assert len(sd.output_ids) == 17 == len(ar.output_ids)
    assert sd.output_ids == ar.output_ids
    assert sd.accept_by_position[0] == 1.0
    assert sum(sd.accepted_per_round) + sd.rounds >= 16


def test_context_limit_is_checked():
    target = tiny_target()
    with pytest.raises(ValueError, match="exceeds the target's context"):
        generate_ar(target, [1] * 8190, 10, [])


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


def test_sampling_dflash_keeps_target_distribution():
    """Tokens 2 and 3 come from a speculative round (2 drafts verified with the rejection rule);
    their empirical distributions must match the target's exact marginals (chi-square, p=0.001)."""
    vocab = 8
    target = tiny_target(5, vocab=vocab, layers=2, std=0.25)
    drafter = tiny_drafter(target, 7, block_size=4)
    prompt = [1, 5, 2]
    m2, m3 = _marginals(target, prompt, vocab)
    n = 1500
    c2, c3 = torch.zeros(vocab), torch.zeros(vocab)
    accepted = 0
    for s in range(n):
        res = generate_dflash(target, drafter, prompt, 3, [], temperature=1.0, seed=s)
        c2[res.output_ids[1]] += 1
        c3[res.output_ids[2]] += 1
        accepted += sum(res.accepted_per_round)
    for counts, exact in ((c2, m2), (c3, m3)):
        expected = exact * n
        chi2 = ((counts.double() - expected) ** 2 / expected.clamp(min=1e-9)).sum().item()
        assert chi2 < 24.3, (chi2, counts, expected)  # 7 degrees of freedom, p = 0.001
    assert accepted > n * 0.05  # the accept path was exercised (~180 acceptances here), not only the residual


def test_bf16_drafter_beside_fp32_target_stays_lossless():
    target = tiny_target(11)
    drafter = tiny_drafter(target, 11).to(torch.bfloat16)
    drafter.attach(target, torch.bfloat16)  # its own bf16 copy of the shared embedding / LM head
    prompt = [3, 1, 4, 1, 5]
    ar = generate_ar(target, prompt, 30, [])
    sd = generate_dflash(target, drafter, prompt, 30, [])
    assert sd.output_ids == ar.output_ids
    assert target.lm_head.weight.dtype == torch.float32
