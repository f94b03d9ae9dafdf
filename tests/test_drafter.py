"""Drafter: the training forward (many masked blocks) equals the inference path block by block;
save/load round trip; mismatched or broken checkpoints are refused."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from safetensors.torch import load_file, save_file

from adaflash.drafter import load_drafter
from adaflash.target import fingerprint


def test_training_forward_matches_inference_blocks():
    target = tiny_target(1)
    drafter = tiny_drafter(target, 2)
    for p in drafter.parameters():  # a non-trivial drafter (random, larger weights)
        torch.nn.init.normal_(p, std=0.2)
    tokens = torch.randint(0, 64, (2, 30))
    lengths = torch.tensor([30, 22])  # row 1 is right padded
    _, feats = target(tokens, target.new_cache(2))
    anchors = torch.tensor([[3, 17, 28], [5, 20, -1]])
    with torch.no_grad():
        h_train = drafter(feats, tokens, anchors, lengths)  # [2, 3, K-1, H]
    for b in range(2):
        for j, a in enumerate(anchors[b].tolist()):
            if a < 0:
                continue
            cache = drafter.new_cache(1)
            drafter.extend_context(feats[b : b + 1, :a], cache)  # context strictly before the anchor
            _, h_inf = drafter.draft(cache, tokens[b, a : a + 1])
            torch.testing.assert_close(h_train[b, j], h_inf[0, 1:], atol=1e-4, rtol=1e-4)


def test_context_added_in_pieces_equals_at_once():
    target = tiny_target(2)
    drafter = tiny_drafter(target, 3)
    tokens = torch.randint(0, 64, (1, 12))
    _, feats = target(tokens, target.new_cache(1))
    c1, c2 = drafter.new_cache(1, capacity=2), drafter.new_cache(1)
    drafter.extend_context(feats[:, :4], c1)
    drafter.extend_context(feats[:, 4:11], c1)
    drafter.extend_context(feats[:, :11], c2)
    l1, _ = drafter.draft(c1, tokens[:, 11])
    l2, _ = drafter.draft(c2, tokens[:, 11])
    torch.testing.assert_close(l1, l2, atol=1e-5, rtol=1e-5)


def test_save_load_round_trip_and_refusals(tmp_path):
    target = tiny_target(0)
    identity = {"name": "tiny", "fingerprint": fingerprint(target), "vocab_size": 64, "hidden_size": 64, "num_layers": 4}
    drafter = tiny_drafter(target, 0)
    drafter.config.target = identity
    out = drafter.save(tmp_path / "d", dtype=torch.float32)
    meta = json.loads((out / "config.json").read_text())
    assert meta["block_size"] == 6 and meta["target_layer_ids"] == [0, 2] and meta["mask"] == "learned"
    assert meta["target"]["fingerprint"] == identity["fingerprint"]
    assert not any(k.startswith(("embed", "lm_head")) for k in load_file(str(out / "model.safetensors")))

    loaded = load_drafter(out, target, identity)
    tokens = torch.randint(0, 64, (1, 8))
    _, feats = target(tokens, target.new_cache(1))
    c1, c2 = drafter.new_cache(1), loaded.new_cache(1)
    drafter.extend_context(feats[:, :7], c1)
    loaded.extend_context(feats[:, :7], c2)
    torch.testing.assert_close(drafter.draft(c1, tokens[:, 7])[0], loaded.draft(c2, tokens[:, 7])[0])

    other = dict(identity, fingerprint="0" * 16)
    with pytest.raises(ValueError, match="trained for target"):
        load_drafter(out, target, other)

    state = load_file(str(out / "model.safetensors"))
    state["fc.weight"][0, 0] = float("nan")
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="non-finite"):
        load_drafter(out, target, identity)

    drafter.save(tmp_path / "e", dtype=torch.float32)
    meta = json.loads((tmp_path / "e" / "config.json").read_text())
    meta["num_layers"] = 3  # weights hold 2 layers: a shape mismatch must not load
    (tmp_path / "e" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(RuntimeError, match="Missing key"):
        load_drafter(tmp_path / "e", target, identity)
    with pytest.raises(FileNotFoundError, match="not a drafter directory"):
        load_drafter(tmp_path / "missing", target, identity)


def test_ragged_batch_methods_match_single_request_ones():
    target = tiny_target(3)
    drafter = tiny_drafter(target, 4)
    seqs = [torch.randint(0, 64, (1, n)) for n in (5, 9, 3)]
    feats = [target(s, target.new_cache(1))[1] for s in seqs]
    many = [drafter.new_cache(1, capacity=2) for _ in seqs]
    single = [drafter.new_cache(1) for _ in seqs]
    drafter.extend_many([f[0, :-1] for f in feats], many)
    for f, c in zip(feats, single):
        drafter.extend_context(f[:, :-1], c)
    last = torch.stack([s[0, -1] for s in seqs])
    h = drafter.draft_many(many, last)
    logits = drafter.logits(h[:, 1:])
    for i, c in enumerate(single):
        ref_logits, ref_h = drafter.draft(c, last[i : i + 1])
        torch.testing.assert_close(logits[i], ref_logits[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(h[i], ref_h[0], atol=1e-4, rtol=1e-4)


def test_truncated_ragged_block_matches_a_drafter_with_that_block_size():
    """draft_many(length=L) drafts [anchor, MASK x (L-1)]: the same states as the single-request
    path of a drafter whose block is L (same weights), and length=K is the full block."""
    target = tiny_target(3)
    drafter = tiny_drafter(target, 4)
    seqs = [torch.randint(0, 64, (1, n)) for n in (6, 2, 11)]
    feats = [target(s, target.new_cache(1))[1] for s in seqs]
    caches = [drafter.new_cache(1) for _ in seqs]
    drafter.extend_many([f[0, :-1] for f in feats], caches)
    last = torch.stack([s[0, -1] for s in seqs])
    full = drafter.draft_many(caches, last)
    torch.testing.assert_close(drafter.draft_many(caches, last, drafter.block_size), full)
    h = drafter.draft_many(caches, last, 3)  # [R, 3, H]
    assert h.shape == (3, 3, full.shape[-1])
    drafter.config.block_size = 3  # the same weights as a drafter trained with blocks of 3
    for i, c in enumerate(caches):
        _, ref = drafter.draft(c, last[i : i + 1])
        torch.testing.assert_close(h[i], ref[0], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(h[:, :3], full[:, :3], atol=1e-4)  # the masks beyond the block do matter a little
