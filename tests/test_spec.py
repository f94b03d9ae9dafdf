"""The verifier with fixed-logit mocks (never / always / 2 of 3 accepted) and the sampling rule's
distribution checked exactly and statistically."""

from __future__ import annotations

import math

import torch

from adaflash.spec import accepted_length, build_tree, graft, lookup_chain, tree_mask, verify_greedy, verify_sampling, verify_tree_greedy

V = 8


def onehot_logits(tokens: list[int]) -> torch.Tensor:
    """[1, len, V] logits whose argmax is `tokens`."""
    out = torch.full((1, len(tokens), V), -5.0)
    for i, t in enumerate(tokens):
        out[0, i, t] = 5.0
    return out


def test_greedy_never_accepts():
    draft = torch.tensor([[1, 2, 3]])
    n, bonus = verify_greedy(draft, onehot_logits([4, 2, 3, 7]))
    assert n.tolist() == [0] and bonus.tolist() == [4]  # the target's own token replaces the first draft


def test_greedy_always_accepts():
    draft = torch.tensor([[1, 2, 3]])
    n, bonus = verify_greedy(draft, onehot_logits([1, 2, 3, 7]))
    assert n.tolist() == [3] and bonus.tolist() == [7]  # all drafts plus the bonus after the last


def test_greedy_accepts_two_of_three():
    draft = torch.tensor([[1, 2, 3]])
    n, bonus = verify_greedy(draft, onehot_logits([1, 2, 5, 7]))
    assert n.tolist() == [2] and bonus.tolist() == [5]
    # a later match after a mismatch does not count
    n, _ = verify_greedy(torch.tensor([[1, 0, 3]]), onehot_logits([1, 2, 3, 7]))
    assert n.tolist() == [1]


def test_accepted_length_batch():
    d = torch.tensor([[1, 2, 3], [1, 2, 3], [0, 2, 3]])
    t = torch.tensor([[1, 2, 3], [1, 9, 3], [1, 2, 3]])
    assert accepted_length(d, t).tolist() == [3, 1, 0]


def test_sampling_zero_target_prob_never_accepts_and_full_match_always_accepts():
    g = torch.Generator().manual_seed(0)
    q = torch.full((1, 2, V), 1.0 / V)
    p = torch.zeros(1, 3, V)
    p[:, :, 5] = 1.0  # the target always says 5
    for _ in range(50):
        n, nxt = verify_sampling(torch.tensor([[1, 2]]), q, p, g)
        assert n.item() == 0 and nxt.item() == 5
    q_same = p[:, :2].clone()
    n, nxt = verify_sampling(torch.tensor([[5, 5]]), q_same, p, g)
    assert n.item() == 2 and nxt.item() == 5


def _first_token_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact distribution of the first committed token under the rejection rule with one draft."""
    accept = torch.minimum(torch.ones(V), p / q)  # P(accept | draft = x)
    from_accept = q * accept
    residual = (p - q).clamp(min=0)
    reject_mass = 1 - from_accept.sum()
    return from_accept + reject_mass * residual / residual.sum()


def test_rejection_rule_is_exactly_lossless():
    torch.manual_seed(0)
    for _ in range(10):
        p = torch.softmax(torch.randn(V) * 2, -1)
        q = torch.softmax(torch.randn(V) * 2, -1)
        torch.testing.assert_close(_first_token_distribution(p, q), p, atol=1e-6, rtol=1e-5)


def test_sampling_verify_keeps_target_distribution():
    """Chi-square test: the first committed token drawn by verify_sampling follows p, not q."""
    torch.manual_seed(1)
    p0 = torch.softmax(torch.randn(V) * 1.5, -1)
    q0 = torch.softmax(torch.randn(V) * 1.5, -1)
    n_samples = 20000
    g = torch.Generator().manual_seed(123)
    draft = torch.multinomial(q0, n_samples, replacement=True, generator=g)[:, None]  # [N, 1]
    q = q0.expand(n_samples, 1, V)
    p = torch.stack([p0, torch.softmax(torch.randn(V), -1)]).expand(n_samples, 2, V)
    n, nxt = verify_sampling(draft, q, p, g)
    first = torch.where(n == 1, draft[:, 0], nxt)
    counts = torch.bincount(first, minlength=V).double()
    expected = p0.double() * n_samples
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 24.3, chi2  # 7 degrees of freedom: p-value 0.001
    q_expected = q0.double() * n_samples  # and it is far from the drafter's own distribution
    assert ((counts - q_expected) ** 2 / q_expected).sum().item() > 100
    assert math.isclose(n.float().mean().item(), torch.minimum(p0, q0).sum().item(), abs_tol=0.02)


def test_sample_follows_p_and_never_picks_a_zero_probability_id():
    """The inverse-CDF sampler against p (chi-square over 8 ids, p = 0.001), rows sampled independently,
    and ids of zero probability (zeros at both ends, a one-hot row) never drawn."""
    from adaflash.spec import sample

    g = torch.Generator().manual_seed(5)
    p0 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    draws = sample(p0.expand(20000, V), g)  # [N]
    counts = torch.bincount(draws, minlength=V).double()
    expected = p0.double() * 20000
    assert ((counts - expected) ** 2 / expected).sum().item() < 24.3
    sparse = torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0, 0.0])
    got = sample(sparse.expand(5000, 6), g)
    assert set(got.tolist()) == {1, 3} and abs((got == 3).double().mean().item() - 0.7) < 0.03
    assert sample(torch.eye(6)[[5, 0, 2]], g).tolist() == [5, 0, 2]


def test_noise_is_fixed_by_seed_and_position():
    """A position's noise is the same whichever call draws it; seeds and positions differ; any 64-bit seed."""
    from adaflash.spec import noise

    e = noise(11, 0, 6, 300)  # [6, 300]
    torch.testing.assert_close(noise(11, 3, 3, 300), e[3:], rtol=0, atol=0)
    assert not torch.equal(noise(12, 0, 6, 300), e) and not torch.equal(e[0], e[1])
    for seed in (-(2**63), -1, 2**63 - 1):
        x = noise(seed, 5, 2, 300)
        assert x.shape == (2, 300) and bool((x > 0).all() and x.isfinite().all())
    big = noise(3, 0, 400, 512).double()  # Exp(1): mean 1, P(E > 1) = 1/e
    assert abs(big.mean().item() - 1) < 0.01 and abs((big > 1).double().mean().item() - math.exp(-1)) < 0.005


