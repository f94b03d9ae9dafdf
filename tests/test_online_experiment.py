"""The online-learning measurements end to end on the tiny target: the domain-shift experiment (engine ->
buffer -> OPD/OSD trainer -> MLflow registry -> held-out serving, per arm and round) and the hot-swap
bench (a real in-process server, streaming clients, a champion move on a real mlflow server)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from adaflash.experiments.loss_replay import Replay, ReplayConfig
from adaflash.experiments.online_experiment import Experiment, ExperimentConfig, dir_digest
from adaflash.experiments.swap_bench import SwapConfig, run_swap_bench

from adaflash.config import ConfigError, from_dict, load_config

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and lose ~10x when another job holds a core."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompt_sets(tmp_path_factory) -> Path:
    from adaflash.pipelines.prompts import build_prompt_sets

    out = tmp_path_factory.mktemp("prompts")
    build_prompt_sets(out, ["humaneval", "code"])
    return out


def tiny_config(name: str, tmp_path: Path, paths: dict, cls):
    """tests/configs/<name> with this test's paths -> typed config."""
    text = (REPO / "tests" / "configs" / name).read_text()
    for placeholder, value in paths.items():
        text = text.replace(placeholder, str(value))
    path = tmp_path / name
    path.write_text(text)
    return load_config(path, cls)


def test_head_error_r2_is_the_share_of_label_variance_explained():
    from adaflash.experiments.online_experiment import head_error

    labels = [0.0625, 0.125, 0.0625, 0.25]
    perfect, mean = head_error([(y, y) for y in labels]), head_error([(0.125, y) for y in labels])
    assert perfect["head_r2"] == 1.0 and perfect["head_mae"] == 0.0 and abs(mean["head_r2"]) < 1e-9
    assert head_error([(0.5, y) for y in labels])["head_r2"] < 0 and head_error([])["head_mae"] is None


def test_probe_scores_the_starting_head_on_the_same_blocks(tiny_hf_dir, tiny_drafter_dir):
    import torch
    from adaflash.experiments.online_experiment import ProbePolicy, Prompt, ServeSection, Slot, serve

    from adaflash.drafter import load_drafter
    from adaflash.length_head import LengthHead, LengthHeadConfig
    from adaflash.target import load_target

    target = load_target(str(tiny_hf_dir), "float32")
    drafter = load_drafter(tiny_drafter_dir, target.model, target.identity, torch.float32)
    heads = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        heads.append(LengthHead(LengthHeadConfig(hidden_size=drafter.config.hidden_size, block_size=drafter.block_size)).eval())
    slot = Slot(tiny_drafter_dir, drafter, heads[0], "1", "fp")
    prompts = [Prompt(f"p{i}", "code", target.encode_chat(f"Write function number {i}.")) for i in range(3)]
    sc = ServeSection(drafter_dtype="float32", max_batch=3, token_budget=512)
    _, same = serve(target, slot, ProbePolicy(heads[0]), prompts, 20, sc, "a", "same")
    _, other = serve(target, slot, ProbePolicy(heads[1]), prompts, 20, sc, "b", "other")
    assert same["head_blocks"] == same["start_head_blocks"] > 0 and same["start_head_mae"] == same["head_mae"]
    assert other["head_mae"] == same["head_mae"] and other["start_head_mae"] != other["head_mae"]
    assert "start_head_mae" not in serve(target, slot, ProbePolicy(), prompts, 20, sc, "c", "none")[1]


