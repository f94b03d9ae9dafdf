"""The offline pretraining pipeline end to end on a tiny random target: every stage runs for real
(Parquet shards, DeepSpeed engine steps, safetensors export, evaluation) and resumes."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
from adaflash.pipelines.pretrain import AnswerSet, PretrainConfig, run_stages

from adaflash.config import ConfigError, from_dict, load_config, to_dict
from adaflash.policies import FixedPolicy
from adaflash.recipe import block_labels


def tiny_config(tmp_path, source: str, max_steps: int) -> PretrainConfig:
    return from_dict(
        PretrainConfig,
        {
            "run_dir": str(tmp_path / "run"),
            "drafter_out": str(tmp_path / "drafter"),
            "target": {"source": source},
            "regen": {"domains": ["gsm8k", "code"], "batch_size": 3, "max_new_tokens": 12, "dtype": "float32", "limit_per_domain": 3},
            "drafter": {"num_layers": 1, "block_size": 4},
            "train": {"seqs_per_step": 2, "anchors_per_seq": 3, "max_steps": max_steps, "save_every": 2, "autocast_bf16": False},
            "eval": {"domains": ["gsm8k"], "per_domain": 1, "max_new_tokens": 8, "verify_lens": [4, 2], "trees": [3], "lookup": [0, 2]},
        },
    )


def test_pipeline_end_to_end_and_resume(tmp_path, tiny_hf_dir):
    cfg = tiny_config(tmp_path, str(tiny_hf_dir), max_steps=2)
    run_stages(cfg, ["prompts", "regenerate"])
    answers = sorted((tmp_path / "run" / "answers").glob("answers-*.parquet"))
    rows = [r for f in answers for r in pq.read_table(f).to_pylist()]
    assert len(rows) == 6 and {r["domain"] for r in rows} == {"gsm8k", "code"}
    assert all(1 <= len(r["response_ids"]) <= 12 for r in rows)

    run_stages(cfg, ["regenerate"])  # nothing left to answer: no new shard
    assert sorted((tmp_path / "run" / "answers").glob("answers-*.parquet")) == answers
    assert {r["domain"] for r in AnswerSet(tmp_path / "run" / "answers", ["code"]).rows} == {"code"}
    with pytest.raises(FileNotFoundError, match="domains"):
        AnswerSet(tmp_path / "run" / "answers", ["aime"])

    code_only = tiny_config(tmp_path, str(tiny_hf_dir), max_steps=1)  # reuses the answers, fresh run_dir
    code_only.run_dir, code_only.answers_dir, code_only.train.domains = (
        str(tmp_path / "run-code"),
        str(tmp_path / "run" / "answers"),
        ["code"],
    )
    run_stages(code_only, ["train"])
    assert (tmp_path / "run-code" / "checkpoints" / "latest").exists()

    run_stages(cfg, ["train"])
    cfg.train.max_steps = 4
    run_stages(cfg, ["train"])  # resumes from the step-2 DeepSpeed checkpoint
    log = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in log)

    out = run_stages(cfg, ["export", "eval"])
    meta = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert meta["training"]["steps"] == 4 and meta["block_size"] == 4
    report = json.loads((tmp_path / "drafter" / "eval.json").read_text())
    for variant in ("dflash-v4", "dflash-v2", "dflash-tree3", "dflash-tree3-lookup2"):
        v = report["domains"]["gsm8k"]["variants"][variant]
        assert v["identical_greedy"] == 1
        assert len(v["accepted_at_least"]) == 3 and v["accepted_at_least"] == sorted(v["accepted_at_least"], reverse=True)
        assert out["eval"]["gsm8k"][variant]["tau"] >= 1.0
    assert (tmp_path / "drafter" / "accept_by_position.png").stat().st_size > 1000
    assert (tmp_path / "run" / "training.png").exists()


def test_sampled_answers_without_features_train_on_recomputed_features(tmp_path, tiny_hf_dir, monkeypatch):
    """The GPU recipe (configs/pretrain_smollm2_gpu.yaml) on the CPU: greedy + sampled answers stored
    as token ids only, training recomputes the target features each step; regeneration and training
    of one dtype share one target load."""
    import adaflash.pipelines.pretrain as pretrain
    from adaflash.pipelines.pretrain import sample_batch, target_features

    from adaflash.target import load_target

    stored = tiny_config(tmp_path, str(tiny_hf_dir), max_steps=1)
    stored.regen.limit_per_domain = 2
    run_stages(stored, ["prompts", "regenerate"])
    data = AnswerSet(tmp_path / "run" / "answers")
    batch = sample_batch(data, [0, 1], 2, random.Random(0))
    target = load_target(str(tiny_hf_dir), "float32")
    again = target_features(target, batch["tokens"], batch["lengths"])  # [B, T, n*H]
    for b in range(2):
        n = int(batch["lengths"][b]) - 1  # regeneration stores the features of every token fed (all but the last)
        torch.testing.assert_close(again[b, :n], batch["feats"][b, :n].float(), atol=2e-2, rtol=2e-2)  # stored in bf16

    cfg = tiny_config(tmp_path / "gpu-style", str(tiny_hf_dir), max_steps=2)
    cfg.regen.limit_per_domain, cfg.regen.samples, cfg.regen.temperature = 2, 2, 1.0
    cfg.regen.store_features, cfg.train.features = False, "target"
    loads = []
    monkeypatch.setattr(pretrain, "load_target", lambda *a, **k: loads.append(a[1]) or load_target(*a, **k))
    run_stages(cfg, ["prompts", "regenerate", "train"])
    assert loads == ["float32"]  # both stages run float32 here: one load
    answers = tmp_path / "gpu-style" / "run" / "answers"
    rows = [r for f in sorted(answers.glob("answers-*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert not list(answers.glob("*.features.safetensors"))
    assert len(rows) == 4 * 3 and {r["feat_offset"] for r in rows} == {-1}
    greedy = {r["prompt_id"]: r for r in rows if r["temperature"] == 0}
    sampled = [r for r in rows if r["temperature"] == 1.0]
    assert len(greedy) == 4 and {r["prompt_id"].rsplit("#s", 1)[0] for r in sampled} == set(greedy)
    assert all(r["prompt_ids"] == greedy[r["prompt_id"].rsplit("#s", 1)[0]]["prompt_ids"] for r in sampled)
    assert any(r["response_ids"] != greedy[r["prompt_id"].rsplit("#s", 1)[0]]["response_ids"] for r in sampled)
    log = [json.loads(x) for x in (tmp_path / "gpu-style" / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and all(torch.isfinite(torch.tensor(r["loss"])) for r in log)
    with pytest.raises(FileNotFoundError, match="train.features: target"):
        AnswerSet(answers)
    shards = sorted(answers.glob("answers-*.parquet"))
    run_stages(cfg, ["regenerate"])  # every answer, sampled ones included, is done: no new shard
    assert sorted(answers.glob("answers-*.parquet")) == shards
    with pytest.raises(ConfigError, match="train.features must be 'target'"):
        from_dict(PretrainConfig, {"regen": {"store_features": False}})
    with pytest.raises(ConfigError, match="at least one of verify_lens"):
        from_dict(PretrainConfig, {"eval": {"verify_lens": [], "trees": []}})
    with pytest.raises(ConfigError, match="prompt-lookup branch lengths"):
        from_dict(PretrainConfig, {"eval": {"trees": [8], "lookup": [-1]}})


def test_regeneration_batches_respect_the_token_budget():
    from adaflash.pipelines.regenerate import batches

    assert batches([1, 2, 3, 4, 5, 10, 10, 20], 3, 20) == [(0, 3), (3, 5), (5, 7), (7, 8)]
    assert batches([1, 2, 3], 8, None) == [(0, 3)]
    assert batches([50], 4, 20) == [(0, 1)]  # a prompt longer than the budget still gets its own batch


def test_engine_regeneration_matches_padded_decoding(tiny_hf_dir):
    """On a CPU regeneration runs the serving engine's plain decoding (continuous batching, no padding);
    its greedy answers are padded batched decoding's token for token, and the features it keeps for
    every fed token (the prompt, then all but the last answer token) are the same hidden states."""
    from adaflash.pipelines.regenerate import answer_batch

    from adaflash.engine import Engine
    from adaflash.policies import ARPolicy
    from adaflash.request import Request
    from adaflash.target import load_target

    target = load_target(str(tiny_hf_dir), "float32")
    prompts = [[1, 5, 9, 2], [3, 3, 7, 8, 1, 4, 6], [2], [9, 8, 7, 6, 5]]
    padded = answer_batch(target, prompts, 10)
    engine = Engine(target.model, None, ARPolicy(), target.eos_ids, max_batch=3, keep_features=True)  # 3 slots, 4 prompts
    states = engine.run([Request(f"p{i}", p, 10) for i, p in enumerate(prompts)])
    for (resp, fin, feats), st, p in zip(padded, states, prompts):
        assert st.out == resp and (st.finish_reason == "stop") == fin
        assert st.features.shape == (len(p) + len(resp) - 1, feats.shape[1])
        torch.testing.assert_close(st.features, feats, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="plain-decoding policy"):
        Engine(target.model, None, FixedPolicy(2), target.eos_ids, keep_features=True)


def test_block_labels():
    tokens = torch.arange(10)[None]
    labels, valid = block_labels(tokens, torch.tensor([[2, 7, -1]]), torch.tensor([9]), 4)
    assert labels[0, 0].tolist() == [3, 4, 5]
    assert valid[0, 1].tolist() == [True, False, False]  # positions 8 (ok), 9 and 10 are past the end
    assert not valid[0, 2].any()


def test_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_step: 3\n")
    with pytest.raises(ConfigError, match="unknown key.*max_step.*valid keys"):
        load_config(bad, PretrainConfig)
    bad.write_text("train:\n  max_steps: lots\n")
    with pytest.raises(ConfigError, match="max_steps: expected int"):
        load_config(bad, PretrainConfig)
    bad.write_text("train:\n  warmup_frac: 1.5\n")
    with pytest.raises(ConfigError, match="warmup_frac"):
        load_config(bad, PretrainConfig)
    bad.write_text("train:\n  vocab: some\n")
    with pytest.raises(ConfigError, match=r"train.vocab must be one of \('draft', 'full'\)"):
        load_config(bad, PretrainConfig)
    bad.write_text(f"drafter:\n  draft_vocab: {tmp_path}\n")
    with pytest.raises(ConfigError, match="draft_vocab.safetensors is missing"):
        load_config(bad, PretrainConfig)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", PretrainConfig)


@pytest.mark.parametrize(
    "name", ["pretrain_smollm2.yaml", "pretrain_smollm2_nocode.yaml", "pretrain_smollm2_gpu.yaml", "pretrain_smollm2_gpu_continue.yaml"]
)
def test_shipped_config_is_valid(name):
    from pathlib import Path

    cfg = load_config(Path(__file__).parent.parent / "configs" / name, PretrainConfig)
    assert cfg.drafter.block_size == 16 or (cfg.drafter.continues and cfg.drafter.block_size is None)  # a continuation keeps its init's


def test_init_from_target_copies_last_layers(tiny_hf_dir):
    from adaflash.pipelines.drafter_start import init_from_target

    from adaflash.drafter import Drafter, DrafterConfig
    from adaflash.target import load_target

    t = load_target(str(tiny_hf_dir), "float32")
    d = Drafter(DrafterConfig.for_target(t.model, t.identity, num_layers=2, block_size=4, qk_norm=False), t.model)
    init_from_target(d, t)
    torch.testing.assert_close(d.layers[1].mlp.up_proj.weight, t.model.model.layers[-1].mlp.up_proj.weight)
    torch.testing.assert_close(d.layers[0].self_attn.q_proj.weight, t.model.model.layers[-2].self_attn.q_proj.weight)
    feats = torch.randn(1, 3, d.fc.in_features)
    torch.testing.assert_close(d.fc(feats), feats[..., -64:])
    with pytest.raises(ConfigError, match="init must be"):
        from_dict(PretrainConfig, {"drafter": {"init": "magic"}})


def test_ranks_train_on_disjoint_sequences_and_launchers_run_train_only(tmp_path, monkeypatch):
    """Under a launcher each rank takes its own slice of the step's global batch (world 1 = the plain
    slice, so single-process resumes are unchanged); other stages refuse to run once per rank."""
    from adaflash.pipelines.pretrain import rank_batch

    order = list(range(40))
    assert rank_batch(order, 2, 4, 0, 1) == order[8:12]
    seen = [i for idx in range(5) for rank in range(2) for i in rank_batch(order, idx, 4, rank, 2)]
    assert sorted(seen) == order  # 5 steps x 2 ranks x 4 = the whole epoch, each sequence once
    assert rank_batch(order, 0, 4, 0, 2) != rank_batch(order, 0, 4, 1, 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = from_dict(PretrainConfig, {"run_dir": str(tmp_path / "run"), "drafter_out": str(tmp_path / "d")})
    with pytest.raises(ValueError, match="run only `--stage train`"):
        run_stages(cfg, ["prompts", "train"])


def test_two_ranks_over_gloo_run_the_train_stage(tmp_path, tiny_hf_dir):
    """The same `adaflash pretrain --stage train` under a launcher (torchrun, 2 CPU ranks over gloo):
    both ranks step together, rank 0 logs and writes the exportable weights."""
    import yaml

    cfg = tiny_config(tmp_path, str(tiny_hf_dir), max_steps=3)
    run_stages(cfg, ["prompts", "regenerate"])
    path = tmp_path / "pretrain.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "adaflash.cli",
        "pretrain",
        "--config",
        str(path),
        "--stage",
        "train",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    log = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]  # one line per step: rank 0 only
    assert (tmp_path / "run" / "checkpoints" / "step3" / "drafter.safetensors").exists()
    run_stages(cfg, ["export"])
    assert json.loads((tmp_path / "drafter" / "config.json").read_text())["training"]["steps"] == 3


def test_gpu_continue_recipe_keeps_mtbench_unseen_and_its_scripts_parse(tmp_path):
    """configs/pretrain_smollm2_gpu_continue.yaml trains on every domain but MT-Bench, which its gate
    measures as a domain nothing trained on; scripts/gpu_pack.sh and scripts/gpu_pretrain.sh (the
    one-call GPU recipe) parse, and the latter explains itself when called without a verb."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).parent.parent
    cfg = load_config(root / "configs" / "pretrain_smollm2_gpu_continue.yaml", PretrainConfig)
    assert "mtbench" not in cfg.regen.domains and "mtbench" in cfg.eval.domains
    assert cfg.drafter.continues and cfg.train.features == "target" and cfg.gate is not None
    assert cfg.magpie is not None and cfg.magpie.base == "data/magpie"  # new prompts first, after the committed ones
    for script in ("gpu_pack.sh", "gpu_pretrain.sh"):
        subprocess.run(["bash", "-n", str(root / "scripts" / script)], check=True)
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "ADAFLASH_GPU_STASH": str(tmp_path / "stash")}
    usage = subprocess.run(["bash", str(root / "scripts" / "gpu_pretrain.sh")], capture_output=True, text=True, env=env)
    assert usage.returncode == 2 and "stash" in usage.stdout and "run" in usage.stdout


