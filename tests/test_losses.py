"""OPD / OSD / length-head losses against plain reference implementations (tiny shapes, CPU, fp32/fp64)."""

from __future__ import annotations

import math

import pytest
import torch

from adaflash.losses import (
    ce_loss,
    length_head_loss,
    opd_loss,
    opd_row_terms,
    osd_loss,
    position_weights,
)
from adaflash.spec import accepted_length

# fp32 computation compared with fp64 references
TOL = dict(rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- references
def ref_log_softmax(z: torch.Tensor) -> torch.Tensor:
    """Row vector [V] -> log softmax, written out."""
    m = z.max()
    return z - m - torch.log(torch.exp(z - m).sum())


def ref_row(zd, zt, temperature, clip, clip_mode):
    """One position: (hard, rkl) as plain formulas. zd, zt: [V]."""
    zt = zt.detach()
    top = int(torch.argmax(zt))
    hard = -ref_log_softmax(zd)[top]
    lpd = ref_log_softmax(zd / temperature)
    lpt = ref_log_softmax(zt / temperature)
    rkl = zd.new_zeros(())
    for v in range(zd.shape[0]):
        term = torch.exp(lpd[v]) * (lpd[v] - lpt[v])
        if clip is not None and clip_mode == "vocab":
            term = torch.clamp(term, max=clip)
        rkl = rkl + term
    if clip is not None and clip_mode == "token":
        rkl = torch.clamp(rkl, max=clip)
    return hard, rkl


def ref_opd(draft, target, valid, alpha=0.8, temperature=1.0, clip=1.0, clip_mode="vocab", gamma=7.0):
    n_blocks, block, _ = draft.shape
    num_h = num_r = den = 0.0
    for n in range(n_blocks):
        for k in range(block):
            if not bool(valid[n, k]):
                continue
            w = math.exp(-k / gamma)  # position k+1 in the block
            h, r = ref_row(draft[n, k], target[n, k], temperature, clip, clip_mode)
            num_h = num_h + w * h
            num_r = num_r + w * r
            den += w
    hard, rkl = num_h / den, num_r / den
    return alpha * hard + (1 - alpha) * rkl, hard, rkl


def ref_osd(draft, target, valid, temperature=1.0, gamma=7.0):
    num = den = 0.0
    for n in range(draft.shape[0]):
        for k in range(draft.shape[1]):
            if not bool(valid[n, k]):
                continue
            w = math.exp(-k / gamma)
            lpd = ref_log_softmax(draft[n, k] / temperature)
            lpt = ref_log_softmax(target[n, k].detach() / temperature)
            num = num + w * (torch.exp(lpt) * (lpt - lpd)).sum()
            den += w
    return num / den


def make_inputs(n=2, k=4, v=11, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    draft = (torch.randn(n, k, v, generator=g) * scale).requires_grad_()
    target = torch.randn(n, k, v, generator=g) * scale
    valid = torch.ones(n, k, dtype=torch.bool)
    valid[0, -1] = False
    valid[1, 2:] = False
    return draft, target, valid


# ----------------------------------------------------------------------------- tests
def test_position_weights():
    w = position_weights(5, gamma=7.0)
    assert w.shape == (5,) and w.dtype == torch.float32
    torch.testing.assert_close(w, torch.tensor([math.exp(-i / 7.0) for i in range(5)]))
    assert w[0].item() == 1.0
    torch.testing.assert_close(position_weights(3, gamma=1.0), torch.tensor([1.0, math.exp(-1), math.exp(-2)]))


@pytest.mark.parametrize(
    "temperature,clip,clip_mode",
    [(1.0, 1.0, "vocab"), (1.0, 0.05, "vocab"), (0.5, 0.05, "vocab"), (2.0, None, "vocab"), (1.0, 4.0, "token"), (2.0, 1.5, "token")],
)
def test_opd_loss_matches_reference(temperature, clip, clip_mode):
    draft, target, valid = make_inputs()
    if clip is not None:  # the data must exercise both clipped and unclipped terms / rows
        lpd = torch.log_softmax(draft.detach() / temperature, -1)
        terms = lpd.exp() * (lpd - torch.log_softmax(target / temperature, -1))  # [N, K, V]
        x = terms[valid] if clip_mode == "vocab" else terms.sum(-1)[valid]
        assert (x > clip).any() and (x < clip).any()
    target.requires_grad_()  # must not receive a gradient
    out = opd_loss(draft, target, valid, alpha=0.6, temperature=temperature, clip=clip, clip_mode=clip_mode, backend="torch")
    d64 = draft.detach().double().requires_grad_()
    ref_loss, ref_hard, ref_rkl = ref_opd(d64, target.detach().double(), valid, 0.6, temperature, clip, clip_mode)

    torch.testing.assert_close(out["loss"].double(), ref_loss, **TOL)
    torch.testing.assert_close(out["hard"].double(), ref_hard, **TOL)
    torch.testing.assert_close(out["rkl"].double(), ref_rkl, **TOL)
    assert not out["hard"].requires_grad and not out["rkl"].requires_grad

    (g,) = torch.autograd.grad(out["loss"], draft, retain_graph=True)
    (g_ref,) = torch.autograd.grad(ref_loss, d64)
    torch.testing.assert_close(g.double(), g_ref, **TOL)
    # invalid positions get exactly zero gradient; the target gets none at all
    assert torch.all(g[~valid] == 0)
    out["loss"].backward()
    assert target.grad is None


def test_row_terms_gradcheck_fp64():
    g = torch.Generator().manual_seed(3)
    d = (torch.randn(3, 7, generator=g, dtype=torch.float64) * 2).requires_grad_()
    t = torch.randn(3, 7, generator=g, dtype=torch.float64) * 2
    for clip, mode in [(None, "vocab"), (0.05, "vocab"), (0.2, "token")]:
        torch.autograd.gradcheck(lambda x: opd_row_terms(x, t, 0.8, clip, mode), (d,))


def outlier_case():
    """Draft puts real mass on token 0, where the target has ~zero probability."""
    v = 8
    draft = torch.zeros(1, 2, v)
    draft[0, :, 0] = 2.0  # p_d(0) ~ 0.51
    target = torch.zeros(1, 2, v)
    target[0, :, 0] = -30.0  # log p_t(0) ~ -32
    valid = torch.ones(1, 2, dtype=torch.bool)
    return draft.requires_grad_(), target, valid


def test_clipping_changes_result_and_modes_differ():
    draft, target, valid = outlier_case()
    kw = dict(alpha=0.0, backend="torch")
    none = opd_loss(draft, target, valid, clip=None, **kw)
    vocab = opd_loss(draft, target, valid, clip=1.0, clip_mode="vocab", **kw)
    token = opd_loss(draft, target, valid, clip=1.0, clip_mode="token", **kw)
    assert none["rkl"].item() > 10.0  # the outlier term dominates
    assert vocab["rkl"].item() < 1.0  # capped term (1.0) + negative remainder
    torch.testing.assert_close(token["rkl"], torch.tensor(1.0))  # row sum clamped to clip
    assert abs(vocab["rkl"].item() - token["rkl"].item()) > 0.1

    # gradients: token mode zeroes the whole row; vocab mode keeps the unclipped terms' gradient
    (g_none,) = torch.autograd.grad(none["loss"], draft)
    (g_vocab,) = torch.autograd.grad(vocab["loss"], draft)
    (g_token,) = torch.autograd.grad(token["loss"], draft)
    assert torch.all(g_token == 0)
    assert g_vocab.abs().sum() > 0
    assert not torch.allclose(g_vocab, g_none)
    assert g_vocab.abs().max() < g_none.abs().max()
    # and both match the loop reference
    for clip_mode, g in (("vocab", g_vocab), ("token", g_token)):
        d64 = draft.detach().double().requires_grad_()
        ref_loss, _, _ = ref_opd(d64, target.double(), valid, 0.0, 1.0, 1.0, clip_mode)
        (g_ref,) = torch.autograd.grad(ref_loss, d64)
        torch.testing.assert_close(g.double(), g_ref, **TOL)


def test_alpha_one_is_pure_cross_entropy():
    draft, target, valid = make_inputs(seed=1)
    out = opd_loss(draft, target, valid, alpha=1.0, backend="torch")
    torch.testing.assert_close(out["loss"], out["hard"])
    w = position_weights(draft.shape[1]).expand(draft.shape[0], -1)[valid]
    ce = torch.nn.functional.cross_entropy(draft[valid], target[valid].argmax(-1), reduction="none")
    torch.testing.assert_close(out["loss"], (w * ce).sum() / w.sum())
    (g,) = torch.autograd.grad(out["loss"], draft)
    (g_ref,) = torch.autograd.grad((w * ce).sum() / w.sum(), draft)
    torch.testing.assert_close(g, g_ref)


def test_alpha_zero_unclipped_is_reverse_kl():
    draft, target, valid = make_inputs(seed=2)
    out = opd_loss(draft, target, valid, alpha=0.0, clip=None, backend="torch")
    lpd = torch.log_softmax(draft, -1)
    lpt = torch.log_softmax(target, -1)
    kl = torch.nn.functional.kl_div(lpt, lpd, log_target=True, reduction="none").sum(-1)  # KL(p_d || p_t)
    w = position_weights(draft.shape[1]).expand(draft.shape[0], -1)
    torch.testing.assert_close(out["loss"], (w * kl)[valid].sum() / w[valid].sum())


def test_invalid_positions_are_ignored():
    draft, target, valid = make_inputs(seed=4)
    a = opd_loss(draft, target, valid, backend="torch")["loss"]
    d2 = draft.detach().clone()
    t2 = target.clone()
    d2[~valid] = 100.0 * torch.randn_like(d2[~valid])
    t2[~valid] = -50.0
    b = opd_loss(d2, t2, valid, backend="torch")["loss"]
    torch.testing.assert_close(a.detach(), b)


def test_no_valid_positions_gives_zero_loss_with_graph():
    draft, target, _ = make_inputs()
    valid = torch.zeros(draft.shape[:2], dtype=torch.bool)
    out = opd_loss(draft, target, valid, backend="torch")
    assert out["loss"].item() == 0.0 and out["loss"].requires_grad
    out["loss"].backward()
    assert torch.all(draft.grad == 0)


def test_bf16_inputs_computed_in_fp32():
    draft, target, valid = make_inputs(seed=5)
    ref = opd_loss(draft.detach().bfloat16().float(), target.bfloat16().float(), valid, backend="torch")
    d16 = draft.detach().bfloat16().requires_grad_()
    out = opd_loss(d16, target.bfloat16(), valid, backend="torch")
    assert out["loss"].dtype == torch.float32
    torch.testing.assert_close(out["loss"], ref["loss"], rtol=1e-5, atol=1e-5)
    out["loss"].backward()
    assert d16.grad.dtype == torch.bfloat16


def test_bad_arguments():
    draft, target, valid = make_inputs()
    with pytest.raises(ValueError):
        opd_loss(draft, target, valid, clip_mode="row")
    with pytest.raises(ValueError):
        opd_loss(draft, target, valid, backend="cuda")
    with pytest.raises(ValueError):
        opd_loss(draft, target[:, :2], valid)


@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_osd_loss_matches_reference(temperature):
    draft, target, valid = make_inputs(seed=6)
    target.requires_grad_()
    out = osd_loss(draft, target, valid, temperature=temperature)
    d64 = draft.detach().double().requires_grad_()
    ref = ref_osd(d64, target.detach().double(), valid, temperature)
    torch.testing.assert_close(out["loss"].double(), ref, **TOL)
    torch.testing.assert_close(out["fkl"].double(), ref, **TOL)
    (g,) = torch.autograd.grad(out["loss"], draft)
    (g_ref,) = torch.autograd.grad(ref, d64)
    torch.testing.assert_close(g.double(), g_ref, **TOL)
    assert target.grad is None


def test_osd_zero_when_equal():
    draft, _, valid = make_inputs(seed=7)
    out = osd_loss(draft, draft.detach().clone(), valid)
    assert abs(out["loss"].item()) < 1e-6


def test_ce_loss_matches_reference():
    """Pretraining: w_k-weighted cross-entropy against the labels over the valid positions / the weights in play."""
    torch.manual_seed(0)
    n, k, v, gamma = 3, 4, 7, 7.0
    logits = torch.randn(n, k, v, dtype=torch.float64)
    labels, valid = torch.randint(0, v, (n, k)), torch.rand(n, k) > 0.3
    num = den = 0.0
    for i in range(n):
        for j in range(k):
            if valid[i, j]:
                w = math.exp(-j / gamma)
                num -= w * float(ref_log_softmax(logits[i, j])[labels[i, j]])
                den += w
    torch.testing.assert_close(ce_loss(logits, labels, valid, gamma)["loss"].item(), num / den, **TOL)


def test_length_head_loss():
    pred = torch.tensor([0.5, 1.0, 0.25])
    accepted = torch.tensor([7, 20, 1])  # labels 8/16, clamp(21/16)=1, 2/16
    expected = ((0.5 - 0.5) ** 2 + 0.0 + (0.25 - 0.125) ** 2) / 3
    torch.testing.assert_close(length_head_loss(pred, accepted, 16), torch.tensor(expected))
    # label from zero accepted tokens is 1/block_size
    torch.testing.assert_close(length_head_loss(torch.tensor([0.0]), torch.tensor([0]), 4), torch.tensor(1 / 16))
    p = torch.tensor([0.3, 0.9], requires_grad=True)
    length_head_loss(p, torch.tensor([3, 3]), 8).backward()  # label 0.5
    torch.testing.assert_close(p.grad, torch.tensor([2 * (0.3 - 0.5) / 2, 2 * (0.9 - 0.5) / 2]))


def test_accepted_length():
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]])
    draft = torch.tensor([[1, 2, 3, 4], [1, 2, 9, 4], [9, 2, 3, 4], [5, 9, 7, 8]])
    assert accepted_length(draft, target).tolist() == [4, 2, 0, 1]
    assert accepted_length(draft, target).dtype == torch.int64
    assert accepted_length(torch.zeros(0, 3), torch.zeros(0, 3)).shape == (0,)