def test_committed_configs_load_and_bad_trainer_keys_are_refused():
    assert load_config(REPO / "configs" / "experiment_domain_shift.yaml", ExperimentConfig).arms == ["opd", "osd", "head", "none"]
    assert load_config(REPO / "configs" / "experiment_swap.yaml", SwapConfig).max_ratio == 1.5
    with pytest.raises(ConfigError, match=r"buffer.dir.*set by the experiment"):
        from_dict(ExperimentConfig, {"trainer": {"buffer": {"dir": "x"}}})
    with pytest.raises(ConfigError, match="arms must be distinct"):
        from_dict(ExperimentConfig, {"arms": ["opd", "opd"]})
    replay = load_config(REPO / "configs" / "experiment_replay.yaml", ReplayConfig)
    assert list(replay.loss_sections) == ["osd", "opd"] and replay.loss_sections["opd"].clip_mode == "vocab"
    with pytest.raises(ConfigError, match=r"losses.h.kind must be 'opd' or 'osd'"):
        from_dict(ReplayConfig, {"losses": {"h": {"kind": "head"}}})
    with pytest.raises(ConfigError, match=r"losses.x: unknown key\(s\) \['alpah'\]"):
        from_dict(ReplayConfig, {"losses": {"x": {"alpah": 0.5}}})
    with pytest.raises(ConfigError, match=r"train.seed .* list the seeds under `seeds`"):
        from_dict(ReplayConfig, {"train": {"seed": 3}})


