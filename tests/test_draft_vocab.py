"""Draft vocabulary: drafting from a subset of the target's tokens stays lossless (greedy, batched,
sampling), survives the drafter directory, is refused when it does not fit, and is chosen from counts."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from adaflash.cli import main
from adaflash.pipelines.draft_vocab import choose, count, coverage
from conftest import greedy_reference, tiny_drafter, tiny_target
from test_spec import _first_token_distribution

from adaflash.drafter import DRAFT_VOCAB, load_drafter
from adaflash.engine import Engine, single_request_engine
from adaflash.policies import EMAPolicy, FixedPolicy
from adaflash.request import Request
from adaflash.spec import propose, verify_sampling


def test_propose_maps_subset_columns_to_full_ids():
    vocab = torch.tensor([2, 5, 9])
    logits = torch.tensor([[0.0, 3.0, 1.0], [4.0, 0.0, 0.0]])  # [k=2, Vd=3]
    d, q = propose(logits, 0.0, None, vocab, 12)
    assert d.tolist() == [5, 2] and q is None
    d, q = propose(logits, 1.0, torch.Generator().manual_seed(0), vocab, 12)
    assert q.shape == (2, 12)
    torch.testing.assert_close(q[:, vocab], torch.softmax(logits, -1))
    outside = torch.ones(12, dtype=torch.bool)
    outside[vocab] = False
    assert (q[:, outside] == 0).all()
    assert all(int(x) in vocab.tolist() and q[i, x] > 0 for i, x in enumerate(d))


def test_logits_and_draft_ids_come_from_the_subset(tiny):
    _, drafter = tiny
    h = torch.randn(5, 64)
    full = drafter.logits(h)  # [5, 64]
    ids = torch.arange(1, 64, 3)
    drafter.set_vocab(ids)
    torch.testing.assert_close(drafter.logits(h), full[:, ids])
    assert drafter.draft_ids(h).tolist() == ids[full[:, ids].argmax(-1)].tolist()
    for bad in ([3, 3], [5, 2], [0, 64], []):
        with pytest.raises(ValueError, match="draft vocabulary"):
            drafter.set_vocab(torch.tensor(bad, dtype=torch.long))
    drafter.set_vocab(None)
    torch.testing.assert_close(drafter.logits(h), full)


@pytest.mark.parametrize("seed", range(2))
def test_greedy_with_a_draft_vocabulary_equals_plain_decoding(seed):
    target = tiny_target(seed)
    drafter = tiny_drafter(target, seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(64, generator=g)[:24].sort().values
    drafter.set_vocab(ids)
    prompt = torch.randint(0, 64, (4 + seed,), generator=g).tolist()
    ar = greedy_reference(target, prompt, 40, [])
    assert single_request_engine(target, drafter, []).generate(prompt, 40).out == ar
    reqs = [Request(f"r{i}", prompt[: 2 + i], 30) for i in range(4)]
    refs = [greedy_reference(target, r.prompt_ids, 30, []) for r in reqs]
    for policy in (FixedPolicy(), FixedPolicy(3), EMAPolicy()):
        states = Engine(target, drafter, policy, eos_ids=[], max_batch=3).run(reqs)
        for ref, s in zip(refs, states):
            assert s.out == ref
            assert all(t in ids.tolist() for rd in s.rounds for t in rd.draft)  # drafts only from the subset


def test_sampling_from_a_subset_keeps_target_distribution():
    """Drafts sampled from 4 of 8 tokens (q zero elsewhere) and verified by the rejection rule: the
    first committed token follows the target's p, exactly (analytic) and empirically (chi-square)."""
    torch.manual_seed(2)
    vocab = torch.tensor([0, 2, 3, 6])
    p0 = torch.softmax(torch.randn(8) * 1.5, -1)
    n = 20000
    g = torch.Generator().manual_seed(7)
    draft, q = propose((torch.randn(4) * 1.5).expand(n, 4), 1.0, g, vocab, 8)  # [N] ids, [N, 8] (rows = rounds)
    torch.testing.assert_close(_first_token_distribution(p0, q[0]), p0, atol=1e-6, rtol=1e-5)
    p = torch.stack([p0, torch.softmax(torch.randn(8), -1)]).expand(n, 2, 8)
    accepted, nxt = verify_sampling(draft[:, None], q[:, None], p, g)
    first = torch.where(accepted == 1, draft, nxt)
    counts = torch.bincount(first, minlength=8).double()
    expected = p0.double() * n
    assert ((counts - expected) ** 2 / expected).sum().item() < 24.3  # 7 degrees of freedom, p = 0.001
    assert counts[[1, 4, 5, 7]].sum() > 0 and 0 < accepted.float().mean() < 1  # both paths taken


