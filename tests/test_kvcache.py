"""The KV pool (rows handed out, freed, grown) and ragged attention over it against per-request references."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import tiny_drafter, tiny_target

from adaflash.kvcache import KVCache, KVPool, Ragged, kv_dtype


def plain_cache(model, capacity: int = 8) -> KVCache:
    """A batch-1 cache outside any pool: the reference layout."""
    c = model.config
    return KVCache(c.num_layers, 1, c.num_kv_heads, c.head_dim, next(model.parameters()).dtype, capacity)


def test_pool_hands_out_the_lowest_free_row_and_takes_it_back():
    pool = KVPool(2, 1, 4, torch.float32, "cpu")
    a, b, c = (pool.take(10) for _ in range(3))
    assert [a.slot, b.slot, c.slot] == [0, 1, 2] and pool.capacity == 64
    a.append(torch.ones(1, 3, dtype=torch.bool))
    del b
    gc.collect()
    d = pool.take(5)
    assert d.slot == 1 and d.length == 0 and not d.valid.any() and int(d.next_pos) == 0  # a clean row
    del a, c, d
    gc.collect()
    assert pool.rows == 0 and not pool.live  # an empty pool holds no K/V


def test_pool_growth_keeps_contents_and_rebinds_live_caches():
    pool = KVPool(2, 1, 4, torch.float32, "cpu")
    a = pool.take(4)
    a.append(torch.ones(1, 2, dtype=torch.bool))
    a.k[1][:, :, :2] = 7.0
    others = [pool.take(4) for _ in range(5)]  # rows 1, 2, 4 (doubling)
    a.reserve(100)  # capacity 64 -> 128: every row grows
    assert pool.rows == 8 and pool.capacity >= 102
    assert (a.k[1][:, :, :2] == 7.0).all() and a.length == 2 and int(a.next_pos) == 2
    a.k[0][0, 0, 5] = 3.0  # a view of the new tensors
    assert pool.k[0][a.slot, 0, 5].eq(3.0).all()
    assert all(o.k[0].data_ptr() == pool.k[0][o.slot].data_ptr() for o in others)
    with pytest.raises(ValueError, match="pooled"):
        a.select_rows(torch.tensor([0]))


def test_pool_capacity_grows_geometrically_for_rising_request_lengths(monkeypatch):
    """Requests each a little longer than the last: every resize copies all rows, so the capacity grows by
    at least half each time (a handful of copies), not to each new length (one copy per request)."""
    pool = KVPool(2, 1, 4, torch.float32, "cpu")
    resizes = []
    real = pool._resize
    monkeypatch.setattr(pool, "_resize", lambda rows, cap: (real(rows, cap), resizes.append(pool.capacity)))
    caches = [pool.take(100 + 10 * i) for i in range(64)]  # 100 .. 730 tokens
    capacities = sorted(set(resizes))  # the rows doubling (1 .. 64) resizes too, at the capacity it has
    assert pool.capacity >= 730 and len(capacities) <= 5, capacities  # to each length: 128, 192, .., 768 (11)
    assert all(c.capacity == pool.capacity for c in caches)


def test_lazy_pool_is_read_only_where_written_and_settles_before_pytorch_attention(monkeypatch):
    """A pool the C++ kernel reads is allocated uninitialised (`torch.empty`: pages are faulted in as they are
    written, not all at once in a resize), takes the engine's max batch of rows at once and grows its capacity
    x2. Poisoned with NaN wherever no cache wrote, the kernel's forward still matches plain caches; before
    PyTorch's attention (which reads padding slots too) reads it, `settle` zeroes those slots."""
    from adaflash.kernels import attention_cpu

    if not attention_cpu.available():
        pytest.skip("the C++ attention kernel did not build here")
    model = tiny_target(4, head_dim=32)
    pool = model.new_pool(rows=6)
    caches = [pool.take(8) for _ in range(3)]
    refs = [plain_cache(model, 160) for _ in caches]
    assert pool.lazy and pool.rows == 6 and pool.capacity == 64  # no doubling from one row

    def poison():  # what uninitialised memory may hold, wherever no live cache wrote
        for t in pool.k + pool.v:
            t[3:] = float("nan")
            for c in caches:
                t[c.slot, :, c.length :] = float("nan")

    def step(lens):  # one forward of new tokens on the pool against the same on plain caches
        new = [torch.randint(0, 64, (n,)) for n in lens]
        logits, feats = model.forward_packed(new, caches)
        for t, ref, lg, ft in zip(new, refs, logits, feats):
            ref_logits, ref_feats = model(t[None], ref)
            torch.testing.assert_close(lg, ref_logits[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(ft, ref_feats[0], atol=1e-4, rtol=1e-4)

    poison()
    step((5, 7, 3))
    caches[1].reserve(100)  # 64 -> 128 (x2, not to the 112 asked for), copying what the caches wrote
    assert pool.capacity == 128 and all(c.k[0].data_ptr() == pool.k[0][c.slot].data_ptr() for c in caches)
    poison()
    step((2, 9, 1))
    monkeypatch.setenv("ADAFLASH_ATTENTION", "torch")  # PyTorch's attention from here on
    step((4, 1, 2))
    assert not pool.lazy and not any(t.isnan().any() for t in pool.k + pool.v)


@pytest.mark.parametrize(
    "prompt_lens,new_lens,call",
    [
        ((6, 11, 4, 9), (3, 16, 1, 7), Ragged.CALL),
        ((5, 2, 3, 4, 5, 6, 7, 8), (200, 1, 2, 1, 3, 1, 1, 4), Ragged.CALL),
        ((6, 11, 4, 9), (3, 16, 1, 7), 0),
    ],
)
def test_ragged_forward_matches_separate_forwards_with_gaps_between_rows(prompt_lens, new_lens, call, monkeypatch):
    """Requests on rows 0, 2, 3, ... (row 1 was freed: the view spans a row outside the batch), one
    forward for all, against each request alone on its own plain cache; the long request's queries
    past the others' attend on their own (second case), every request does when calls are free (third)."""
    monkeypatch.setattr(Ragged, "CALL", call)
    model = tiny_target(4)
    pooled = [model.new_cache(1, 8) for _ in range(len(prompt_lens) + 1)]
    del pooled[1]
    refs = [plain_cache(model) for _ in prompt_lens]
    prompts = [torch.randint(0, 64, (n,)) for n in prompt_lens]
    model.forward_packed(prompts, pooled, logits_last_only=True)
    for p, c in zip(prompts, refs):
        model(p[None], c)
    new = [torch.randint(0, 64, (n,)) for n in new_lens]
    for c, n in zip(pooled, new_lens):
        c.reserve(n)
    head = Ragged(pooled, [c.length for c in pooled], list(new_lens)).head
    assert head < 200 and (head == 0 or call > 0)
    logits, feats = model.forward_packed(new, pooled)
    for i, t in enumerate(new):
        ref_logits, ref_feats = model(t[None], refs[i])
        torch.testing.assert_close(logits[i], ref_logits[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(feats[i], ref_feats[0], atol=1e-4, rtol=1e-4)


def test_ragged_draft_matches_single_request_drafts_on_scattered_rows():
    target = tiny_target(3)
    drafter = tiny_drafter(target, 4)
    seqs = [torch.randint(0, 64, (1, n)) for n in (5, 9, 3)]
    feats = [target(s, plain_cache(target))[1] for s in seqs]
    caches = [drafter.new_cache(1, 2) for _ in range(5)]
    caches = [caches[0], caches[2], caches[4]]  # rows 1 and 3 freed
    gc.collect()
    single = [plain_cache(drafter) for _ in seqs]
    drafter.extend_many([f[0, :-1] for f in feats], caches)
    for f, c in zip(feats, single):
        drafter.extend_context(f[:, :-1], c)
    last = torch.stack([s[0, -1] for s in seqs])
    h = drafter.draft_many(caches, last)
    assert [c.length for c in caches] == [4, 8, 2]  # the scratch block is not appended
    for i, c in enumerate(single):
        _, ref_h = drafter.draft(c, last[i : i + 1])
        torch.testing.assert_close(h[i], ref_h[0], atol=1e-4, rtol=1e-4)


def test_caches_of_two_models_do_not_mix():
    a, b = tiny_target(1), tiny_target(2)
    with pytest.raises(ValueError, match="pool"):
        Ragged([a.new_cache(1), b.new_cache(1)], [0, 0], [1, 1])


@pytest.mark.parametrize("head_dim", [16, 32])
def test_bf16_models_kv_dtype_on_a_cpu(head_dim):
    """A bf16 model keeps bf16 K/V on a CPU where the row-invariant kernel attends (head dims 32/64/128:
    it widens them exactly), float32 where PyTorch's attention would convert them every layer (head dim
    16 here); a bf16 target's ragged forward still matches its forward on a plain cache, and a bf16
    drafter drafts from the same pool dtype."""
    from adaflash.kernels import attention_cpu

    kernel = head_dim == 32 and attention_cpu.available()
    expected = torch.bfloat16 if kernel else torch.float32
    assert kv_dtype(torch.bfloat16, "cpu", head_dim) == expected and kv_dtype(torch.float32, "cpu", head_dim) == torch.float32
    assert kv_dtype(torch.bfloat16, "cuda", head_dim) == torch.bfloat16 and kv_dtype(torch.float16, "cpu", 32) == torch.float32
    model = tiny_target(4, head_dim=head_dim).to(torch.bfloat16)
    drafter = tiny_drafter(model).to(torch.bfloat16)
    pooled, ref = model.new_cache(1, 8), model.new_cache(2, 32)
    assert pooled.k[0].dtype == ref.k[0].dtype == expected
    assert drafter.new_cache(1, 8).k[0].dtype == kv_dtype(torch.bfloat16, "cpu", drafter.config.head_dim)
    prompt = torch.randint(0, 64, (7,))
    model.forward_packed([prompt], [pooled], logits_last_only=True)
    model(prompt[None].expand(2, -1), ref)
    new = torch.randint(0, 64, (3,))
    (logits,), (feats,) = model.forward_packed([new], [pooled])
    ref_logits, ref_feats = model(new[None].expand(2, -1), ref)
    assert feats.dtype == torch.bfloat16
    torch.testing.assert_close(logits, ref_logits[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(feats, ref_feats[0], atol=2e-2, rtol=2e-2)


def test_a_model_keeps_one_pool_until_it_moves():
    """Caches made outside an engine share the model's pool; a model moved to another dtype gets a new one."""
    model = tiny_target(4)
    first = model.new_cache(1, 8).pool
    assert model.new_cache(1, 8).pool is first and first.dtype == torch.float32
    model.to(torch.float64)
    moved = model.new_cache(1, 8).pool
    assert moved is not first and moved.dtype == torch.float64 and model.new_cache(1, 8).pool is moved