# ----------------------------------------------------------------------------- draft-vocabulary head (recipe)
VOCAB = torch.tensor([0, 2, 3, 5, 7, 9])  # draft vocabulary: 6 of V = 10 ids


def draft_vocab_batch(k_blk: int = 4) -> dict:
    """Two right-padded sequences with 3 anchors each; labels hit ids inside and outside VOCAB."""
    torch.manual_seed(1)
    tokens = torch.randint(0, 10, (2, 12))
    return {"tokens": tokens, "anchors": torch.tensor([[0, 4, 8], [1, 5, -1]]), "lengths": torch.tensor([12, 9])}


def test_draft_vocab_ce_masks_labels_outside_and_matches_reference():
    """ce over the draft-vocabulary columns = plain cross-entropy of the softmax over VOCAB at the in-vocabulary
    labels (w_k-weighted); labels outside VOCAB are left out of the loss and count as misses in the metrics."""
    from adaflash.recipe import LossSection, block_labels, loss_step

    batch, k_blk, gamma = draft_vocab_batch(), 4, 7.0
    full = torch.randn(2, 3, k_blk - 1, 10, dtype=torch.float64)
    out = loss_step(full[..., VOCAB], batch, LossSection(kind="ce", gamma=gamma, vocab="draft"), vocab=VOCAB)
    labels, valid = block_labels(batch["tokens"], batch["anchors"], batch["lengths"], k_blk)
    num = den = 0.0
    masked = 0
    for b, nb, k in valid.nonzero().tolist():
        label = int(labels[b, nb, k])
        if label not in VOCAB.tolist():
            masked += 1
            continue
        w = math.exp(-k / gamma)
        num -= w * float(ref_log_softmax(full[b, nb, k, VOCAB])[VOCAB.tolist().index(label)])
        den += w
    assert masked and den
    torch.testing.assert_close(out["loss"].item(), num / den, **TOL)
    # the metrics map column j back to token VOCAB[j]: a block whose labels are all in VOCAB and whose logits
    # peak at them is fully accepted; an out-of-vocabulary label stops acceptance there
    peaked = torch.full((2, 3, k_blk - 1, len(VOCAB)), -5.0, dtype=torch.float64)
    cols = torch.searchsorted(VOCAB, labels).clamp(max=len(VOCAB) - 1)
    peaked.scatter_(-1, cols[..., None], 5.0)
    inside = VOCAB[cols] == labels
    acc = loss_step(peaked, batch, LossSection(kind="ce", gamma=gamma), vocab=VOCAB)["acc_pos1"]
    first = valid[..., 0]
    assert acc == pytest.approx(float((inside[..., 0] & first).sum() / first.sum()))


