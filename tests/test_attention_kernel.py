"""The row-invariant CPU attention kernel (kernels/attention_cpu.py) against plain PyTorch, and the
property it exists for: a query's result has the same bits alone, inside a causal block, inside a
token tree whose ancestors sit on scattered slots, among other requests, and on 1 or 2 threads."""

from __future__ import annotations

import pytest
import torch
from adaflash.kernels import attention_cpu as A
from conftest import greedy_reference, tiny_drafter, tiny_target

from adaflash.engine import Engine, single_request_engine
from adaflash.layers import Linear
from adaflash.policies import FixedPolicy
from adaflash.request import Request

pytestmark = pytest.mark.skipif(not A.available(), reason="the C++ attention kernel did not build here (no compiler)")


def pools(rows: int, hkv: int, cap: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pk, pv = (torch.randn(rows, hkv, cap, d, generator=g).bfloat16().float() for _ in range(2))
    return pk, pv, torch.zeros(rows, cap, dtype=torch.bool)


def call(q, pk, pv, valid, req, trees=torch.zeros(0, dtype=torch.bool)):
    req = torch.tensor(req, dtype=torch.long).view(-1, 6)
    return A.ragged_attention(q, pk, pv, req, trees, A.context_slots(valid, req))


@pytest.mark.parametrize("d,hq,hkv", [(64, 9, 3), (32, 4, 4), (128, 8, 2)])
def test_kernel_matches_plain_pytorch(d, hq, hkv):
    """Causal blocks, a whole (bidirectional) block and a tree, with invalid slots inside contexts."""
    pk, pv, valid = pools(5, hkv, 96, d)
    valid[0, :40] = True
    valid[2, :73] = True
    valid[2, [3, 17, 50]] = False  # holes: never attended
    valid[3, :10] = True
    valid[4, :31] = True
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
    req = [[0, 23, 17, 0, 0, 0], [2, 70, 3, 17, 1, 0], [3, 5, 5, 20, 2, 0], [4, 30, 1, 25, 0, 0]]
    q = torch.randn(26, hq, d)
    out = call(q, pk, pv, valid, req, tree.flatten())
    ref = A.reference(q, pk, pv, valid, torch.tensor(req), tree.flatten())
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    # bfloat16 K/V (a bf16 model's pool, whose queries are bf16 numbers): in vectors they widen exactly, the bits
    # of their float32 copies; on AMX tiles the scores sum in the tiles' order (within float32 rounding)
    q16 = q.bfloat16().float()
    out16 = call(q16, pk.bfloat16(), pv.bfloat16(), valid, req, tree.flatten())
    if A.amx_scores(pk.bfloat16()):
        ref16 = A.reference(q16, pk, pv, valid, torch.tensor(req), tree.flatten())
        torch.testing.assert_close(out16.double(), ref16, atol=2e-6, rtol=1e-5)
    else:
        assert torch.equal(out16, call(q16, pk, pv, valid, req, tree.flatten()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_has_the_same_bits_in_any_block_tree_batch_or_thread_count(dtype):
    """The token at slot p of row 0 computed alone (plain decoding), as query 5 of a causal block of 9,
    as node 7 of a token tree whose ancestors (nodes 0, 2, 5) sit on scattered slots with other nodes
    between them, next to another request's long block, and on one thread: the same bits every time.
    bfloat16 K/V: the scores on AMX tiles where the CPU has them, else in vectors."""
    d, hq, hkv, p = 64, 9, 3, 61
    pk, pv, valid = pools(3, hkv, 128, d, seed=1)
    pk, pv = pk.to(dtype), pv.to(dtype)
    torch.manual_seed(3)
    randn = lambda *shape: torch.randn(*shape).bfloat16().float()  # noqa: E731 - queries of a bf16 model are bf16 numbers
    valid[0, : p + 1] = True
    valid[1, :100] = True
    q = randn(1, hq, d)
    alone = call(q, pk, pv, valid, [[0, p, 1, 0, 0, 0]])[0]

    block_q = randn(9, hq, d)
    block_q[5] = q[0]
    in_block = call(block_q, pk, pv, valid, [[0, p - 5, 9, 0, 0, 0]])[5]

    a, n, path = p - 3, 8, [0, 2, 5, 7]  # the tree's block starts at slot a; the query is node 7
    tpk, tpv, tvalid = pk.clone(), pv.clone(), valid.clone()
    for src, node in zip(range(a, p + 1), path):  # the K/V plain decoding has on slots a..p, on the path's nodes
        tpk[0, :, a + node], tpv[0, :, a + node] = pk[0, :, src], pv[0, :, src]
    tvalid[0, : a + n] = True
    tree = torch.eye(n, dtype=torch.bool)
    for i, node in enumerate(path):
        tree[node, path[: i + 1]] = True
    tree[[1, 3, 4, 6], 0] = True  # other branches off the root
    tq = randn(n, hq, d)
    tq[7] = q[0]
    in_tree = call(tq, tpk, tpv, tvalid, [[0, a, n, 0, 2, 0]], tree.flatten())[7]

    many_q = torch.cat([randn(40, hq, d), q])
    in_batch = call(many_q, pk, pv, valid, [[1, 60, 40, 0, 0, 0], [0, p, 1, 40, 0, 0]])[40]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = call(q, pk, pv, valid, [[0, p, 1, 0, 0, 0]])[0]
    finally:
        torch.set_num_threads(threads)
    for other in (in_block, in_tree, in_batch, one_thread):
        assert torch.equal(other, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_gives_a_row_the_same_bits_alone_or_among_others(dtype):
    """oneDNN multiplies a single row in another order for some shapes (in_features 1,536 here);
    `Linear` sends it through the multi-row path. On an AMX CPU oneDNN's bfloat16 sums depend on a row's
    place in calls of more than 32 rows; `Linear` splits those (a prefill, a large verify step), or
    multiplies on AMX tiles of its own (kernels/amx_cpu.py), whose rows are their own in any call."""
    torch.manual_seed(0)
    for k, n in ((576, 576), (1536, 576), (576, 4096)):
        lin = Linear(k, n, bias=False).to(dtype)
        x = torch.randn(100, k).to(dtype)
        with torch.no_grad():
            together = lin(x)
            for rows in (1, 2, 3, 4, 7, 33, 40, 99):
                for i in range(0, 100 - rows, rows):
                    assert torch.equal(lin(x[i : i + rows]), together[i : i + rows]), (k, n, rows, i)


def test_greedy_speculation_equals_plain_decoding_bit_for_bit_in_bf16():
    """A bfloat16 target rounds every layer to 8 bits, so any last bit that depends on the verify block
    shows; with the kernel and row-invariant projections chains, trees and a concurrent batch equal plain
    decoding. (With ADAFLASH_ATTENTION=torch, 2 of these 6 bfloat16 chains differed on the AVX-512 machine.)"""
    target = tiny_target(6, vocab=512, layers=4, std=0.2, head_dim=32).to(torch.bfloat16)
    drafter = tiny_drafter(target, 2).to(torch.bfloat16)
    torch.manual_seed(6)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (7, 12, 5, 9, 14, 6)]
    refs = [greedy_reference(target, p, 32, []) for p in prompts]
    for kw in ({"verify_len": 5}, {"tree": 6}):
        assert [single_request_engine(target, drafter, [], **kw).generate(p, 32).out for p in prompts] == refs
    reqs = [Request(f"r{i}", p, 32) for i, p in enumerate(prompts)]
    states = Engine(target, drafter, FixedPolicy(4), eos_ids=[], max_batch=4).run(reqs)
    assert [s.out for s in states] == refs


def test_ragged_forward_gives_each_request_the_bits_it_gets_alone():
    """Pooled requests on scattered rows (one row freed), a prefill, plain steps and verify blocks in one
    forward: each request's logits equal, bit for bit, its own forward on a plain batch-1 cache."""
    target = tiny_target(3, head_dim=32)
    pooled = [target.new_cache(1, 8) for _ in range(5)]
    del pooled[1]
    refs = [target.new_cache(1, 64) for _ in pooled]
    prompts = [torch.randint(0, 64, (n,)) for n in (6, 11, 4, 9)]
    target.forward_packed(prompts, pooled, logits_last_only=True)
    for p, c in zip(prompts, refs):
        target(p[None], c)
    for new_lens in ((3, 16, 1, 7), (1, 1, 1, 1), (30, 2, 1, 5)):
        new = [torch.randint(0, 64, (n,)) for n in new_lens]
        for c, n in zip(pooled, new_lens):
            c.reserve(n)
        logits, _ = target.forward_packed(new, pooled)
        for i, t in enumerate(new):
            ref, _ = target(t[None], refs[i])
            assert torch.equal(logits[i], ref[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_projections_are_the_separate_ones_and_follow_weight_changes(dtype):
    """q/k/v (and gate/up) of one input in one matmul: the separate calls' values, rebuilt when a weight
    changes, not used with autograd on; `prepack` packs the fused form instead of its members."""
    from adaflash.layers import MLP, PACKED_DTYPES, Attention, fused, prepack

    if dtype not in PACKED_DTYPES:  # e.g. bfloat16 on an AVX2-only CPU: no packed form, the modules run one by one
        pytest.skip(f"oneDNN has no packed {dtype} weights on this CPU")
    torch.manual_seed(0)
    attn, mlp = Attention(64, 4, 2, 16, False, 1e-6).to(dtype), MLP(64, 128).to(dtype)
    group = (attn.q_proj, attn.k_proj, attn.v_proj)
    x = torch.randn(1, 5, 64).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    with torch.no_grad():
        torch.testing.assert_close(fused(attn, group, x), torch.cat([m(x) for m in group], -1), **tol)
        attn.k_proj.weight.mul_(2)  # a weight update (optimizer step, load) bumps its version
        torch.testing.assert_close(fused(attn, group, x)[..., 64:96], attn.k_proj(x), **tol)
        prepack(attn, mlp)
        assert "_fused" in mlp.__dict__ and "_pack" not in mlp.gate_proj.__dict__ and "_pack" in mlp.down_proj.__dict__
    assert fused(attn, group, x) is None  # autograd on: the separate modules (training)


def test_prompt_rows_give_a_prompt_its_own_bits_wherever_it_is_packed():
    """A prefill packs several prompts into one call; inside `prompt_rows` each prompt's bf16 rows go in one
    call of their own, so a prompt gets the bits it gets alone, in any company (AMX or not)."""
    from adaflash.layers import prompt_rows

    torch.manual_seed(0)
    lin = Linear(576, 576, bias=False).to(torch.bfloat16)
    x = torch.randn(130, 576).to(torch.bfloat16)
    with torch.no_grad():
        with prompt_rows([40, 1, 89]):
            packed = lin(x)
        for a, b in ((0, 40), (40, 41), (41, 130)):
            with prompt_rows([b - a]):
                assert torch.equal(lin(x[a:b]), packed[a:b]), (a, b)
        with prompt_rows([50]):  # rows that are not exactly the prompts': the 32-row calls
            assert torch.equal(lin(x[:60]), torch.cat([lin(x[:32]), lin(x[32:60])]))