def test_seeded_sampling_keeps_target_distribution_and_equals_the_targets_sample():
    """Chi-square: the first token committed by a seeded round follows p, with drafts from a different q
    drafted with the same noise; it is the target's own sample with that noise, accepted or not; and the
    drafts are accepted about as often as the Gumbel coupling promises: at least (1 - TV) / (1 + TV)."""
    from adaflash.spec import gumbel_pick, noise, propose, verify

    torch.manual_seed(1)
    p0 = torch.softmax(torch.randn(V) * 1.5, -1)
    q0 = torch.softmax(torch.log(p0) + torch.randn(V) * 0.5, -1)
    n_samples, accepted = 6000, 0
    counts = torch.zeros(V, dtype=torch.float64)
    logits_p, logits_q = torch.log(torch.stack([p0, p0])), torch.log(q0)[None]  # [2, V] target, [1, V] drafter
    for s in range(n_samples):
        e = noise(s, 0, 2, V)  # [2, V]
        draft, q = propose(logits_q, 1.0, None, e=e[:1])
        assert q is None
        n, nxt, _ = verify(draft, None, logits_p, 1.0, None, e)
        first = int(draft[0]) if n == 1 else nxt
        assert first == int(gumbel_pick(p0, e[0]))
        counts[first] += 1
        accepted += n
    expected = p0.double() * n_samples
    assert ((counts - expected) ** 2 / expected).sum().item() < 24.3  # 7 degrees of freedom: p-value 0.001
    tv = 0.5 * (p0 - q0).abs().sum().item()
    assert accepted / n_samples > (1 - tv) / (1 + tv) - 0.02


# --------------------------------------------------------------------------- token trees


def test_build_tree_is_the_exact_top_n_paths():
    """Best-first search returns the N highest-probability paths (product over positions), prefix
    closed, parents before children; checked against brute force over all paths."""
    import itertools

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, generator=g) * 2  # [D=3, V=5]
    logp = torch.log_softmax(logits, -1)
    paths = [p for d in range(1, 4) for p in itertools.product(range(5), repeat=d)]
    score = {p: sum(float(logp[j, t]) for j, t in enumerate(p)) for p in paths}
    for n in (1, 4, 11, 30):
        tokens, parents = build_tree(logits, n, width=5)
        assert len(tokens) == n and bool((parents < torch.arange(1, n + 1)).all())  # parents come first
        got = []
        for i in range(n):  # node i+1's path: walk up to the anchor
            path, node = [], i + 1
            while node:
                path.insert(0, int(tokens[node - 1]))
                node = int(parents[node - 1])
            got.append(tuple(path))
        assert sorted(got, key=lambda p: -score[p]) == sorted(paths, key=lambda p: -score[p])[:n]
    vocab = torch.tensor([3, 10, 20, 30, 40])  # a draft vocabulary maps columns to full ids
    tokens, _ = build_tree(logits, 6, vocab, width=5)
    assert set(tokens.tolist()) <= set(vocab.tolist())