def test_regeneration_answers_every_prompt_greedily_before_any_sample():
    """A time-limited regeneration cuts the last answers: they are sampled ones, and within a round the
    same share of every domain, not a whole domain of long prompts (each domain shortest first)."""
    from collections import namedtuple

    from adaflash.pipelines.regenerate import answer_order, batches

    rec = namedtuple("Rec", "prompt_id domain")
    recs = [rec("long#1", "code"), rec("short", "code")]
    jobs = [(r, f"{r.prompt_id}#s{j}" if j else r.prompt_id, 0.8 if j else 0.0) for r in recs for j in range(3)]
    order = [answer_id for _, answer_id, _ in answer_order(jobs, {"long#1": 900, "short": 20})]
    assert order == ["short", "long#1", "short#s1", "long#1#s1", "short#s2", "long#1#s2"]
    # many short chat prompts and a few long code ones: a cut after half the greedy round keeps half of each
    chat = [rec(f"c{i}", "chat") for i in range(8)]
    code = [rec(f"k{i}", "code") for i in range(2)]
    lens = {**{r.prompt_id: 10 + i for i, r in enumerate(chat)}, **{r.prompt_id: 500 + i for i, r in enumerate(code)}}
    order = answer_order([(r, r.prompt_id, 0.0) for r in chat + code], lens)
    first = [r.domain for r, _, _ in order[:5]]
    assert first.count("code") == 1 and [r.prompt_id for r, _, _ in order if r.domain == "chat"] == [f"c{i}" for i in range(8)]
    # batches keep the padded size within budget whatever the order (count x the longest so far)
    assert batches([10, 500, 11, 12], 4, 1000) == [(0, 2), (2, 4)]