def test_batched_sampling_with_a_draft_vocabulary_equals_single_request():
    target = tiny_target(7, vocab=64, std=0.15)
    drafter = tiny_drafter(target, 7)
    drafter.set_vocab(torch.arange(0, 64, 2))
    reqs = [Request(f"r{i}", [1 + i, 9, 4, 33], 12, temperature=0.9, seed=100 + i) for i in range(4)]
    states = Engine(target, drafter, FixedPolicy(), eos_ids=[], max_batch=2).run(reqs)
    for r, s in zip(reqs, states):
        assert s.out == single_request_engine(target, drafter, []).generate(r.prompt_ids, 12, temperature=0.9, seed=r.seed).out
        assert all(t % 2 == 0 for rd in s.rounds for t in rd.draft)


def _identity(target):
    from adaflash.target import fingerprint

    return {"name": "tiny", "fingerprint": fingerprint(target), "vocab_size": 64, "hidden_size": 64, "num_layers": 4}


def test_saved_with_the_drafter_and_refused_when_it_does_not_fit(tmp_path):
    from safetensors.torch import save_file

    target = tiny_target(0)
    identity = _identity(target)
    drafter = tiny_drafter(target, 0)
    drafter.config.target = identity
    ids = torch.tensor([0, 3, 7, 40, 63])
    drafter.set_vocab(ids)
    out = drafter.save(tmp_path / "d", dtype=torch.float32)
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 5
    loaded = load_drafter(out, target, identity)
    assert loaded.vocab.tolist() == ids.tolist()
    h = torch.randn(3, 64)
    torch.testing.assert_close(loaded.logits(h), drafter.logits(h))

    save_file({"ids": torch.tensor([0, 3, 7, 40, 64])}, str(out / DRAFT_VOCAB))  # id 64: not in a 64-token vocabulary
    with pytest.raises(ValueError, match="draft vocabulary"):
        load_drafter(out, target, identity)
    save_file({"ids": torch.tensor([0, 3])}, str(out / DRAFT_VOCAB))
    with pytest.raises(ValueError, match="does not hold the 5 ids"):
        load_drafter(out, target, identity)
    (out / DRAFT_VOCAB).unlink()
    with pytest.raises(FileNotFoundError, match="draft_vocab.safetensors is missing"):
        load_drafter(out, target, identity)

    drafter.set_vocab(None)
    drafter.save(out, dtype=torch.float32)  # a drafter without one: the directory says so
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] is None
    assert load_drafter(out, target, identity).vocab is None


def test_choose_ranks_by_count_then_id():
    counts = count([[5, 5, 5, 9, 9, 2], [9, 1]], 12)
    assert counts.tolist()[:10] == [0, 1, 1, 0, 0, 3, 0, 0, 0, 3]
    assert choose(counts, 2).tolist() == [5, 9]  # tie at 3: both
    assert choose(counts, 3).tolist() == [1, 5, 9]  # tie at 1 between ids 1 and 2: the lower id
    assert choose(counts, 6).tolist() == [0, 1, 2, 3, 5, 9]  # unseen tokens by id
    assert coverage(choose(counts, 3), counts) == pytest.approx(7 / 8)
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        count([[12]], 12)


def test_draft_vocab_command_writes_reports_and_removes(tmp_path, tiny_drafter_dir, capsys):
    import shutil

    d = tmp_path / "drafter"
    shutil.copytree(tiny_drafter_dir, d)
    vocab = json.loads((d / "config.json").read_text())["target"]["vocab_size"]
    answers = tmp_path / "answers"
    answers.mkdir()
    rows = [{"prompt_id": f"p{i}", "response_ids": [7, 7, 8 + i % 3, 100 + i]} for i in range(40)]
    pq.write_table(pa.Table.from_pylist(rows), answers / "answers-00000.parquet")
    assert main(["draft-vocab", "--answers", str(answers), "--drafter", str(d), "--size", "16", "--plot", str(tmp_path / "cov.png")]) == 0
    meta = json.loads((d / "config.json").read_text())
    assert meta["draft_vocab_size"] == 16 and meta["draft_vocab"]["answers"] == 40
    assert 0 < meta["draft_vocab"]["heldout_coverage"]["16"] < 1  # the held-out prompts' own 100+i tokens are unseen
    assert (tmp_path / "cov.png").stat().st_size > 0
    from safetensors.torch import load_file

    ids = load_file(str(d / DRAFT_VOCAB))["ids"].tolist()
    assert {7, 8, 9, 10} <= set(ids) and len(ids) == 16
    assert main(["draft-vocab", "--answers", str(answers), "--drafter", str(d), "--size", str(vocab)]) == 2
    assert "--size must be" in capsys.readouterr().err
    assert main(["draft-vocab", "--answers", str(tmp_path / "none"), "--drafter", str(d)]) == 1
    assert "no answers-*.parquet" in capsys.readouterr().err
    assert main(["draft-vocab", "--drafter", str(d), "--size", "0"]) == 0
    assert not (d / DRAFT_VOCAB).exists() and json.loads((d / "config.json").read_text())["draft_vocab_size"] is None