@pytest.mark.parametrize("kind", ["opd", "osd"])
def test_draft_vocab_distillation_is_the_renormalised_teacher(kind):
    """opd/osd on the draft-vocabulary columns = the plain reference on the teacher restricted to VOCAB and
    renormalised (a softmax over those columns), draft likewise; the hard label is the top-1 inside VOCAB."""
    from adaflash.recipe import LossSection, loss_step

    torch.manual_seed(2)
    draft, target = torch.randn(2, 3, 3, 10, dtype=torch.float64), torch.randn(2, 3, 3, 10, dtype=torch.float64)
    target[0, 0, 0, 1] = 50.0  # the full top-1 is outside VOCAB here
    valid = torch.rand(2, 3, 3) > 0.2
    batch = {"valid": valid}
    out = loss_step(draft[..., VOCAB], batch, LossSection(kind=kind, clip=0.05), target[..., VOCAB], vocab=VOCAB)
    d, t, v = draft[..., VOCAB].flatten(0, 1), target[..., VOCAB].flatten(0, 1), valid.flatten(0, 1)
    ref = ref_opd(d, t, v, clip=0.05)[0] if kind == "opd" else ref_osd(d, t, v)
    torch.testing.assert_close(out["loss"].item(), float(ref), **TOL)


def test_vocab_option_is_checked():
    from adaflash.recipe import LossSection

    with pytest.raises(ValueError, match=r"vocab must be one of \('draft', 'full'\)"):
        LossSection(vocab="half")
