"""The speculative core: pure functions over tensors for drafting and verifying.

A round verifies k drafted tokens d_1..d_k with one target forward over [last, d_1..d_k], which
yields the target's distributions p_0..p_k for the positions right after each of those inputs.

Greedy (temperature 0): accept the longest prefix with d_j == argmax p_{j-1}; the target's own
argmax at the first mismatch (or after the last draft) is the bonus token. The committed tokens are
exactly what greedy decoding of the target alone would produce.

Sampling (temperature T > 0): with q_j the drafter's distribution at position j (d_j ~ q_j), accept
d_j with probability min(1, p_{j-1}(d_j) / q_j(d_j)); at the first rejection sample from the
normalised residual max(0, p_{j-1} - q_j); if all k are accepted sample the bonus from p_k. Every
committed token is then distributed exactly as the target's own sample (Leviathan et al., 2023).
"""

from __future__ import annotations

import torch


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[..., V] logits -> [..., V] fp32 probabilities at `temperature` (> 0)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[..., V] probabilities -> [...] sampled ids."""
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(p.shape[:-1])


def pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """Next token from [..., V] logits: argmax at temperature 0, else a sample."""
    if temperature <= 0:
        return logits.argmax(-1)
    return sample(probs(logits, temperature), generator)


def accepted_length(draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[B, k] draft and target tokens -> [B] length of the longest equal prefix."""
    return (draft == target).long().cumprod(dim=1).sum(dim=1)


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft [B, k]; target_logits [B, k+1, V] -> (accepted [B], bonus token [B])."""
    target_tokens = target_logits.argmax(-1)  # [B, k+1]: the target's greedy choice after each input
    n = accepted_length(draft, target_tokens[:, :-1])  # [B]
    bonus = target_tokens.gather(1, n[:, None])[:, 0]  # first mismatch, or after the last draft
    return n, bonus


def verify_sampling(
    draft: torch.Tensor,  # [B, k] d_j ~ q_j
    q: torch.Tensor,  # [B, k, V] drafter probabilities
    p: torch.Tensor,  # [B, k+1, V] target probabilities
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless rejection sampling -> (accepted [B], next token [B])."""
    b, k = draft.shape
    p_d = p[:, :k].gather(2, draft[..., None])[..., 0]  # [B, k] target prob of each draft
    q_d = q.gather(2, draft[..., None])[..., 0]  # [B, k] drafter prob of each draft
    u = torch.rand(b, k, generator=generator, device=p.device)
    accept = u * q_d < p_d  # u < p/q without dividing by a zero q
    n = accept.long().cumprod(dim=1).sum(dim=1)  # [B]
    rows = torch.arange(b, device=p.device)
    p_n = p[rows, n]  # [B, V] target distribution at the first rejection (or the bonus slot)
    q_n = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, n]  # zero after the last draft
    residual = (p_n - q_n).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p_n)  # q == p: fall back to p
    return n, sample(residual, generator)


def propose(draft_logits: torch.Tensor, temperature: float, generator: torch.Generator | None,
            vocab: torch.Tensor | None = None, vocab_size: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One request's drafts from its drafter logits [k, Vd] -> (draft ids [k], q [k, V] or None when greedy).

    `vocab` [Vd]: the full ids of the logits' columns when the drafter drafts from a subset of the
    target's `vocab_size` tokens; q is then scattered back to the full vocabulary, zero outside the
    subset, so the rejection rule sees a proper distribution over the target's vocabulary."""
    if temperature <= 0:
        j = draft_logits.argmax(-1)
        return (j if vocab is None else vocab[j]), None
    q = probs(draft_logits, temperature)  # [k, Vd]
    j = torch.multinomial(q, 1, generator=generator)[:, 0]
    if vocab is None:
        return j, q
    full = q.new_zeros(q.shape[0], vocab_size).index_copy_(1, vocab, q)  # [k, V]
    return vocab[j], full


def verify(draft: torch.Tensor, q: torch.Tensor | None, target_logits: torch.Tensor, temperature: float,
           generator: torch.Generator | None) -> tuple[int, int]:
    """One request's round: draft [k], target_logits [k+1, V] -> (accepted drafts, next token)."""
    if temperature <= 0:
        n, nxt = verify_greedy(draft[None], target_logits[None])
    elif draft.numel() == 0:  # nothing drafted: a plain sampled step
        return 0, int(pick(target_logits[-1], temperature, generator))
    else:
        n, nxt = verify_sampling(draft[None], q[None], probs(target_logits[None], temperature), generator)
    return int(n[0]), int(nxt[0])