def test_domain_shift_rounds_train_publish_and_measure(tmp_path, tiny_hf_dir, tiny_drafter_dir, prompt_sets, mlflow_server):
    paths = {
        "PATH-TO-TINY-TARGET": tiny_hf_dir,
        "PATH-TO-TINY-DRAFTER": tiny_drafter_dir,
        "PATH-TO-PROMPT-SETS": prompt_sets,
        "PATH-TO-MLFLOW": mlflow_server,
    }
    cfg = tiny_config("experiment_domain_shift_tiny.yaml", tmp_path, paths, ExperimentConfig)
    out = tmp_path / "out"
    lines = []
    res = Experiment(cfg, out, log=lines.append).run()

    rows = {(r["arm"], r["round"]): r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert set(rows) == {(a, r) for a in ("opd", "osd", "head", "none") for r in range(3)}
    start = dir_digest(tiny_drafter_dir)
    for arm in ("opd", "osd", "head", "none"):
        assert rows[arm, 0]["heldout_tau"] == rows["none", 0]["heldout_tau"] >= 1.0  # one shared starting point
        assert rows[arm, 0]["fingerprint"] == start and rows[arm, 0]["rows_trained"] == 0
        assert rows[arm, 1]["served_tau"] >= 1.0 and rows[arm, 2]["minutes"] > rows[arm, 1]["minutes"] > 0
    for arm in ("opd", "osd", "head"):
        assert all(rows[arm, r]["rows_trained"] > 0 and rows[arm, r]["promoted"] for r in (1, 2))
        fps = [rows[arm, r]["fingerprint"] for r in range(3)]
        assert len(set(fps)) == 3  # every promoted round changes the weights served
        assert [rows[arm, r]["drafter_version"] for r in range(3)] == ["start", "1", "2"]
        assert rows[arm, 2]["traffic_policy"] == "head" and rows[arm, 2]["head_mae"] is not None  # its trained head
        ledger = [json.loads(x) for x in (out / "arms" / arm / "buffer" / "_ledger.jsonl").read_text().splitlines()]
        assert [(e["shard"].split("-0")[0], e["tag"]) for e in ledger] == [(f"{arm}-round1", 1), (f"{arm}-round2", 2)]
    assert rows["opd", 2]["fingerprint"] != rows["osd", 2]["fingerprint"]
    # head-only updates: new heads, the drafter served as it was (greedy serving: the same held-out tau)
    assert rows["head", 1]["heldout_tau"] == rows["head", 2]["heldout_tau"] == rows["none", 0]["heldout_tau"]
    assert any(x.startswith("Head (head): held-out MAE") for x in lines)
    assert all(rows["none", r]["fingerprint"] == start and rows["none", r]["rows_trained"] == 0 for r in range(3))
    assert rows["none", 1]["traffic_policy"] == "fixed" and rows["none", 1]["head_mae"] is None  # no head ever
    assert rows["none", 2]["traffic_head_mae"] is None and "traffic_head_mae" in rows["opd", 2]
    assert not (out / "arms" / "none" / "buffer").exists() or not list((out / "arms" / "none").rglob("_ledger.jsonl"))
    for f in ("report.md", "tau_per_round.png", "head_error_per_round.png", "head_r2_per_round.png"):
        assert (out / f).stat().st_size > 0
    assert res["gate"]["opd_ge_osd"] in (True, False) and any(x.startswith("Gate: OPD held-out tau") for x in lines)

    # resume after losing opd's round-2 row: rebuilt from what the trainer and the served log hold, not retrained
    kept = (out / "rows.jsonl").read_text().splitlines()
    (out / "rows.jsonl").write_text("\n".join(x for x in kept if json.loads(x)["arm"] != "opd" or json.loads(x)["round"] < 2) + "\n")
    Experiment(cfg, out, log=lines.append).run()
    again = {(r["arm"], r["round"]): r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert again.keys() == rows.keys()
    assert {k: v for k, v in again["opd", 2].items() if k != "minutes"} == {k: v for k, v in rows["opd", 2].items() if k != "minutes"}
    # then one more round for opd only: served by the champion the run had reached, trained once
    cfg.rounds, cfg.arms = 3, ["opd"]
    Experiment(cfg, out, log=lines.append).run()
    again = {(r["arm"], r["round"]): r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert again.keys() == rows.keys() | {("opd", 3)}
    assert [json.loads(x)["round"] for x in (out / "arms" / "opd" / "ckpt" / "rounds.jsonl").read_text().splitlines()] == [1, 2, 3]
    (shard,) = (out / "arms" / "opd" / "buffer").glob("opd-round3-*.parquet")
    assert set(pq.read_table(shard).column("drafter_version").to_pylist()) == {"2"}
    assert again["opd", 3]["drafter_version"] == "3" and again["opd", 3]["minutes"] > again["opd", 2]["minutes"]


def test_loss_replay_compares_losses_over_seeds_and_leaves_the_buffer_as_it_was(tmp_path, tiny_hf_dir, tiny_drafter_dir, prompt_sets):
    import torch
    from adaflash.pipelines.prompts import read_prompts

    from adaflash.buffer import ShardWriter
    from adaflash.drafter import load_drafter
    from adaflash.engine import Engine
    from adaflash.policies import FixedPolicy
    from adaflash.request import Request
    from adaflash.target import load_target

    t = load_target(str(tiny_hf_dir), "float32")
    drafter = load_drafter(tiny_drafter_dir, t.model, t.identity, torch.float32)
    recs = read_prompts(prompt_sets / "train.parquet", ["code"])[:10]
    buf = tmp_path / "buffer"
    for r in (1, 2):  # two rounds of served traffic, a shard each
        engine = Engine(t.model, drafter, FixedPolicy(), t.eos_ids, max_batch=5, token_budget=2048)
        done = engine.run([Request(f"r{r}-{x.prompt_id}", t.encode_chat(x.messages), 20, domain="code") for x in recs[(r - 1) * 5 : r * 5]])
        writer = ShardWriter(buf, f"round{r}", rows_per_shard=10**9, max_age_s=None)
        writer.extend(engine.trajectory(s, f"round{r}") for s in done)
        writer.close()
    (buf / "torn.parquet").write_bytes(b"PAR1 cut short")
    before = {p.name: p.stat().st_mtime_ns for p in buf.iterdir()}
    paths = {
        "PATH-TO-TINY-TARGET": tiny_hf_dir,
        "PATH-TO-TINY-DRAFTER": tiny_drafter_dir,
        "PATH-TO-PROMPT-SETS": prompt_sets,
        "PATH-TO-BUFFER": buf,
    }
    cfg = tiny_config("experiment_replay_tiny.yaml", tmp_path, paths, ReplayConfig)
    out, lines = tmp_path / "out", []
    res = Replay(cfg, out, log=lines.append).run()

    runs = {(r["loss"], r["seed"]): r for r in res["runs"]}
    assert set(runs) == {(n, s) for n in ("osd", "opd") for s in (0, 1)}
    assert len({r["tau"][0] for r in runs.values()}) == 1  # one starting drafter, measured once
    assert all(len(r["tau"]) == 3 and min(r["tau"]) >= 1.0 and len(r["train_loss"]) == 2 for r in runs.values())
    assert len({r["weights"] for r in runs.values()}) == 4  # each loss and each seed trains its own way
    assert any(x.startswith("[replay] skipping torn.parquet: unreadable") for x in lines)
    assert {p.name: p.stat().st_mtime_ns for p in buf.iterdir()} == before  # read only: nothing consumed or moved
    assert res["verdicts"][0].startswith("opd - osd, final round, same seed:")
    assert len(res["summary"]["opd"]["vs_osd"]["final_diff"]) == 2
    for f in ("report.md", "tau_per_round.png", "eval_answers.json"):
        assert (out / f).stat().st_size > 0

    # resumed: finished (loss, seed) pairs are kept, not redone
    resumed = Replay(cfg, out, log=lines.append)
    again = resumed.run()
    assert resumed.rounds == []  # nothing left to do: the buffer is not even read
    assert [(r["loss"], r["seed"], r["weights"]) for r in again["runs"]] == [(r["loss"], r["seed"], r["weights"]) for r in res["runs"]]
    # deterministic: one pair replayed from scratch trains the same weights
    cfg.losses, cfg.seeds = {"opd": cfg.losses["opd"]}, [1]
    cfg.__post_init__()
    (one,) = Replay(cfg, tmp_path / "one", log=lines.append).run()["runs"]
    assert one["weights"] == runs["opd", 1]["weights"] and one["tau"] == runs["opd", 1]["tau"]

    # held-out tau scores the drafts as served: with a one-token draft vocabulary every draft is that token
    from adaflash.trainer.data import eval_items, make_batch

    rp = Replay(cfg, out, log=lines.append)
    rp._prepare()
    batch = make_batch(eval_items(rp.eval, rp.k_blk, 10**6), rp.k_blk)
    nxt = batch["tgt_next"][batch["full"]]  # [N, K-1]: the target's next tokens at every full block
    tok = int(nxt[:, 0].mode().values)
    one_token = rp._drafter()
    one_token.set_vocab([tok])
    expect = 1 + float((nxt == tok).long().cumprod(-1).sum(-1).float().mean())  # > 1: tok starts a block
    assert expect > 1 and rp.heldout_tau(one_token) == pytest.approx(expect)


def test_swap_under_load_fails_no_request(tmp_path, tiny_hf_dir, tiny_drafter_dir, prompt_sets, mlflow_server):
    paths = {
        "PATH-TO-TINY-TARGET": tiny_hf_dir,
        "PATH-TO-TINY-DRAFTER": tiny_drafter_dir,
        "PATH-TO-PROMPT-SETS": prompt_sets,
        "PATH-TO-MLFLOW": mlflow_server,
    }
    cfg = tiny_config("experiment_swap_tiny.yaml", tmp_path, paths, SwapConfig)
    res = run_swap_bench(cfg, tmp_path / "swap", log=lambda _: None)
    assert res["failed"] == 0, res["errors"]
    assert res["swapped"] and res["v2"] != res["v1"] and res["server_registry"]["swaps"] == 1
    assert res["requests_by_version"].get(res["v1"], 0) > 0 and res["requests_by_version"].get(res["v2"], 0) > 0
    assert 0 < res["swap_live_s"] < 30 and res["itl"]["before"]["gaps"] > 0 and res["itl"]["during"]["gaps"] > 0
    saved = json.loads((tmp_path / "swap" / "swap.json").read_text())
    assert saved["failed"] == 0 and "inter-token p50" in (tmp_path / "swap" / "swap.md").read_text()
