"""Online trainer on a tiny random target, with real components only: a buffer of trajectories from real
Engine runs (ShardWriter), real DeepSpeed steps, a real MLflow server + registry, and a real kill -9."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from adaflash.trainer.config import OnlineConfig
from adaflash.trainer.data import Sequence, heldout_tau, is_heldout, make_batch, supervise, to_sequences, train_items
from adaflash.trainer.online import OnlineModel, OnlineTrainer, ds_config, gate, refit_head, retired_shards

from adaflash import recipe
from adaflash.buffer import ShardReader, ShardWriter
from adaflash.config import from_dict, load_config
from adaflash.drafter import load_drafter
from adaflash.engine import Engine
from adaflash.length_head import LengthHead, LengthHeadConfig
from adaflash.policies import FixedPolicy
from adaflash.request import Request
from adaflash.target import load_target

REPO = Path(__file__).resolve().parent.parent
ROWS_PER_SHARD = 4
HELDOUT_FRAC = 0.25


def request_ids(n_shards: int) -> list[str]:
    """Ids whose hash split gives every shard one held-out and three training trajectories."""
    held = [f"req-{i}" for i in range(1000) if is_heldout(f"req-{i}", HELDOUT_FRAC)][:n_shards]
    train = [f"req-{i}" for i in range(1000) if not is_heldout(f"req-{i}", HELDOUT_FRAC)][: 3 * n_shards]
    return [x for s in range(n_shards) for x in [held[s]] + train[3 * s : 3 * s + 3]]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_hf_dir, tiny_drafter_dir):
    """3 shards of 4 trajectories, served greedily by the tiny target + drafter through the Engine."""
    root = tmp_path_factory.mktemp("buffer")
    target = load_target(str(tiny_hf_dir), "float32")
    drafter = load_drafter(tiny_drafter_dir, target.model, target.identity, torch.float32)
    engine = Engine(target.model, drafter, FixedPolicy(), target.eos_ids, max_batch=12)
    topics = ["sums", "primes", "loops", "lists", "fractions", "strings"]
    reqs = [
        Request(
            rid, target.encode_chat(f"Explain {topics[i % 6]} in example {i}."), max_new_tokens=16, domain=["math", "code", "chat"][i % 3]
        )
        for i, rid in enumerate(request_ids(3))
    ]
    with ShardWriter(root, "node0", rows_per_shard=ROWS_PER_SHARD, max_age_s=None) as writer:
        for st in engine.run(reqs):
            writer.append(engine.trajectory(st, "node0"))
    shards = sorted(p.name for p in root.glob("*.parquet"))
    assert len(shards) == 3
    probe = ShardReader(root, ledger_path=root / "_probe.jsonl")  # reads without consuming the copies tests make
    per_shard = [sum(len(t.rounds) for t in b.trajectories()) for b in probe.poll()]
    return {"root": root, "shards": shards, "min_rounds": min(per_shard), "target": target}


def trainer_config(tmp_path: Path, served: dict, url: str, hf: Path, drafter_dir: Path, model: str, **sections) -> Path:
    """tests/configs/online_tiny.yaml with this test's paths (and a private copy of the buffer) -> YAML path."""
    buf = tmp_path / "buffer"
    if not buf.exists():
        shutil.copytree(served["root"], buf, ignore=shutil.ignore_patterns("_*"))
    data = yaml.safe_load((REPO / "tests" / "configs" / "online_tiny.yaml").read_text())
    data["target"]["source"], data["drafter"]["init_dir"] = str(hf), str(drafter_dir)
    data["buffer"].update(dir=str(buf), min_new_rounds=served["min_rounds"])
    data["checkpoint"]["dir"] = str(tmp_path / "ckpt")
    data["mlflow"].update(tracking_uri=url, model_name=model)
    for name, values in sections.items():
        data[name].update(values)
    path = tmp_path / "online.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def ledger(buffer: Path, op: str = "consume") -> list[dict]:
    """The buffer ledger's records of one kind (consume: a round's shards; delete: retention)."""
    recs = [json.loads(x) for x in (buffer / "_ledger.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in recs if r["op"] == op]


def shard_files(buffer: Path) -> list[str]:
    return sorted(p.name for p in buffer.glob("*.parquet"))


def history(ckpt: Path) -> list[dict]:
    return [json.loads(x) for x in (ckpt / "rounds.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------ units


def test_gate_promotes_and_rejects():
    ev = lambda tau, blocks=50: {"tau": tau, "blocks": blocks}  # noqa: E731
    assert gate(ev(2.0), ev(2.1), 0.0, 16)[0]
    assert gate(ev(2.0), ev(2.0), 0.0, 16)[0]  # equal is not worse
    assert gate(ev(2.0), ev(1.95), 0.1, 16)[0]  # within tolerance
    ok, reason = gate(ev(2.0), ev(1.8), 0.1, 16)
    assert not ok and "2.000 -> 1.800 < 1.900" in reason
    ok, reason = gate(ev(1.0), ev(3.0, blocks=3), 0.0, 16)
    assert not ok and "only 3 full held-out blocks" in reason


def test_batch_teacher_rows_and_masks():
    # hidden[i] = i and target_next[i] = 100 + i make the gathered teacher rows readable
    s = Sequence(
        "r",
        "math",
        torch.arange(10),
        torch.tensor([2, 5, 7]),
        feats=torch.zeros(10, 3),
        hidden=torch.arange(10.0)[:, None].expand(10, 2),
        target_next=100 + torch.arange(10),
    )
    b = make_batch([(s, s.anchors), (s, s.anchors[:1])], k_blk=4)
    assert b["tgt_hidden"][0, :, :, 0].tolist() == [[2, 3, 4], [5, 6, 7], [7, 8, 9]]  # teacher of a + k at a + k - 1
    assert b["valid"][0].tolist() == [[True] * 3, [True] * 3, [True, True, False]]  # label 10 is past the end
    assert b["full"][0].tolist() == [True, True, False] and b["full"][1].tolist() == [True, False, False]
    assert b["anchors"][1].tolist() == [2, -1, -1] and not b["valid"][1, 1:].any()
    assert s.full_anchors(4).tolist() == [2, 5]
    assert is_heldout("req-7", 0.25) == is_heldout("req-7", 0.25)
    assert 0.15 < sum(is_heldout(f"x{i}", 0.25) for i in range(2000)) / 2000 < 0.35


def test_round_memory_keeps_the_last_rounds_and_ignores_a_killed_rounds_file(tmp_path, served):
    from adaflash.trainer.memory import RoundMemory

    from adaflash.buffer import ShardReader, from_arrow

    probe = ShardReader(served["root"], ledger_path=tmp_path / "ledger.jsonl")
    tables = [b.table for b in probe.poll()]  # 3 shards of 4 trajectories
    mem = RoundMemory(tmp_path / "memory")
    for r, tab in enumerate(tables, start=1):
        mem.save(r, [tab])
    ids = lambda kept: {j: [t.request_id for t in trajs] for j, trajs in kept.items()}  # noqa: E731
    first, second = ([t.request_id for t in from_arrow(tab)] for tab in tables[:2])
    assert ids(mem.load(3, 2)) == {1: first, 2: second}
    assert ids(mem.load(2, 5)) == {1: first}  # round 3's file (a killed round 3) is not read
    assert mem.load(1, 3) == {} and mem.load(3, 0) == {}
    mem.prune(3, 1)  # round 4 reads round 3 only
    assert sorted(p.name for p in mem.root.iterdir()) == ["round3.parquet"]


def test_first_rounds_are_small_and_double_up_to_the_configured_size(tmp_path):
    cfg = load_config(REPO / "configs" / "online_smollm2.yaml", OnlineConfig)
    sizes = [cfg.round_size(r) for r in range(1, 6)]
    assert sizes == [(256, 4), (512, 8), (1024, 16), (2048, 32), (2048, 40)]  # make up: a version within minutes
    plain = OnlineConfig()
    assert plain.round_size(1) == plain.round_size(9) == (plain.buffer.min_new_rounds, plain.train.steps_per_update)
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps_per_update: 10\n  first_steps: 20\n")
    with pytest.raises(ValueError, match=r"first_steps must be in \[1, steps_per_update=10\]"):
        load_config(bad, OnlineConfig)


def test_configs_load_and_bad_values_say_what_to_fix(tmp_path):
    from adaflash.config import ConfigError

    cfg = load_config(REPO / "configs" / "online_smollm2.yaml", OnlineConfig)
    assert cfg.loss.kind == "opd" and cfg.loss.clip_mode == "vocab" and cfg.max_rounds == 0
    assert load_config(REPO / "tests" / "configs" / "online_tiny.yaml", OnlineConfig).drafter.save_dtype == "float32"
    bad = tmp_path / "bad.yaml"
    for text, match in [
        ("loss:\n  kind: kl\n", r"kind must be one of \('opd', 'osd', 'head'\)"),
        ("deepspeed:\n  zero_stage: 3\n", "zero_stage must be 0, 1 or 2"),
        ("buffer:\n  min_new_round: 5\n", "unknown key.*min_new_round"),
        ("train:\n  replay_rounds: -1\n", "replay_rounds must be >= 0"),
        ("gate:\n  heldout_rounds: -2\n", "heldout_rounds must be >= 0"),
        ("train:\n  head_refit_epochs: 5\ndeepspeed:\n  zero_stage: 2\n", "head_refit_epochs needs deepspeed.zero_stage 0"),
        ("retention:\n  policy: shred\n", r"retention: policy must be one of \('keep', 'delete', 'compact'\)"),
        ("retention:\n  policy: delete\n  keep_rounds: -1\n", "keep_rounds must be >= 0"),
        ("retention:\n  policy: delete\n  max_bytes: -5\n", "max_bytes must be >= 0 or null"),
        ("retention:\n  keep_rounds: 3\n", "with policy 'keep' nothing is removed"),
    ]:
        bad.write_text(text)
        with pytest.raises(ConfigError, match=match):
            load_config(bad, OnlineConfig)


def test_retention_keeps_the_newest_rounds_under_the_byte_cap():
    consumed = [("a", 1, 10), ("b", 1, 10), ("c", 2, 30), ("d", 3, 5), ("e", None, 1)]  # (name, round, bytes), oldest first
    assert retired_shards(consumed, 3, 0, None) == ["a", "b", "c", "d", "e"]
    assert retired_shards(consumed, 3, 1, None) == ["a", "b", "c", "e"]  # round 3 stays; untagged never count as kept
    assert retired_shards(consumed, 3, 2, None) == ["a", "b", "e"]
    assert retired_shards(consumed, 3, 3, 35) == ["e", "a", "b"]  # 55 bytes kept > 35: the oldest go until 35 fit
    assert retired_shards(consumed, 3, 3, 34) == ["e", "a", "b", "c"]
    assert retired_shards(consumed, 3, 3, 1000) == ["e"] and retired_shards([], 5, 0, 0) == []


def test_cli_help_explains_the_loop(capsys):
    from adaflash.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for phrase in ("min_new_rounds", "held-out", "champion", "exactly once", "--max-rounds"):
        assert phrase in text


@pytest.fixture(scope="module")
def supervised(served):
    """The served trajectories with the teacher recomputed, split train / held-out."""
    seqs = to_sequences(
        [t for b in ShardReader(served["root"], ledger_path=served["root"] / "_probe2.jsonl").poll() for t in b.trajectories()]
    )
    supervise(served["target"].model, seqs, chunk=4)
    train = [s for s in seqs if not is_heldout(s.request_id, HELDOUT_FRAC)]
    held = [s for s in seqs if is_heldout(s.request_id, HELDOUT_FRAC)]
    assert len(train) == 9 and len(held) == 3
    return train, held


def test_teacher_and_training_forward_reproduce_what_was_served(served, supervised, tiny_drafter_dir):
    """The data path is on-policy: at every recorded anchor the drafter's training forward drafts the tokens
    the server drafted, and the recomputed target agrees with the server's verification."""
    t = served["target"]
    drafter = load_drafter(tiny_drafter_dir, t.model, t.identity, torch.float32)
    trajs = {
        x.request_id: x for b in ShardReader(served["root"], ledger_path=served["root"] / "_probe3.jsonl").poll() for x in b.trajectories()
    }
    checked = 0
    for s in supervised[0] + supervised[1]:
        batch = make_batch([(s, s.anchors)], 4)
        with torch.no_grad():
            drafted = drafter.lm_head(drafter(batch["feats"], batch["tokens"], batch["anchors"], batch["lengths"])).argmax(-1)[0]
        for j, r in enumerate(trajs[s.request_id].rounds):
            assert int(s.anchors[j]) == r.anchor
            n = len(r.draft)
            assert drafted[j, :n].tolist() == r.draft
            # verification saw the drafts: its tokens after the first rejection are conditioned on rejected
            # drafts, the teacher on the committed text; up to the first rejection they must agree
            m = min(n, r.accepted + 1)
            assert s.target_next[r.anchor : r.anchor + m].tolist() == r.target[:m]
            checked += n
    assert checked > 100


def ds_engine(served, drafter_dir, cfg: OnlineConfig):
    import deepspeed

    from adaflash.distributed import init_distributed

    t = served["target"]
    drafter = load_drafter(drafter_dir, t.model, t.identity, torch.float32).requires_grad_(True)
    torch.manual_seed(0)
    head = LengthHead(LengthHeadConfig(hidden_size=drafter.config.hidden_size, block_size=drafter.block_size))
    init_distributed()
    groups = [{"params": list(drafter.parameters())}, {"params": list(head.parameters()), "lr": cfg.train.head_lr}]
    engine, _, _, _ = deepspeed.initialize(model=OnlineModel(drafter, head), model_parameters=groups, config=ds_config(cfg))
    return engine


def train_step(engine, target, batch, cfg) -> dict:
    clip = lambda e: {"grad_norms": recipe.clip_per_group(e, cfg.train.grad_clip)}  # noqa: E731
    return recipe.train_step(engine, batch, cfg.loss, forward=engine, teacher=target.model, clip=clip, vocab=engine.module.vocab)


def test_drafter_and_head_gradients_are_clipped_apart(served, supervised, tiny_drafter_dir):
    """Per-group clipping (ZeRO 0): the head's loss does not change the drafter's clipped step."""
    batch = make_batch(train_items(supervised[0], 0, 0, 1, 2, 6, 0, 1), 4)
    runs = {}
    for weight in (1.0, 0.0):
        cfg = from_dict(OnlineConfig, {"train": {"lr": 1e-3, "grad_clip": 0.05}, "loss": {"head_weight": weight}})
        assert ds_config(cfg)["gradient_clipping"] == 0.0  # DeepSpeed's global clipping is off
        engine = ds_engine(served, tiny_drafter_dir, cfg)
        step = train_step(engine, served["target"], batch, cfg)
        runs[weight] = (dict(engine.module.drafter.state_dict()), step)
    (drafter_w, step), (drafter_0, step_0) = runs[1.0], runs[0.0]
    assert step["grad_norms"][0] > 0.05  # over the clip: clipping acts on the drafter
    assert step["grad_norms"][1] > 0 and step_0["grad_norms"][1] == 0  # the head's gradient differs between the runs
    assert all(torch.equal(drafter_w[k], drafter_0[k]) for k in drafter_w)
    # ZeRO > 0 partitions gradients across ranks: DeepSpeed clips the global norm there
    assert ds_config(from_dict(OnlineConfig, {"deepspeed": {"zero_stage": 1}}))["gradient_clipping"] == 1.0


def test_loss_decreases_on_a_fixed_batch(served, supervised, tiny_drafter_dir):
    cfg = from_dict(OnlineConfig, {"train": {"lr": 1e-3}})
    engine = ds_engine(served, tiny_drafter_dir, cfg)
    batch = make_batch(train_items(supervised[0], 0, 0, 1, 2, 6, 0, 1), 4)
    steps = [train_step(engine, served["target"], batch, cfg) for _ in range(8)]
    # the distillation terms (the head's MSE jumps when blocks start to match, so not the total)
    assert steps[-1]["hard"] < 0.75 * steps[0]["hard"], [round(s["hard"], 3) for s in steps]
    assert steps[-1]["rkl"] < steps[0]["rkl"]
    # the head's label moves with the drafter; with the drafter's lr at 0 the labels hold still and its MSE falls
    engine.optimizer.param_groups[0]["lr"] = 0.0
    frozen = {k: v.clone() for k, v in engine.module.drafter.state_dict().items()}
    head = [train_step(engine, served["target"], batch, cfg)["head_loss"] for _ in range(4)]
    assert head[-1] < head[0] and all(torch.equal(v, engine.module.drafter.state_dict()[k]) for k, v in frozen.items())


def test_draft_vocab_head_trains_through_its_rows_only(served, supervised, tiny_drafter_dir):
    """loss.vocab draft: the teacher's and the drafter's logits are the draft-vocabulary columns of the full
    head's; the loss's gradient reaches the full logits on those columns only, and the drafter's gradients
    equal those through the full head gathered to the same columns. Held-out tau then scores the drafts
    as served (argmax inside the draft vocabulary)."""
    t = served["target"]
    vocab = torch.arange(1, t.model.config.vocab_size, 3)  # a third of the ids
    cfg = from_dict(OnlineConfig, {"train": {"lr": 1e-3}})
    engine = ds_engine(served, tiny_drafter_dir, cfg)
    drafter = engine.module.drafter
    drafter.set_vocab(vocab)
    assert torch.equal(engine.module.vocab, vocab)
    batch = make_batch(train_items(supervised[0], 0, 0, 1, 2, 6, 0, 1), 4)
    tgt = recipe.teacher_logits(t.model, batch, vocab)
    torch.testing.assert_close(tgt, recipe.teacher_logits(t.model, batch)[..., vocab])
    loss = from_dict(OnlineConfig, {}).loss
    h = drafter(batch["feats"], batch["tokens"], batch["anchors"], batch["lengths"])  # [B, NB, K-1, H]
    full = drafter.lm_head(h)  # [B, NB, K-1, V]
    full.retain_grad()
    recipe.loss_step(full[..., vocab], batch, loss, tgt, vocab=vocab)["loss"].backward()
    outside = torch.ones(full.shape[-1], dtype=torch.bool)
    outside[vocab] = False
    assert full.grad[..., outside].abs().max() == 0 and full.grad[..., vocab].abs().sum() > 0
    gathered = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()
    logits = recipe.block_logits(drafter, batch, vocab)  # [B, NB, K-1, Vd]
    assert logits.shape[-1] == len(vocab)
    recipe.loss_step(logits, batch, loss, tgt, vocab=vocab)["loss"].backward()
    for n, p in drafter.named_parameters():
        torch.testing.assert_close(p.grad, gathered[n], rtol=1e-4, atol=1e-6)
    drafter.zero_grad()
    assert train_step(engine, t, batch, cfg)["positions"] > 0  # the trainer's own step over the draft columns

    def served_full(batch):  # the full head's logits with the columns a drafter never proposes at -inf
        logits, pred = engine.module.drafter.lm_head(engine.module.blocks(batch)[0]), torch.zeros(batch["anchors"].shape)
        return logits.masked_fill(outside, float("-inf")), pred

    engine.eval()
    assert heldout_tau(engine, supervised[1], 4, 6, 4, vocab)["tau"] == heldout_tau(served_full, supervised[1], 4, 6, 4)["tau"]


def test_bf16_features_change_no_autocast_step(served, supervised, tiny_drafter_dir):
    """supervise(feats_dtype=bf16) stores the features rounded to bf16, and under bf16 autocast (when the
    trainer asks for them) the drafter's training forward is bit-identical to the fp32 features'."""
    t = served["target"]
    seqs = [Sequence(s.request_id, s.domain, s.tokens, s.anchors) for s in supervised[0][:2]]
    supervise(t.model, seqs, chunk=4, feats_dtype=torch.bfloat16)
    for s, ref in zip(seqs, supervised[0][:2]):
        assert s.feats.dtype == torch.bfloat16 and torch.equal(s.feats, ref.feats.to(torch.bfloat16))
        assert s.hidden.dtype == ref.hidden.dtype and torch.equal(s.hidden, ref.hidden)  # the teacher's states stay exact
    drafter = load_drafter(tiny_drafter_dir, t.model, t.identity, torch.float32)
    outs = []
    for part in (seqs, supervised[0][:2]):
        batch = make_batch([(s, s.anchors) for s in part], 4)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(recipe.block_logits(drafter, batch))
    assert torch.equal(outs[0], outs[1])


def test_heldout_tau_rises_when_training_on_the_same_distribution(served, supervised, tiny_drafter_dir):
    """The data path end to end: recorded anchors -> teacher -> OPD steps -> teacher-forced held-out tau."""
    cfg = from_dict(OnlineConfig, {"train": {"lr": 3e-3}})
    train, held = supervised
    engine = ds_engine(served, tiny_drafter_dir, cfg)

    def evaluate():
        engine.eval()
        return heldout_tau(engine, held, 4, 6, 4)

    before = evaluate()
    for i in range(12):
        train_step(engine, served["target"], make_batch(train_items(train, i, 0, 1, 2, 6, 0, 1), 4), cfg)
    after = evaluate()
    assert before["blocks"] == after["blocks"] > 20
    assert set(after["domains"]) == {"math", "code", "chat"}  # one held-out trajectory per shard, one domain each
    assert after["tau"] > before["tau"] + 0.3, (before["tau"], after["tau"])
    assert 0 <= after["head_mae"] <= 1
    # the head chased a moving drafter; refit on the final one (drafter frozen), it predicts held-out blocks better
    drafter_w = {k: v.clone() for k, v in engine.module.drafter.state_dict().items()}
    cfg.train.head_refit_epochs = 30
    fit = refit_head(engine.module, train, 4, cfg.train, seed=0)
    refit = evaluate()
    assert fit["n_train"] + fit["n_val"] > 20 and fit["mae"] < 0.1
    assert refit["head_mae"] < after["head_mae"], (after["head_mae"], refit["head_mae"])
    assert refit["tau"] == after["tau"] and all(torch.equal(v, engine.module.drafter.state_dict()[k]) for k, v in drafter_w.items())


# ------------------------------------------------------------------------------------------ with MLflow


def version_weights(registry, version: str, tmp: Path) -> dict:
    from safetensors.torch import load_file

    path = registry.download(version, tmp)
    return {**load_file(str(path / "model.safetensors")), **load_file(str(path / "length_head.safetensors"))}


def test_update_round_registers_gates_and_rolls_back(tmp_path, served, mlflow_server, tiny_hf_dir, tiny_drafter_dir):
    from adaflash.registry import Registry
    from mlflow import MlflowClient

    path = trainer_config(tmp_path, served, mlflow_server, tiny_hf_dir, tiny_drafter_dir, "gate-test", loss={"kind": "osd"})
    cfg = load_config(path, OnlineConfig)
    lines = []
    trainer = OnlineTrainer(cfg, log=lines.append)
    assert trainer.run(1) == 1
    reg, client = Registry(mlflow_server, "gate-test"), MlflowClient(mlflow_server)
    assert reg.champion() == "1"
    (v1,) = reg.versions()
    assert v1["tags"]["gate"] == "promoted" and v1["tags"]["loss"] == "osd" and v1["tags"]["parent_version"] == "None"
    assert v1["tags"]["data_window"] == f"{served['shards'][0]}..{served['shards'][0]} (1 shards)"
    run = client.get_run(v1["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["data_window"].startswith(served["shards"][0])
    assert run.data.metrics["heldout_tau_after"] >= run.data.metrics["heldout_tau_before"]
    assert {"head_mae_before", "head_mae_after", "tokens_trained", "heldout_blocks"} <= set(run.data.metrics)
    assert any(k.startswith("heldout_tau_after/") for k in run.data.metrics)  # per domain
    fkl = [m.value for m in sorted(client.get_metric_history(v1["run_id"], "fkl"), key=lambda m: m.step)]
    assert len(fkl) == cfg.train.steps_per_update and fkl[-1] < fkl[0]  # the OSD baseline's loss trains too
    assert any("round 1:" in x and "promoted v1" in x for x in lines)

    trainer.cfg.gate.tolerance = -100.0  # demand an impossible gain: this round must be rejected
    assert trainer.run(1) == 1
    v2 = reg.versions()[1]
    assert reg.champion() == "1" and v2["tags"]["gate"] == "rejected" and "(tau before - gate.tolerance)" in v2["tags"]["reason"]
    assert v2["tags"]["parent_version"] == "1"
    state = json.loads((tmp_path / "ckpt" / "state.json").read_text())
    assert state["round"] == 2 and state["weights_tag"] == "round1" and state["base_version"] == "1"
    # rollback: the trainer's weights are v1's again, not the rejected v2's
    live = {**trainer.engine.module.drafter.state_dict(), **trainer.engine.module.head.state_dict()}
    w1, w2 = version_weights(reg, "1", tmp_path / "dl"), version_weights(reg, "2", tmp_path / "dl")
    assert all(torch.equal(live[k], w1[k]) for k in w1) and not all(torch.equal(w1[k], w2[k]) for k in w1)
    assert [h["round"] for h in history(tmp_path / "ckpt")] == [1, 2]
    # round 2 also trained on round 1's 3 training trajectories and judged on its held-out one (round memory)
    r1, r2 = history(tmp_path / "ckpt")
    assert (r1["train"], r1["heldout"], r2["train_new"], r2["heldout_new"]) == (3, 1, 3, 1)
    assert (r2["train"], r2["heldout"]) == (6, 2)
    assert r1["head_refit"]["n_train"] > 0 and "head_refit_mae" in run.data.metrics  # the head refit on the final drafter

    # a new trainer (fresh checkpoint dir) starts from the registry's champion
    cfg.checkpoint.dir = str(tmp_path / "ckpt-new")
    OnlineTrainer(cfg, log=lines.append)
    assert json.loads((tmp_path / "ckpt-new" / "init" / "config.json").read_text())["online"]["started_from"] == "1"

    # the champion moved outside the trainer (a promotion / rollback in the UI): the next round trains from it
    reg.set_champion("2")
    assert trainer.run(1) == 1  # tolerance still impossible: rejected, rolled back to the followed weights
    v3 = reg.versions()[2]
    assert v3["tags"]["parent_version"] == "2" and reg.champion() == "2"
    live = {**trainer.engine.module.drafter.state_dict(), **trainer.engine.module.head.state_dict()}
    assert all(torch.equal(live[k], w2[k]) for k in w2)
    state = json.loads((tmp_path / "ckpt" / "state.json").read_text())
    assert state["weights_tag"] == "champion-v2" and state["base_version"] == "2" and state["champion"] == "2"
    assert any("champion moved to v2 outside the trainer" in x for x in lines)

    # a rollback while a round trains wins: the round's version is registered, not promoted over it
    trainer.cfg.gate.tolerance = 100.0
    train = trainer._train

    def rollback_midway(*a, **k):
        out = train(*a, **k)
        reg.set_champion("1")
        return out

    trainer._train = rollback_midway
    shutil.copy(served["root"] / served["shards"][0], tmp_path / "buffer" / f"node9-{served['shards'][0]}")  # a 4th round's shard
    assert trainer.run(1) == 1
    v4 = reg.versions()[3]
    assert reg.champion() == "1" and v4["tags"]["gate"] == "rejected" and "champion moved to v1" in v4["tags"]["reason"]


def test_head_only_rounds_leave_the_drafter_as_served_and_fit_the_head(tmp_path, served, mlflow_server, tiny_hf_dir, tiny_drafter_dir):
    """loss.kind "head": no distillation, the published drafter is the served one bit for bit (in the save dtype),
    only the length head learns from the acceptance labels, and the gate promotes it (tau cannot move)."""
    from safetensors.torch import load_file

    from adaflash.registry import Registry

    path = trainer_config(tmp_path, served, mlflow_server, tiny_hf_dir, tiny_drafter_dir, "head-only", loss={"kind": "head"})
    cfg = load_config(path, OnlineConfig)
    trainer = OnlineTrainer(cfg, log=lambda _: None)
    init = tmp_path / "ckpt" / "init"
    start_drafter, start_head = load_file(str(init / "model.safetensors")), load_file(str(init / "length_head.safetensors"))
    assert trainer.run(1) == 1
    (rec,) = history(tmp_path / "ckpt")
    assert rec["promote"] and rec["tau_after"] == rec["tau_before"]
    assert rec["head_mae_after"] < rec["head_mae_before"], (rec["head_mae_before"], rec["head_mae_after"])
    reg = Registry(mlflow_server, "head-only")
    assert reg.champion() == "1" and reg.versions()[0]["tags"]["loss"] == "head"
    w = version_weights(reg, "1", tmp_path / "dl")
    dtype = getattr(torch, cfg.drafter.save_dtype)
    assert start_drafter and all(torch.equal(w[k], v.to(dtype)) for k, v in start_drafter.items())
    assert not all(torch.equal(w[k], start_head[k]) for k in ("proj.weight", "out.weight"))
    steps = [json.loads(x) for x in (tmp_path / "ckpt" / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == cfg.train.steps_per_update and not {"hard", "rkl", "fkl"} & set(steps[0])


def test_a_trainer_stopped_mid_round_marks_its_run_killed_at_once(tmp_path, served, mlflow_server, tiny_hf_dir, tiny_drafter_dir):
    """Ctrl-C (or `adaflash up` stopping) while a round trains: its MLflow run ends KILLED right away, not RUNNING until
    the next start; nothing is registered or committed, and the next start trains the same shards in a new run."""
    from adaflash.registry import Registry
    from mlflow import MlflowClient

    cfg = load_config(trainer_config(tmp_path, served, mlflow_server, tiny_hf_dir, tiny_drafter_dir, "stopped"), OnlineConfig)
    trainer = OnlineTrainer(cfg, log=lambda _: None)
    runs = []

    def interrupted(data, run_id):
        runs.append(run_id)
        raise KeyboardInterrupt

    trainer._train = interrupted
    with pytest.raises(KeyboardInterrupt):
        trainer.run(1)
    run = MlflowClient(mlflow_server).get_run(runs[0])
    assert run.info.status == "KILLED" and "stopped mid-round" in run.data.tags["note"]
    assert json.loads((tmp_path / "ckpt" / "state.json").read_text())["inflight_run"] is None
    assert not (tmp_path / "buffer" / "_ledger.jsonl").exists() and Registry(mlflow_server, "stopped").versions() == []
    lines = []
    assert OnlineTrainer(cfg, log=lines.append).run(1) == 1
    assert not any("recovering" in x for x in lines) and any("round 1:" in x for x in lines)
    assert [r["shard"] for r in ledger(tmp_path / "buffer")] == served["shards"][:1]


def test_killed_trainers_resume_and_train_each_shard_exactly_once(
    tmp_path, monkeypatch, served, mlflow_server, tiny_hf_dir, tiny_drafter_dir
):
    """Four crash windows over the same 2 rounds of data. A: a real `adaflash train` process, kill -9'd during
    round 2's steps, then restarted. B: dies between writing state.json and the ledger commit of round 1, and
    its restart dies again between registering round 1 and moving the champion alias; round 2 dies in retention,
    between the ledger's delete record and the file's removal. Each shard ends up in exactly one finished round,
    committed once, one version per round, and A and B publish identical round-2 weights (a shard trained twice,
    or skipped, would change them). Retention removes exactly the consumed shards it no longer keeps (A keeps the
    newest round, B none), finishes a removal a kill interrupted, and never touches the pending shard."""
    from adaflash.registry import Registry
    from mlflow import MlflowClient

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    shards = served["shards"][:2]  # the third stays pending: max_rounds is 2

    # A: kill -9 mid-round 2, restart
    cmd = [
        sys.executable,
        "-m",
        "adaflash.cli",
        "train",
        "--config",
        str(trainer_config(a, served, mlflow_server, tiny_hf_dir, tiny_drafter_dir, "killed-a")),
    ]
    # a fresh single-process job: not the rank variables init_distributed set in this test process
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    with open(a / "train.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    steps_file = a / "ckpt" / "steps.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if steps_file.exists() and any(json.loads(x)["round"] == 2 for x in steps_file.read_text().splitlines()):
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, (a / "train.log").read_text()[-3000:]
    assert json.loads((a / "ckpt" / "state.json").read_text())["round"] == 1  # killed mid-round 2
    killed_run = {json.loads(x)["run_id"] for x in steps_file.read_text().splitlines() if json.loads(x)["round"] == 2}
    out = subprocess.run(cmd + ["--max-rounds", "1"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "recovering" not in out.stdout and "round 2:" in out.stdout
    assert MlflowClient(mlflow_server).get_run(killed_run.pop()).info.status == "KILLED"
    assert shard_files(a / "buffer") == served["shards"][1:]  # keep_rounds 1: round 1's shard went after round 2

    # B: die after state.json, before the ledger commit of round 1; restart, then round 2
    cfg = load_config(
        trainer_config(b, served, mlflow_server, tiny_hf_dir, tiny_drafter_dir, "killed-b", retention={"keep_rounds": 0}), OnlineConfig
    )
    trainer = OnlineTrainer(cfg, log=lambda _: None)

    def die(*args, **kwargs):
        raise KeyboardInterrupt("killed between state.json and the ledger commit")

    trainer.reader.commit = die
    with pytest.raises(KeyboardInterrupt):
        trainer.run(1)
    assert not (b / "buffer" / "_ledger.jsonl").exists()
    # restart 1 commits round 1's shards, registers it, then dies before moving the champion alias
    with monkeypatch.context() as m:
        m.setattr(Registry, "set_champion", die)
        with pytest.raises(KeyboardInterrupt):
            OnlineTrainer(cfg, log=lambda _: None)
    assert [(r["shard"], r["tag"]) for r in ledger(b / "buffer")] == [(shards[0], 1)]
    assert shard_files(b / "buffer") == served["shards"]  # retention runs once the round is published
    lines = []
    trainer = OnlineTrainer(cfg, log=lines.append)  # restart 2 finds the version by its run: no second one
    assert any("recovering round 1" in x for x in lines)
    reg_b = Registry(mlflow_server, "killed-b")
    assert [v["version"] for v in reg_b.versions()] == ["1"] and reg_b.champion() == "1"
    assert shard_files(b / "buffer") == served["shards"][1:]
    # round 2 dies in retention: its shard is recorded deleted in the ledger but still on disk
    with monkeypatch.context() as m:
        m.setattr(ShardReader, "_remove_consumed", die)
        with pytest.raises(KeyboardInterrupt):
            trainer.run(1)
    assert [r["shard"] for r in ledger(b / "buffer", "delete")] == shards and shard_files(b / "buffer") == served["shards"][1:]
    lines = []
    trainer = OnlineTrainer(cfg, log=lines.append)  # restart 3: the removal is finished, nothing is retrained
    assert shard_files(b / "buffer") == served["shards"][2:] and not any("recovering" in x for x in lines)
    assert trainer._take_round() == served["shards"][2:]  # the next round gets the pending shard only

    for run in (a, b):
        assert [(e["shard"], e["tag"]) for e in ledger(run / "buffer")] == [(shards[0], 1), (shards[1], 2)]
        assert [(h["round"], h["shards"]) for h in history(run / "ckpt")] == [(1, shards[:1]), (2, shards[1:])]
    steps_b = [json.loads(x) for x in (b / "ckpt" / "steps.jsonl").read_text().splitlines()]
    assert [s["round"] for s in steps_b] == [1] * cfg.train.steps_per_update + [2] * cfg.train.steps_per_update
    assert [h["promote"] for h in history(a / "ckpt")] == [h["promote"] for h in history(b / "ckpt")]
    wa = version_weights(Registry(mlflow_server, "killed-a"), "2", tmp_path / "dl")
    wb = version_weights(Registry(mlflow_server, "killed-b"), "2", tmp_path / "dl")
    assert wa.keys() == wb.keys()
    for k in wb:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_a_head_fitted_on_shorter_blocks_is_refused_with_what_to_do(tmp_path, served, mlflow_server, tiny_hf_dir, tiny_drafter_dir):
    """`fit-head --draft-len` heads read L-blocks; the online trainer trains whole-block heads, so it
    says so instead of training one on features it was not fitted on."""
    from adaflash.length_head import LengthHead, LengthHeadConfig, save_length_head

    start = tmp_path / "start"
    shutil.copytree(tiny_drafter_dir, start)
    hidden = json.loads((start / "config.json").read_text())["hidden_size"]
    save_length_head(LengthHead(LengthHeadConfig(hidden_size=hidden, block_size=3)), start, {})
    cfg = load_config(trainer_config(tmp_path, served, mlflow_server, tiny_hf_dir, start, "short-head"), OnlineConfig)
    with pytest.raises(ValueError, match="reads blocks of 3 positions.*without --draft-len"):
        OnlineTrainer(cfg, log=lambda _: None)
