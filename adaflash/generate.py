"""Single-request generation loops: plain autoregressive decoding and DFlash speculative decoding.

Both return the tokens with the statistics every run reports: target forwards, tau (tokens committed
per verification forward) and acceptance by block position. Output stops right after the first EOS
(inclusive) or at max_new_tokens, identically for both methods, so greedy outputs compare token for
token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from adaflash.drafter import Drafter
from adaflash.spec import pick, propose, verify
from adaflash.target import TargetModel


@dataclass
class GenerationResult:
    output_ids: list[int]
    target_forwards: int = 0  # prefill included
    rounds: int = 0  # verification forwards (AR: decode forwards)
    committed: int = 0  # tokens committed by those rounds (the prefill's token excluded)
    drafted_at: list[int] = field(default_factory=list)  # [K-1] rounds that verified block position j+1
    accepted_at: list[int] = field(default_factory=list)  # [K-1] rounds that accepted block position j+1
    accepted_per_round: list[int] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def tau(self) -> float:
        return self.committed / self.rounds if self.rounds else 1.0

    @property
    def accept_by_position(self) -> list[float]:
        return [a / d if d else float("nan") for a, d in zip(self.accepted_at, self.drafted_at)]


def _stop(tokens: list[int], eos: set[int], max_new: int) -> tuple[list[int], bool]:
    """Trim at the first EOS (kept) or at max_new; say whether generation is over."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1][:max_new], True
    return tokens[:max_new], len(tokens) >= max_new


def check_length(model: TargetModel, n_prompt: int, max_new_tokens: int, block: int = 1) -> None:
    limit = model.config.max_position_embeddings
    if n_prompt + max_new_tokens + block > limit:
        raise ValueError(
            f"prompt of {n_prompt} tokens + max_new_tokens {max_new_tokens} exceeds the target's context of {limit}; "
            "shorten the prompt or lower --max-new-tokens"
        )


@torch.no_grad()
def generate_ar(
    model: TargetModel, prompt_ids: list[int], max_new_tokens: int, eos_ids: list[int],
    temperature: float = 0.0, seed: int = 0,
) -> GenerationResult:
    """Plain decoding: one target forward per token (the denominator of every speedup)."""
    check_length(model, len(prompt_ids), max_new_tokens)
    dev = model.lm_head.weight.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    t0 = time.perf_counter()
    cache = model.new_cache(1, len(prompt_ids) + max_new_tokens + 1)
    logits, _ = model(torch.tensor([prompt_ids], device=dev), cache, logits_last_only=True)
    res = GenerationResult(output_ids=[], target_forwards=1)
    out, done = _stop([int(pick(logits[0, -1], temperature, gen))], set(eos_ids), max_new_tokens)
    while not done:
        logits, _ = model(torch.tensor([[out[-1]]], device=dev), cache, logits_last_only=True)
        res.target_forwards += 1
        res.rounds += 1
        res.committed += 1
        out, done = _stop(out + [int(pick(logits[0, -1], temperature, gen))], set(eos_ids), max_new_tokens)
    res.output_ids, res.wall_s = out, time.perf_counter() - t0
    return res


@torch.no_grad()
def generate_dflash(
    model: TargetModel, drafter: Drafter, prompt_ids: list[int], max_new_tokens: int, eos_ids: list[int],
    temperature: float = 0.0, seed: int = 0, verify_len: int | None = None,
) -> GenerationResult:
    """Speculative decoding with the block drafter: draft K-1 tokens in one pass, verify up to
    `verify_len - 1` of them (default all) in one target forward, commit accepted + 1."""
    k_blk = drafter.block_size
    n_verify = min(verify_len or k_blk, k_blk) - 1  # drafts verified per round
    check_length(model, len(prompt_ids), max_new_tokens, k_blk)
    dev = model.lm_head.weight.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    eos = set(eos_ids)
    t0 = time.perf_counter()
    cap = len(prompt_ids) + max_new_tokens + k_blk + 1
    tcache, dcache = model.new_cache(1, cap), drafter.new_cache(1, cap)
    logits, feats = model(torch.tensor([prompt_ids], device=dev), tcache, logits_last_only=True)
    drafter.extend_context(feats, dcache)
    res = GenerationResult(output_ids=[], target_forwards=1, drafted_at=[0] * (k_blk - 1), accepted_at=[0] * (k_blk - 1))
    out, done = _stop([int(pick(logits[0, -1], temperature, gen))], eos, max_new_tokens)
    while not done:
        k = min(n_verify, max_new_tokens - len(out) - 1)  # never draft past the budget
        last = torch.tensor([out[-1]], device=dev)
        draft, q = torch.zeros(0, dtype=torch.long, device=dev), None
        if k > 0:
            draft_logits, _ = drafter.draft(dcache, last, n_logits=k)  # [1, k, Vd]
            draft, q = propose(draft_logits[0], temperature, gen, drafter.vocab, drafter.vocab_size)  # [k], [k, V] or None
        logits, feats = model(torch.cat([last, draft])[None], tcache)  # [1, k+1, V]
        n, nxt = verify(draft, q, logits[0], temperature, gen)
        tcache.crop(tcache.length - (k - n))  # drop rejected drafts; [last, accepted] stay
        drafter.extend_context(feats[:, : 1 + n], dcache)
        before = len(out)
        out, done = _stop(out + draft[:n].tolist() + [nxt], eos, max_new_tokens)
        res.target_forwards += 1
        res.rounds += 1
        res.committed += len(out) - before
        res.accepted_per_round.append(n)
        for j in range(k):
            res.drafted_at[j] += 1
            res.accepted_at[j] += j < n
    res.output_ids, res.wall_s = out, time.perf_counter() - t0
    return res
