"""AdaFlash length head: shapes, detached input, verify length, label rule, save/load, offline fit (tiny, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from adaflash.length_head import (
    META,
    WEIGHTS,
    LengthHead,
    LengthHeadConfig,
    fit_length_head,
    label,
    load_length_head,
    save_length_head,
    verify_length,
)
from adaflash.losses import length_head_loss
from adaflash.spec import accepted_length

H, K = 16, 6


def make_head(seed: int = 0, **kw) -> LengthHead:
    torch.manual_seed(seed)
    return LengthHead(LengthHeadConfig(hidden_size=H, inner=kw.pop("inner", 32), **kw))


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(hidden_size=0), "hidden_size"),
        (dict(hidden_size=H, inner=0), "inner"),
        (dict(hidden_size=H, block_size=1), "block_size"),
        (dict(hidden_size=H, min_len=0), "min_len"),
        (dict(hidden_size=H, block_size=4, min_len=5), "min_len"),
        (dict(hidden_size=H, rate=0.0), "rate"),
        (dict(hidden_size=H, rate=float("inf")), "rate"),
        (dict(hidden_size=16.0), "hidden_size"),
    ],
)
def test_config_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        LengthHeadConfig(**kw)


def test_config_defaults():
    c = LengthHeadConfig(hidden_size=H)
    assert (c.inner, c.block_size, c.rate, c.min_len) == (256, 16, 1.3, 2)


# ----------------------------------------------------------------------------- forward
def test_output_shape_and_range():
    head = make_head()
    h = torch.randn(5, K, H) * 10  # large inputs still land strictly inside (0, 1)
    p = head(h)
    assert p.shape == (5,)
    assert p.dtype == torch.float32
    assert bool(((p > 0) & (p < 1)).all())
    # features = concat(mean over block, last position)
    f = LengthHead.features(h)
    assert f.shape == (5, 2 * H)
    torch.testing.assert_close(f, torch.cat([h.mean(1), h[:, -1]], -1))
    # bf16 drafter states are accepted
    assert head(h.bfloat16()).shape == (5,)


def test_forward_rejects_bad_shapes():
    head = make_head()
    with pytest.raises(ValueError, match="hidden size"):
        head(torch.randn(2, K, H + 1))
    with pytest.raises(ValueError, match=r"\[B, K, H\]"):
        head(torch.randn(2, H))


def test_no_gradient_reaches_drafter_states():
    head = make_head()
    h = torch.randn(4, K, H, requires_grad=True)
    loss = length_head_loss(head(h), torch.tensor([0, 3, 5, 15]), 16)
    loss.backward()
    assert h.grad is None
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in head.parameters())


# ----------------------------------------------------------------------------- label / verify length
def test_label_rule():
    acc = torch.tensor([0, 1, 7, 15, 20])
    torch.testing.assert_close(label(acc, 16), torch.tensor([1 / 16, 2 / 16, 8 / 16, 1.0, 1.0]))
    # accepted computed from verification
    draft = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [9, 2, 3, 4]])
    target = torch.tensor([[1, 2, 3, 5], [1, 2, 3, 4], [1, 2, 3, 4]])
    torch.testing.assert_close(label(accepted_length(draft, target), 4), torch.tensor([1.0, 0.5, 0.25]))
    with pytest.raises(ValueError):
        label(acc, 0)


def test_label_matches_loss():
    """losses.length_head_loss regresses against exactly ``label``."""
    pred = torch.rand(7)
    acc = torch.tensor([0, 2, 4, 6, 15, 16, 30])
    ref = ((pred - label(acc, 16)) ** 2).mean()
    torch.testing.assert_close(length_head_loss(pred, acc, 16), ref)


def test_verify_length_examples():
    pred = torch.tensor([0.0, 0.05, 0.2, 0.5, 0.7, 0.77, 0.9, 1.0])
    # pred * 16 * 1.3 = 0, 1.04, 4.16, 10.4, 14.56, 16.016, 18.72, 20.8
    out = verify_length(pred, block_size=16, rate=1.3, min_len=2)
    assert out.dtype == torch.int64
    assert out.tolist() == [2, 2, 4, 10, 15, 16, 16, 16]  # clamped low to min_len, high to block_size
    assert verify_length(torch.tensor([0.5]), 16, 1.0, 2).tolist() == [8]
    assert verify_length(torch.tensor([0.1]), 16, 1.0, 4).tolist() == [4]  # min_len clamp
    assert verify_length(torch.tensor([float("nan")]), 16, 1.3, 2).tolist() == [16]
    with pytest.raises(ValueError, match="min_len"):
        verify_length(pred, 16, 1.3, 17)
    with pytest.raises(ValueError, match="rate"):
        verify_length(pred, 16, -1.0, 2)


def test_head_verify_length_uses_config():
    head = make_head(block_size=8, rate=1.0, min_len=3)
    v = head.verify_length(torch.randn(6, K, H))
    assert v.shape == (6,) and bool(((v >= 3) & (v <= 8)).all())


# ----------------------------------------------------------------------------- save / load
def test_save_load_round_trip(tmp_path):
    head = make_head(block_size=12, rate=1.2, min_len=3).eval()
    save_length_head(head, tmp_path, metrics={"mae": 0.1, "pearson": float("nan"), "n_val": 3})
    assert (tmp_path / WEIGHTS).exists() and (tmp_path / META).exists()
    meta = json.loads((tmp_path / META).read_text())
    assert meta["config"]["block_size"] == 12 and meta["metrics"]["mae"] == 0.1
    assert meta["metrics"]["pearson"] is None  # non-finite metrics are stored as null (valid JSON)

    loaded = load_length_head(tmp_path)
    assert loaded.config == head.config and not loaded.training
    assert loaded.metrics["n_val"] == 3
    h = torch.randn(4, K, H)
    with torch.no_grad():
        torch.testing.assert_close(loaded(h), head(h), rtol=0, atol=0)
    assert load_length_head(tmp_path, hidden_size=H).config.hidden_size == H


def test_load_refuses_hidden_size_mismatch(tmp_path):
    save_length_head(make_head(), tmp_path)
    with pytest.raises(ValueError, match="hidden_size"):
        load_length_head(tmp_path, hidden_size=H * 2)
    # a drafter config in the same directory is checked too
    (tmp_path / "config.json").write_text(json.dumps({"architecture": "DFlashDrafter", "hidden_size": 64}))
    with pytest.raises(ValueError, match="drafter config"):
        load_length_head(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architecture": "DFlashDrafter", "hidden_size": H}))
    assert isinstance(load_length_head(tmp_path), LengthHead)


def test_load_refuses_non_finite_and_bad_files(tmp_path):
    save_length_head(make_head(), tmp_path)
    state = load_file(str(tmp_path / WEIGHTS))
    state["res.weight"][0, 0] = float("nan")
    save_file(state, str(tmp_path / WEIGHTS))
    with pytest.raises(ValueError, match="non-finite"):
        load_length_head(tmp_path)

    # weights that do not fit the stored config
    save_length_head(make_head(), tmp_path)
    meta = json.loads((tmp_path / META).read_text())
    meta["config"]["inner"] = 8
    (tmp_path / META).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="do not match"):
        load_length_head(tmp_path)

    meta["architecture"] = "Other"
    (tmp_path / META).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not an AdaFlash length head"):
        load_length_head(tmp_path)

    with pytest.raises(FileNotFoundError):
        load_length_head(tmp_path / "missing")


# ----------------------------------------------------------------------------- offline fit
def synthetic(n: int = 512, seed: int = 0):
    """Accepted lengths from a linear function of the block mean features, plus noise."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(n, K, H, generator=g)  # [N, K, H]
    w = torch.randn(H, generator=g)
    z = feats.mean(1) @ w  # [N]
    z = (z - z.mean()) / z.std()
    accepted = (7.0 + 4.5 * z + 0.7 * torch.randn(n, generator=g)).round().clamp(0, 15).long()  # [N]
    return feats, accepted


