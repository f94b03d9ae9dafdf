"""Target model: matches Hugging Face's reference implementation; cache, padding and rollback."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_target

from adaflash.target import TargetConfig, TargetModel, default_feature_layers, load_target


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_matches_transformers(arch):
    import transformers

    kw = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    if arch == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    else:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw)).eval()
    cfg = TargetConfig.from_hf(hf.config.to_dict())
    ours = TargetModel(cfg, feature_layers=[0, 1])  # HF's last hidden state is post-norm: compare inner layers
    ours.load_state_dict(hf.state_dict(), strict=False)
    ids = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    logits, feats = ours(ids, ours.new_cache(2))
    torch.testing.assert_close(logits, ref.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(feats, torch.cat([ref.hidden_states[1], ref.hidden_states[2]], -1), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_crop_match_full_forward():
    model = tiny_target()
    ids = torch.randint(0, 64, (1, 20))
    full, full_feats = model(ids, model.new_cache(1, capacity=4))  # capacity 4 forces the cache to grow
    cache = model.new_cache(1, capacity=4)
    a, fa = model(ids[:, :7], cache)
    junk, _ = model(torch.randint(0, 64, (1, 5)), cache)  # speculative tokens that get rejected
    cache.crop(7)
    b, fb = model(ids[:, 7:], cache)
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=1e-4, rtol=1e-4)  # fp32 rounding of other shapes
    torch.testing.assert_close(torch.cat([fa, fb], 1), full_feats, atol=1e-4, rtol=1e-4)


def test_left_padded_batch_matches_single_rows():
    model = tiny_target()
    rows = [torch.randint(0, 64, (n,)) for n in (5, 9, 3)]
    width = 9
    ids = torch.zeros(3, width, dtype=torch.long)
    valid = torch.zeros(3, width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = r
        valid[i, width - len(r) :] = True
    cache = model.new_cache(3)
    logits, _ = model(ids, cache, valid=valid, logits_last_only=True)
    step = torch.randint(0, 64, (3, 1))
    logits2, _ = model(step, cache, logits_last_only=True)
    for i, r in enumerate(rows):
        c = model.new_cache(1)
        single, _ = model(r[None], c, logits_last_only=True)
        single2, _ = model(step[i : i + 1], c, logits_last_only=True)
        torch.testing.assert_close(logits[i], single[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits2[i], single2[0], atol=1e-5, rtol=1e-5)
    cache.select_rows(torch.tensor([2, 0]))  # finished rows leave the batch
    logits3, _ = model(step[[2, 0]], cache, logits_last_only=True)
    assert torch.isfinite(logits3).all()


def test_default_feature_layers_spread():
    assert default_feature_layers(36) == [1, 9, 17, 25, 33]  # the Qwen3-8B choice
    assert default_feature_layers(30) == [1, 8, 14, 20, 27]
    assert default_feature_layers(4) == [1]


def test_load_hf_dir_and_errors(tiny_hf_dir, tmp_path):
    t = load_target(str(tiny_hf_dir), "float32")
    ids = t.encode_chat("What is 2+3?")
    assert t.tokenizer.decode(ids).rstrip().endswith("assistant")
    assert t.identity["vocab_size"] == 49152 and len(t.identity["fingerprint"]) == 16
    bf = load_target(str(tiny_hf_dir), "bfloat16")
    assert bf.model.lm_head.weight.dtype == torch.bfloat16
    assert bf.identity == t.identity  # same target in another run dtype: a drafter trained for it still fits
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_target(str(tmp_path), "float32")
    with pytest.raises(ValueError, match="dtype"):
        load_target(str(tiny_hf_dir), "float16")


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_dir):
    from transformers import AutoModelForCausalLM

    t = load_target("smollm2", "float32")
    assert t.identity["num_layers"] == 30 and t.model.feature_layers == [1, 8, 14, 20, 27]
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    ids = torch.tensor([t.encode_chat("Name three primary colours.")])
    with torch.no_grad():
        ref = hf(ids).logits
    logits, _ = t.model(ids, t.model.new_cache())
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)


def prefilled_twice(model, prompts: list[torch.Tensor]) -> tuple[list, list]:
    """Two batch-1 caches per prompt, each prefilled with it: one to test a packed forward on, one for the reference."""
    pairs = []
    for p in prompts:
        pair = [model.new_cache(1, capacity=8) for _ in range(2)]
        for c in pair:
            model(p[None], c)
        pairs.append(pair)
    return [a for a, _ in pairs], [b for _, b in pairs]


def test_packed_ragged_verification_matches_separate_forwards():
    """Verify lengths 3, 16 and 7 packed into one forward give the logits of three separate ones."""
    model = tiny_target(4)
    prompts = [torch.randint(0, 64, (n,)) for n in (6, 11, 4)]
    new = [torch.randint(0, 64, (n,)) for n in (3, 16, 7)]
    packed_caches, ref_caches = prefilled_twice(model, prompts)
    logits, feats = model.forward_packed(new, packed_caches)
    for i, t in enumerate(new):
        ref_logits, ref_feats = model(t[None], ref_caches[i])
        torch.testing.assert_close(logits[i], ref_logits[0], atol=1e-4, rtol=1e-4)  # fp32 rounding
        torch.testing.assert_close(feats[i], ref_feats[0], atol=1e-4, rtol=1e-4)
        assert packed_caches[i].length == ref_caches[i].length
        torch.testing.assert_close(packed_caches[i].k[1][:, :, : ref_caches[i].length], ref_caches[i].k[1][:, :, : ref_caches[i].length])


def test_prompts_and_verify_rows_share_one_forward():
    """The engine prefills new requests in its verify forward: a prompt packed beside other requests'
    verify tokens (logits of its last row only) gives its prefill's last logits and features, and the verify
    rows theirs."""
    from adaflash.target import _segments

    model = tiny_target(4)
    g = torch.Generator().manual_seed(3)
    running = [torch.randint(0, 64, (n,), generator=g) for n in (5, 9)]
    prompts = [torch.randint(0, 64, (n,), generator=g) for n in (12, 7)]
    verify = [torch.randint(0, 64, (n,), generator=g) for n in (4, 2)]
    mixed, ref = prefilled_twice(model, running)
    fresh = [model.new_cache(1, capacity=8) for _ in prompts]
    tokens, caches = [prompts[0], verify[0], prompts[1], verify[1]], [fresh[0], mixed[0], fresh[1], mixed[1]]
    logits, feats = model.forward_packed(tokens, caches, logits_last_only=[True, False, True, False])
    alone = [model.new_cache(1, capacity=8) for _ in prompts]
    pre_logits, pre_feats = model.forward_packed(prompts, alone, logits_last_only=True)
    for i, j in ((0, 0), (2, 1)):  # the prompts
        assert logits[i].shape == (1, model.config.vocab_size)
        torch.testing.assert_close(logits[i], pre_logits[j], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(feats[i], pre_feats[j], atol=1e-4, rtol=1e-4)
    for i, j in ((1, 0), (3, 1)):  # the verify rows
        ref_logits, ref_feats = model(verify[j][None], ref[j])
        torch.testing.assert_close(logits[i], ref_logits[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(feats[i], ref_feats[0], atol=1e-4, rtol=1e-4)
    # the engine's one argmax for the whole step reads `flat`: every request's rows, in order
    assert torch.equal(logits.flat, torch.cat(list(logits))) and logits.flat.shape == (1 + 4 + 1 + 2, model.config.vocab_size)
    assert _segments([12, 4, 7, 2], [True, False, True, False]) == [12, 4, 7, 2]
    assert _segments([3, 30, 2, 50, 4], [False, False, False, True, False]) == [3, 32, 50, 4]  # verify rows in runs of <= 32


@pytest.mark.parametrize("shape", [(1, 576), (2, 576), (1, 3, 576), (3, 576), (1, 4, 576), (2, 5, 576), (1, 16, 576), (0, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
def test_linear_matches_f_linear_packed_or_not(shape, dtype, grad):
    """Inference (no autograd) takes the oneDNN-packed path on CPU, training the plain one; both
    equal F.linear up to rounding, for any leading shape (and no rows)."""
    from adaflash.layers import Linear

    torch.manual_seed(0)
    lin = Linear(576, 200, bias=True).to(dtype)
    x = torch.randn(*shape, dtype=dtype)
    with torch.set_grad_enabled(grad):
        out = lin(x)
    ref = torch.nn.functional.linear(x, lin.weight, lin.bias).detach()
    assert out.shape == ref.shape == (*shape[:-1], 200)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {}
    torch.testing.assert_close(out.detach(), ref, **tol)
    assert out.requires_grad == grad


def test_linear_repacks_after_weight_changes_and_takes_strided_slices():
    """The packed copy must follow the weight (optimizer steps, hot-swap loads) and a batch-strided
    slice (h[:, 1:4] of a block) must give the rows of the full input."""
    from adaflash.layers import Linear, frozen_linear

    torch.manual_seed(0)
    lin = Linear(64, 32, bias=False)
    x = torch.randn(1, 16, 64)
    with torch.no_grad():
        first = lin(x[:, 1:4])
        torch.testing.assert_close(first, lin(x)[:, 1:4], atol=1e-5, rtol=1e-5)
        lin.weight.mul_(2.0)  # in place, as an optimizer step or load_state_dict does
        torch.testing.assert_close(lin(x[:, 1:4]), 2 * first, atol=1e-5, rtol=1e-5)
        lin.load_state_dict({"weight": torch.zeros(32, 64)})
        assert lin(x).abs().max() == 0
    frozen = frozen_linear(torch.randn(32, 64))
    assert not frozen.weight.requires_grad and (frozen.in_features, frozen.out_features) == (64, 32)
    with torch.no_grad():
        torch.testing.assert_close(frozen(x), torch.nn.functional.linear(x, frozen.weight), atol=1e-5, rtol=1e-5)
    assert not any(k.startswith("_pack") for k in lin.state_dict())


def test_tree_forward_matches_chain_forwards_and_keep_continues_a_path():
    """A token tree in one packed forward (each node sees the cache and its ancestors, at position =
    depth), beside a plain request, gives every node the logits a plain forward over its own path gives;
    after `keep` of one path the cache continues exactly like a cache that only ever saw that path."""
    from adaflash.spec import tree_mask

    model = tiny_target(3)
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    tokens = torch.tensor([5, 6, 7, 8, 9, 10])
    parents = torch.tensor([0, 0, 1, 3, 2, 4])  # anchor(11) -> 5 -> 7 -> 8 -> 10; anchor -> 6 -> 9
    cache, other = model.new_cache(1, capacity=8), model.new_cache(1)  # small: the tree forward grows it
    model(prompt, cache)
    model(prompt, other)
    start = cache.length
    inputs = [torch.cat([torch.tensor([11]), tokens]), torch.tensor([11, 5, 7])]
    (logits, chain_logits), (feats, _) = model.forward_packed(inputs, [cache, other], trees=[tree_mask(parents), None])
    paths = {0: [11], 1: [11, 5], 2: [11, 6], 3: [11, 5, 7], 4: [11, 5, 7, 8], 5: [11, 6, 9], 6: [11, 5, 7, 8, 10]}
    for node, path in paths.items():
        ref_cache = model.new_cache(1)
        model(prompt, ref_cache)
        ref, ref_feats = model(torch.tensor([path]), ref_cache)
        torch.testing.assert_close(logits[node], ref[0, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(feats[node], ref_feats[0, -1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chain_logits, logits[[0, 1, 3]], atol=1e-4, rtol=1e-4)  # the plain request: path 11, 5, 7
    cache.keep(start, [0, 1, 3])  # keep anchor, 5, 7
    assert cache.length == start + 3 and int(cache.next_pos[0]) == 12
    nxt, _ = model(torch.tensor([[8, 4]]), cache)
    ref_cache = model.new_cache(1)
    model(prompt, ref_cache)
    ref, _ = model(torch.tensor([[11, 5, 7, 8, 4]]), ref_cache)
    torch.testing.assert_close(nxt[0], ref[0, -2:], atol=1e-4, rtol=1e-4)


def test_a_model_that_ran_on_the_cpu_can_be_copied():
    """CPU inference caches oneDNN-packed weights on the modules, which cannot be copied: deepcopy (how
    tests/test_gpu.py moves a model to CUDA after a CPU reference run) drops them, and the copy rebuilds
    them and decodes the same tokens."""
    import copy
    import pickle

    from conftest import greedy_reference

    from adaflash.layers import InferenceCaches

    target = tiny_target(11)
    ref = greedy_reference(target, [1, 2, 3, 4], 12, [])

    def caches(model):
        return {k for m in model.modules() for k in InferenceCaches._CACHES if k in m.__dict__}

    if not caches(target) - {"_stack", "_stack_params"}:
        pytest.skip("no packed CPU form on this machine (no oneDNN)")
    twin = copy.deepcopy(target)
    assert not caches(twin)
    assert greedy_reference(twin, [1, 2, 3, 4], 12, []) == ref
    assert greedy_reference(pickle.loads(pickle.dumps(target)), [1, 2, 3, 4], 12, []) == ref