def test_tree_mask_marks_ancestors_and_depths():
    parents = torch.tensor([0, 0, 1, 3, 2])  # anchor -> {1, 2}; 1 -> 3 -> 4; 2 -> 5
    mask = tree_mask(parents)
    assert mask.sum(1).tolist() == [1, 2, 2, 3, 4, 3]  # depth + 1
    assert mask[4].nonzero()[:, 0].tolist() == [0, 1, 3, 4]
    assert not mask[5, 1] and mask[5, 2]


def test_tree_verifier_with_fixed_logits():
    """Mock target logits over [anchor, nodes]: reject the whole tree, follow the second branch, and
    accept a whole path with the bonus token after its leaf."""
    tokens = torch.tensor([1, 2, 3, 4, 5])
    parents = torch.tensor([0, 0, 1, 3, 2])  # paths: 1-3-4 and 2-5
    path, nxt = verify_tree_greedy(tokens, parents, onehot_logits([7, 0, 0, 0, 0, 0])[0])
    assert (path, nxt) == ([], 7)  # the target wants 7 after the anchor: no node holds it
    path, nxt = verify_tree_greedy(tokens, parents, onehot_logits([2, 0, 6, 0, 0, 0])[0])
    assert (path, nxt) == ([2], 6)  # 2 accepted; after 2 the target wants 6, not the child 5
    path, nxt = verify_tree_greedy(tokens, parents, onehot_logits([1, 3, 0, 4, 7, 0])[0])
    assert (path, nxt) == ([1, 3, 4], 7)  # 1, 3, 4 accepted; the bonus comes after the leaf


def test_lookup_chain_takes_the_latest_longest_match():
    hist = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    assert lookup_chain(hist, 3) == [9, 2, 6]  # the suffix 6 7 last occurred before 9
    assert lookup_chain(hist, 1, max_ngram=1) == [9]  # 7 alone: its latest earlier occurrence, followed by 9
    assert lookup_chain([1, 2, 3, 4, 2, 3], 4) == [4, 2, 3]  # runs up to the end of the history
    assert lookup_chain([1, 2, 3, 4, 9, 3], 4) == [4, 9, 3]  # no 2-gram match: falls back to the 1-gram 3
    assert lookup_chain([1, 2, 3], 4) == [] and lookup_chain([4], 4) == [] and lookup_chain([1, 1], 0) == []


def test_graft_reuses_shared_nodes():
    tokens, parents = torch.tensor([1, 2, 3]), torch.tensor([0, 0, 1])  # paths 1-3 and 2
    t, p = graft(tokens, parents, [1, 3, 5, 6])  # shares 1-3, then grows 5-6 under node 3
    assert t.tolist() == [1, 2, 3, 5, 6] and p.tolist() == [0, 0, 1, 3, 4]
    t, p = graft(tokens, parents, [4])  # a new first token: a new child of the anchor
    assert t.tolist() == [1, 2, 3, 4] and p.tolist() == [0, 0, 1, 0]
    t, p = graft(tokens, parents, [])
    assert t.tolist() == tokens.tolist() and p.tolist() == parents.tolist()
    path, nxt = verify_tree_greedy(*graft(tokens, parents, [1, 3, 5, 6]), onehot_logits([1, 3, 0, 5, 6, 7])[0])
    assert (path, nxt) == ([1, 3, 4, 5], 7)  # the grafted continuation is accepted through the shared nodes


def test_probs_at_a_vanishing_temperature_is_the_one_hot_limit():
    """The API accepts any temperature in (0, 2]: a tiny one must not turn into NaN probabilities."""
    from adaflash.spec import probs

    logits = torch.tensor([[1.0, 3.0, -2.0], [0.5, 0.4, 0.6]])
    for t in (1e-5, 1e-30, 5e-324):
        p = probs(logits, t)
        assert not p.isnan().any() and torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), 3).float())
    torch.testing.assert_close(probs(logits, 0.7), torch.softmax(logits / 0.7, -1))


def test_greedy_acceptance_on_lists_matches_the_tensor_rule():
    """`accept_greedy_tokens` (the engine's per-request rule over one batched argmax) against `verify_greedy`
    on random drafts and logits, matches and mismatches at every position."""
    from adaflash.spec import accept_greedy_tokens

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        k = int(torch.randint(0, 6, (1,), generator=g))
        logits = torch.randn(1, k + 1, V, generator=g)
        best = logits.argmax(-1)[0]  # [k + 1]
        draft = best[:k].clone()
        if k and bool(torch.rand(1, generator=g) < 0.7):  # a mismatch somewhere
            j = int(torch.randint(0, k, (1,), generator=g))
            draft[j] = (draft[j] + 1) % V
        n, bonus = verify_greedy(draft[None], logits)
        assert accept_greedy_tokens(draft.tolist(), best.tolist()) == (int(n[0]), int(bonus[0]))
