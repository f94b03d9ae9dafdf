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
from adaflash.spec import build_tree, graft, lookup_chain, pick, propose, tree_mask, verify, verify_tree_greedy
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
    model: TargetModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_ids: list[int],
    temperature: float = 0.0,
    seed: int = 0,
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
    model: TargetModel,
    drafter: Drafter,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_ids: list[int],
    temperature: float = 0.0,
    seed: int = 0,
    verify_len: int | None = None,
    tree: int | None = None,
    lookup: int = 0,
) -> GenerationResult:
    """Speculative decoding with the block drafter: draft K-1 tokens in one pass, verify up to
    `verify_len - 1` of them (default all) in one target forward, commit accepted + 1.
    `tree` N (greedy only): verify the N most likely draft paths as a token tree instead of one chain
    (spec.build_tree); the accepted path is the longest one the target's argmax follows. `lookup` L (trees
    only): also graft the up to L tokens that followed the last earlier occurrence of the text's final
    n-gram (spec.lookup_chain) into each tree."""
    k_blk = drafter.block_size
    n_verify = min(verify_len or k_blk, k_blk) - 1  # drafts verified per round
    if tree is not None and (tree < 1 or temperature > 0):
        raise ValueError(
            "tree verification needs tree >= 1 node and greedy decoding (temperature 0); sample with a chain (verify_len) instead"
        )
    if lookup < 0 or (lookup and tree is None):
        raise ValueError("lookup needs a token tree (tree >= 1) and a length >= 0")
    check_length(model, len(prompt_ids), max_new_tokens, k_blk)
    dev = model.lm_head.weight.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    eos = set(eos_ids)
    t0 = time.perf_counter()
    cap = len(prompt_ids) + max_new_tokens + max(k_blk, (tree or 0) + lookup) + 1
    tcache, dcache = model.new_cache(1, cap), drafter.new_cache(1, cap)
    logits, feats = model(torch.tensor([prompt_ids], device=dev), tcache, logits_last_only=True)
    drafter.extend_context(feats, dcache)
    res = GenerationResult(output_ids=[], target_forwards=1, drafted_at=[0] * (k_blk - 1), accepted_at=[0] * (k_blk - 1))
    out, done = _stop([int(pick(logits[0, -1], temperature, gen))], eos, max_new_tokens)
    while not done:
        budget = max_new_tokens - len(out) - 1  # never draft past the budget
        last = torch.tensor([out[-1]], device=dev)
        if tree is not None and budget > 0:
            chain = lookup_chain(prompt_ids + out, min(lookup, k_blk - 1, budget))
            accepted, nxt, k = _tree_round(model, drafter, tcache, dcache, last, min(k_blk - 1, budget), tree, chain)
        else:
            k = min(n_verify, budget)
            draft, q = torch.zeros(0, dtype=torch.long, device=dev), None
            if k > 0:
                draft_logits, _ = drafter.draft(dcache, last, n_logits=k)  # [1, k, Vd]
                draft, q = propose(draft_logits[0], temperature, gen, drafter.vocab, drafter.vocab_size)  # [k], [k, V] or None
            logits, feats = model(torch.cat([last, draft])[None], tcache)  # [1, k+1, V]
            n, nxt = verify(draft, q, logits[0], temperature, gen)
            tcache.crop(tcache.length - (k - n))  # drop rejected drafts; [last, accepted] stay
            drafter.extend_context(feats[:, : 1 + n], dcache)
            accepted = draft[:n].tolist()
        n = len(accepted)
        before = len(out)
        out, done = _stop(out + accepted + [nxt], eos, max_new_tokens)
        res.target_forwards += 1
        res.rounds += 1
        res.committed += len(out) - before
        res.accepted_per_round.append(n)
        for j in range(k):  # k: block positions verified this round (a tree's depth)
            res.drafted_at[j] += 1
            res.accepted_at[j] += j < n
    res.output_ids, res.wall_s = out, time.perf_counter() - t0
    return res


def _tree_round(
    model: TargetModel, drafter: Drafter, tcache, dcache, last: torch.Tensor, depth: int, n_nodes: int, chain: list[int]
) -> tuple[list[int], int, int]:
    """One greedy tree round: draft `depth` block positions, verify the best `n_nodes` paths plus the
    lookup `chain` in one target forward, keep the accepted path's K/V in both caches;
    -> (accepted drafts, next token, tree depth)."""
    depth = min(depth, n_nodes)  # a tree of N nodes is at most N deep
    draft_logits, _ = drafter.draft(dcache, last, n_logits=depth)  # [1, D, Vd]
    tokens, parents = graft(*build_tree(draft_logits[0], n_nodes, drafter.vocab), chain)  # [N'], [N']
    mask = tree_mask(parents)  # [N+1, N+1] over [anchor, nodes]
    start = tcache.length
    logits, feats = model(torch.cat([last, tokens.to(last.device)])[None], tcache, tree=mask)  # [1, N+1, V]
    path, nxt = verify_tree_greedy(tokens, parents, logits[0])
    keep = [0] + path  # the anchor, then the accepted nodes
    tcache.keep(start, keep)
    drafter.extend_context(feats[:, keep], dcache)
    return [int(tokens[i - 1]) for i in path], nxt, int(mask.sum(1).max()) - 1
