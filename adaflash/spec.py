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

Seeded sampling (a request with a seed) is made reproducible whatever the rounds: every token position t
has its own exponential noise E_t over the vocabulary, a hash of (seed, t) (`noise`), and the token at t
is always argmax p_t / E_t (the Gumbel-max trick: distributed as p_t). The drafter drafts argmax q_t / E_t
with the same noise, and drafts are accepted while they equal the target's tokens, as greedy verifies.
The text is then the target's own seeded sample token for token, however verify lengths, batches,
drafter versions, prompt lookup or trees cut the rounds. Such a draft is accepted with probability at
least (1 - TV) / (1 + TV) against the rejection rule's 1 - TV (TV(p, q): total variation; in `adaflash
bench` at T = 0.7, tau 3-8% lower), so unseeded requests keep the rejection rule.
"""

from __future__ import annotations

import functools

import torch


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[..., V] logits -> [..., V] fp32 probabilities at `temperature` (> 0). The max is subtracted before
    dividing, so a tiny temperature gives the one-hot limit instead of inf / inf = NaN (found by the API fuzzer)."""
    x = logits.float()
    t = max(float(temperature), 1e-30)  # a float64 temperature below fp32's range would divide by 0
    return torch.softmax((x - x.amax(-1, keepdim=True)) / t, dim=-1)


def sample(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[..., V] probabilities -> [...] sampled ids: the inverse CDF at one uniform per row, kept below the
    row's total so that a zero-probability id is never hit. torch.multinomial took 1.3 ms a row of 49,152
    on this CPU, this 0.03 ms."""
    cdf = p.reshape(-1, p.shape[-1]).float().cumsum(-1)  # [R, V]
    total = cdf[:, -1:]  # [R, 1]
    u = torch.rand(total.shape, generator=generator, device=p.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u * total may round up to total
    return torch.searchsorted(cdf, u, right=True)[:, 0].view(p.shape[:-1])


_MASK, _GOLDEN = (1 << 64) - 1, 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scatters nearby inputs."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32, a 32-bit integer hash, in place on an int32 tensor (products wrap; right shifts are
    masked to be logical)."""
    x.bitwise_xor_((x >> 16) & 0xFFFF).mul_(0x21F0AAAD)
    x.bitwise_xor_((x >> 15) & 0x1FFFF).mul_(0x735A2D97)
    return x.bitwise_xor_((x >> 15) & 0x1FFFF)


@functools.lru_cache(maxsize=8)
def _spread_ids(vocab: int, device: str) -> torch.Tensor:
    """[vocab] int32 token ids times 0x9E3779B1 (wrapped): far apart in every bit before the hash."""
    return torch.arange(vocab, dtype=torch.int32, device=device) * -1640531535


def noise(seed: int, start: int, n: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n, vocab] float32 Exp(1) noise of token positions start..start+n-1 of a request seeded `seed`
    (any 64-bit integer), made on `device`: a counter-based hash of (seed, position, token id), so a
    position's noise never depends on which round, step, batch or device drew it."""
    key = _mix64(seed & _MASK)
    rows = [_mix64((key + (t + 1) * _GOLDEN) & _MASK) & 0xFFFFFFFF for t in range(start, start + n)]
    rows = torch.tensor([r - (1 << 32) if r >= 1 << 31 else r for r in rows], dtype=torch.int32, device=device)  # [n]
    x = _mix32_(rows[:, None] ^ _spread_ids(vocab, str(device))[None])  # [n, vocab]
    u = ((x >> 8) & 0xFFFFFF).float().add_(0.5).mul_(2.0**-24)  # [n, vocab] 24-bit uniforms in (0, 1)
    return u.log_().neg_()


def gumbel_pick(p: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """[..., V] probabilities, [..., V] Exp(1) noise -> [...] argmax p / e: a sample of p, fixed by e."""
    return (p / e.to(p.device)).max(-1).indices


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim [..., V] -> [...]: `max`'s indices, the same first maximum, and 3x faster
    than `argmax` on a CPU (128 rows of SmolLM2's 49,152 logits: 1.9 vs 6.1 ms; a c=32 verify step does this)."""
    return logits.max(-1).indices


def pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None, e: torch.Tensor | None = None) -> torch.Tensor:
    """Next token from [..., V] logits: argmax at temperature 0, else a sample (fixed by the noise e
    [..., V] of a seeded request)."""
    if temperature <= 0:
        return greedy(logits)
    p = probs(logits, temperature)
    return sample(p, generator) if e is None else gumbel_pick(p, e)


def accepted_length(draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Length of the longest equal prefix per row (what greedy verification accepts): [..., k] x2 -> [...] int64."""
    if draft.shape != target.shape:
        raise ValueError(f"draft and target must have the same shape, got {tuple(draft.shape)} and {tuple(target.shape)}")
    return (draft == target).long().cumprod(dim=-1).sum(dim=-1)


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft [B, k]; target_logits [B, k+1, V] -> (accepted [B], bonus token [B])."""
    return accept_greedy(draft, greedy(target_logits))


def accept_greedy(draft: torch.Tensor, target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft [B, k]; target_tokens [B, k+1] (the target's greedy choice after each input) -> (accepted [B],
    bonus token [B])."""
    n = accepted_length(draft, target_tokens[:, :-1])  # [B]
    bonus = target_tokens.gather(1, n[:, None])[:, 0]  # first mismatch, or after the last draft
    return n, bonus


def accept_greedy_tokens(draft: list[int], best: list[int]) -> tuple[int, int]:
    """`accept_greedy` for one request on lists: draft [k], best [k+1] the target's token (greedy, or its
    seeded sample) after the anchor and each draft -> (accepted drafts, next token). A greedy or seeded round
    (`verify`) takes this on its chosen tokens' list: the five small tensor ops of `accept_greedy` and their
    conversions cost ~0.1 ms a round on a CPU (SmolLM2 q4, 32 requests on the 2-core EPYC: `Engine._verify`
    3.7 ms a step)."""
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return n, best[n]


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


def propose(
    draft_logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
    vocab: torch.Tensor | None = None,
    vocab_size: int = 0,
    e: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One request's drafts from its drafter logits [k, Vd] -> (draft ids [k], q [k, V] or None when greedy
    or seeded: a seeded request drafts with the noise e [k, V] of the positions drafted, which the target
    samples with too).

    `vocab` [Vd]: the full ids of the logits' columns when the drafter drafts from a subset of the
    target's `vocab_size` tokens; q is then scattered back to the full vocabulary, zero outside the
    subset, so the rejection rule sees a proper distribution over the target's vocabulary."""
    if temperature <= 0 or e is not None:
        if e is not None and vocab is not None:
            e = e[:, vocab]  # [k, Vd] the noise of the draft vocabulary's ids
        j = pick(draft_logits, temperature, None, e)
        return (j if vocab is None else vocab[j]), None
    q = probs(draft_logits, temperature)  # [k, Vd]
    j = sample(q, generator)  # [k]
    if vocab is None:
        return j, q
    full = q.new_zeros(q.shape[0], vocab_size).index_copy_(1, vocab, q)  # [k, V]
    return vocab[j], full


def verify(
    draft: torch.Tensor,
    q: torch.Tensor | None,
    target_logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
    e: torch.Tensor | None = None,
    best: list[int] | None = None,
) -> tuple[int, int, list[int]]:
    """One request's round: draft [k], target_logits [k+1, V], a seeded request's noise e [k+1, V] ->
    (accepted drafts, next token, the target's greedy token after each of the first k inputs: what the
    round record keeps, from the same argmax that greedy verification takes; one argmax over 49,152
    logits per row is not free on a CPU). best [k+1]: that argmax where the caller took it already (the
    engine, for a whole step's rows in one call)."""
    if best is None:
        best = greedy(target_logits).tolist()  # [k+1]
    if temperature <= 0 or e is not None:  # greedy, or seeded: the target's own tokens, accepted on lists
        chosen = best if temperature <= 0 else pick(target_logits, temperature, None, e).tolist()  # [k+1]
        return (*accept_greedy_tokens(draft.tolist(), chosen), best[:-1])
    target = best[:-1]
    if draft.numel() == 0:  # nothing drafted: a plain sampled step
        return 0, int(pick(target_logits[-1], temperature, generator)), target
    n, nxt = verify_sampling(draft[None], q[None], probs(target_logits[None], temperature), generator)
    return int(n[0]), int(nxt[0]), target


# --------------------------------------------------------------------------- tree verification (greedy and seeded)
#
# A block drafter gives one distribution per block position, each conditioned on the context alone
# (not on the drafts before it). A round may therefore verify several candidates per position at once:
# a token tree whose root is the anchor, where a node at depth j holds one of the top candidates of
# position j. One target forward over all nodes, each attending to the cache and its own ancestors
# (RoPE position = depth), gives the target's next-token logits after every path; greedy acceptance
# walks down from the root, taking the child that equals the target's argmax (a seeded sampled request:
# its sample with the noise of the node's depth). Output is unchanged: every committed token is the
# target's own token after the committed text before it.


def build_tree(
    draft_logits: torch.Tensor, n_nodes: int, vocab: torch.Tensor | None = None, width: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter logits [D, Vd] of positions 1..D -> the `n_nodes` most likely draft paths as a tree:
    (tokens [N] full-vocabulary ids, parents [N]: index of the parent node, 0 = the anchor; node i sits
    at index i + 1 of the verified sequence [anchor, tokens]). A path's score is the product of its
    tokens' drafter probabilities; best-first search over the top `width` tokens per position returns
    the exact top N, parents before children (a child scores below its parent)."""
    import heapq

    d = draft_logits.shape[0]
    logp, ids = torch.log_softmax(draft_logits.float(), -1).topk(min(width, draft_logits.shape[-1]), -1)  # [D, W]
    if vocab is not None:
        ids = vocab[ids]
    logp, w = logp.tolist(), ids.shape[1]
    tokens, parents = [], []
    heap = [(-logp[0][0], 0, 0, 0)]  # (-score, depth, rank, parent index); depth 0 = block position 1
    while heap and len(tokens) < n_nodes:
        neg, depth, rank, parent = heapq.heappop(heap)
        tokens.append(int(ids[depth, rank]))
        parents.append(parent)
        node = len(tokens)  # this node's index in [anchor, tokens]
        if rank + 1 < w:  # the next sibling: same parent, next candidate at this depth
            heapq.heappush(heap, (neg + logp[depth][rank] - logp[depth][rank + 1], depth, rank + 1, parent))
        if depth + 1 < d:  # the best child
            heapq.heappush(heap, (neg - logp[depth + 1][0], depth + 1, 0, node))
    return torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)


def tree_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [N] (0 = anchor) -> ancestor mask [N+1, N+1] over [anchor, nodes]: True where row i may
    attend column j (j is i or one of its ancestors). Row sums - 1 are the nodes' depths."""
    n = parents.numel() + 1
    mask = torch.eye(n, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(parents.tolist(), start=1):  # parents come before children
        mask[i] |= mask[p]
    return mask


def lookup_chain(history: list[int], length: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Prompt lookup: find the most recent earlier occurrence of the longest suffix n-gram of `history`
    (n = max_ngram down to min_ngram) and return the up to `length` tokens that followed it ([] if none).
    Answers often copy spans of their prompt or of themselves (numbers, names, restated questions):
    the block drafter, conditioned on features, misses many of those, a string match does not."""
    if length <= 0 or len(history) < 2:
        return []
    last = history[-1]  # earlier places of the last token (plain Python: a tensor of the history cost 6x the search,
    ends = [i for i, t in enumerate(history[:-1]) if t == last]  # and this runs for every request every step)
    for n in range(min(max_ngram, len(history) - 1), max(min_ngram, 1) - 1, -1):
        tail = history[-n:]
        for j in reversed(ends):  # most recent first; the suffix itself (ending at the last token) excluded
            if j >= n - 1 and history[j - n + 1 : j + 1] == tail:
                return history[j + 1 : j + 1 + length]
    return []


def graft(tokens: torch.Tensor, parents: torch.Tensor, chain: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Add `chain` to a tree (tokens, parents [N], 0 = the anchor) as a path from the anchor, reusing the
    nodes it shares with the tree -> (tokens, parents [N + new nodes]); siblings stay distinct and
    parents stay before children."""
    toks, pars = tokens.tolist(), parents.tolist()
    children = {(p, t): i for i, (t, p) in enumerate(zip(toks, pars), start=1)}
    node = 0
    for t in chain:
        if (node, t) not in children:
            toks.append(t)
            pars.append(node)
            children[(node, t)] = len(toks)
        node = children[(node, t)]
    return torch.tensor(toks, dtype=torch.long), torch.tensor(pars, dtype=torch.long)


def verify_tree_greedy(tokens: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """tokens, parents [N]; target_logits [N+1, V] over [anchor, nodes] -> (accepted path: node indices
    1..N from the root down, the target's next token after it)."""
    return walk_tree(tokens, parents, greedy(target_logits).tolist())


def walk_tree(tokens: torch.Tensor, parents: torch.Tensor, best: list[int]) -> tuple[list[int], int]:
    """`verify_tree_greedy` from the target's greedy token after the anchor and each node, best [N+1]."""
    children: dict[tuple[int, int], int] = {}
    for i, (t, p) in enumerate(zip(tokens.tolist(), parents.tolist()), start=1):
        children[(p, t)] = i  # siblings hold distinct tokens (top candidates of one position)
    path, node = [], 0
    while (node, best[node]) in children:
        node = children[(node, best[node])]
        path.append(node)
    return path, best[node]