def test_fit_learns_synthetic_task():
    feats, accepted = synthetic()
    head = make_head(seed=1)
    m = fit_length_head(head, feats, accepted, block_size=16, lr=1e-2, epochs=40, batch_size=64, seed=0)
    assert (m["n_train"], m["n_val"]) == (410, 102)
    assert m["mae"] < 0.5 * m["baseline_mae"], m
    assert m["pearson"] > 0.8, m
    assert not head.training

    # deterministic: same seeds -> identical metrics
    m2 = fit_length_head(make_head(seed=1), feats, accepted, block_size=16, lr=1e-2, epochs=40, batch_size=64, seed=0)
    assert m2 == m


def test_fit_validates_inputs():
    feats, accepted = synthetic(n=8)
    head = make_head()
    with pytest.raises(ValueError, match="feats"):
        fit_length_head(head, feats[..., :-1], accepted)
    with pytest.raises(ValueError, match="accepted"):
        fit_length_head(head, feats, accepted[:-1])
    with pytest.raises(ValueError, match="val_frac"):
        fit_length_head(head, feats, accepted, val_frac=1.0)
    m = fit_length_head(head, feats, accepted, epochs=1, batch_size=4)
    assert m["n_train"] + m["n_val"] == 8 and m["n_val"] >= 1
