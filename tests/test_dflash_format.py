"""The DFlash checkpoint format (adaflash.dflash_format): export, import, exact round trip, z-lab drafters."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from safetensors.torch import load_file, save_file

from adaflash.dflash_format import MASK_FILE, export_dflash, is_dflash_dir
from adaflash.drafter import load_drafter
from adaflash.engine import Engine
from adaflash.policies import FixedPolicy
from adaflash.request import Request
from adaflash.target import fingerprint


def _identity(target):
    return {"name": "tiny", "fingerprint": fingerprint(target), "vocab_size": 64, "hidden_size": 64, "num_layers": 4}


def _saved(tmp_path, target, vocab=None):
    """A random tiny drafter saved in AdaFlash's format and loaded back (attached to `target`)."""
    identity = _identity(target)
    d = tiny_drafter(target, seed=3)
    d.config.target = identity
    if vocab is not None:
        d.set_vocab(vocab)
    with torch.no_grad():
        d.mask_embedding.normal_()  # a learned mask unlike any token row
    return load_drafter(d.save(tmp_path / "ours", dtype=torch.float32), target, identity), identity


@pytest.mark.parametrize("vocab", [None, torch.tensor([0, 2, 5, 9, 17, 33, 40, 63])])
def test_export_writes_the_dflash_layout_and_reads_back_bit_for_bit(tmp_path, vocab):
    target = tiny_target(0)
    drafter, identity = _saved(tmp_path, target, vocab)
    out = export_dflash(drafter, tmp_path / "dflash", mask_token_id=7)
    meta = json.loads((out / "config.json").read_text())
    assert is_dflash_dir(out) and not is_dflash_dir(tmp_path / "ours")
    assert meta["architectures"] == ["DFlashDraftModel"] and meta["model_type"] == "qwen3"
    assert meta["dflash_config"] == {"block_size": 6, "target_layer_ids": [0, 2], "mask_token_id": 7}
    assert (meta["num_hidden_layers"], meta["num_target_layers"], meta["head_dim"]) == (2, 4, 16)
    names = set(load_file(str(out / "model.safetensors")))
    want = {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.1.self_attn.q_proj.weight",
        "layers.0.self_attn.k_norm.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.1.post_attention_layernorm.weight",
    }
    assert want <= names and "embed_tokens.weight" not in names
    assert ({"lm_head.weight", "d2t"} <= names) == (vocab is not None)
    pt = torch.load(out / MASK_FILE, weights_only=True)  # what vLLM reads
    assert pt["mask_token_id"] == 7 and torch.equal(pt["embedding"], drafter.mask_embedding.detach())

    back = load_drafter(out, target, identity)
    a, b = drafter.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert back.config == drafter.config
    assert (back.vocab is None and vocab is None) or torch.equal(back.vocab, vocab)
    reqs = [Request(f"r{i}", [3 + i, 9, 27, 4], 12) for i in range(3)]
    run = lambda d: [s.out for s in Engine(target, d, FixedPolicy(), []).run(reqs)]  # noqa: E731
    assert run(back) == run(drafter)


def test_a_zlab_drafter_takes_its_mask_from_the_target_embedding_row(tmp_path):
    """A foreign DFlash directory (no AdaFlash section, no mask tensor, HF 'model.' prefixes) loads as
    the same drafter whose mask is the target's embedding row mask_token_id."""
    target = tiny_target(0)
    drafter, identity = _saved(tmp_path, target)
    with torch.no_grad():
        drafter.mask_embedding.copy_(target.model.embed_tokens.weight[11])
    out = export_dflash(drafter, tmp_path / "zlab", mask_token_id=11)
    meta = json.loads((out / "config.json").read_text())
    del meta["adaflash"]
    (out / "config.json").write_text(json.dumps(meta))
    state = load_file(str(out / "model.safetensors"))
    del state["mask_embedding"]
    save_file({"model." + k: v for k, v in state.items()}, str(out / "model.safetensors"))
    (out / MASK_FILE).unlink()
    foreign = load_drafter(out, target, identity)
    a, b = drafter.state_dict(), foreign.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert foreign.config.block_size == 6 and foreign.config.target_layer_ids == [0, 2] and foreign.config.qk_norm


def test_unsupported_dflash_layouts_are_refused(tmp_path):
    target = tiny_target(0)
    drafter, identity = _saved(tmp_path, target)
    out = export_dflash(drafter, tmp_path / "d")
    meta = json.loads((out / "config.json").read_text())
    for change, why in [
        ({"dflash_config": {**meta["dflash_config"], "causal": True}}, "causal"),
        ({"attention_bias": True}, "attention biases"),
    ]:
        (out / "config.json").write_text(json.dumps({**meta, **change}))
        with pytest.raises(ValueError, match=why):
            load_drafter(out, target, identity)
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        export_dflash(drafter, tmp_path / "e", mask_token_id=64)
    other = tiny_target(1)  # another target: the identity recorded in the export refuses it
    (out / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="trained for target"):
        load_drafter(out, other, _identity(other))


def test_export_cli_round_trip_and_usage_errors(tmp_path, tiny_hf_dir, tiny_drafter_dir, capsys):
    from adaflash.cli import main

    out, back = tmp_path / "dflash", tmp_path / "back"
    assert main(["export", str(tiny_drafter_dir), str(out), "--target", str(tiny_hf_dir), "--dtype", "float32"]) == 0
    assert is_dflash_dir(out) and (out / MASK_FILE).exists()
    assert main(["export", str(out), str(back), "--format", "adaflash", "--target", str(tiny_hf_dir), "--dtype", "float32"]) == 0
    a, b = load_file(str(tiny_drafter_dir / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["export", str(tiny_drafter_dir), str(out), "--target", str(tiny_hf_dir)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "x"), "--target", str(tiny_hf_dir)]) == 2


def test_a_draft_length_schedule_reaches_vllms_command_line(tmp_path):
    """`serve --backend vllm` with the cost policy: the schedule becomes vLLM's num_speculative_tokens_per_batch_size,
    its longest K the draft length vLLM sizes its steps by; a schedule not starting at batch 1 is refused."""
    from adaflash.server.vllm_backend import VLLMServer

    from adaflash.dflash_format import dflash_spec

    sched = [(1, 1, 4), (2, 4, 2), (5, 16, 0)]
    server = VLLMServer(
        tmp_path / "python", tmp_path / "target", tmp_path / "drafter", 4, 1234, 2048, 16, 64, "float32", tmp_path / "log",
        schedule=sched,
    )  # fmt: skip
    cmd = server.cmd
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": str(tmp_path / "drafter"), "num_speculative_tokens": 4,
                    "num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 4, 2], [5, 16, 0]]}  # fmt: skip
    assert cmd[cmd.index("--max-num-batched-tokens") + 1] == str(16 * 5)  # 16 sequences x (4 drafts + anchor) > 64
    assert "--scheduler-cls" not in cmd and "ADAFLASH_VLLM_SCHEDULE" not in server.env  # no file: the schedule stays
    follow = VLLMServer(
        tmp_path / "python", tmp_path / "target", tmp_path / "drafter", 4, 1234, 2048, 16, 64, "float32", tmp_path / "log",
        schedule=sched, schedule_file=tmp_path / "schedule.json",
    )  # fmt: skip
    assert follow.cmd[follow.cmd.index("--scheduler-cls") + 1] == "adaflash_schedule.FollowSchedule"
    assert follow.env["ADAFLASH_VLLM_SCHEDULE"] == str(tmp_path / "schedule.json")
    with pytest.raises(ValueError, match="longest draft length, 4"):  # the step's size must be the schedule's
        VLLMServer(
            tmp_path / "python", tmp_path / "target", tmp_path / "drafter", 15, 1234, 2048, 16, 64, "float32", tmp_path / "log",
            schedule=sched,
        )  # fmt: skip
    assert dflash_spec("d", schedule=[(1, 64, 0)])["num_speculative_tokens"] == 1  # vLLM wants >= 1
    with pytest.raises(ValueError, match="from 1"):
        dflash_spec("d", schedule=[(2, 8, 3)])


def test_vllm_rounds_are_exact_or_left_out():
    """vLLM reports only the steps that verified drafts: where they account for the whole output every
    anchor is exact; where some steps decoded plainly (0 drafts at a bigger batch) no anchor is known (None: the
    row is written without rounds and counted in `rows_inexact`)."""
    from adaflash.server.vllm_backend import _rounds

    spec = {"per_step_accepted": [2, 0, 3], "per_step_drafted": [4, 4, 2]}
    rounds = _rounds(10, 1 + 3 + 1 + 4, spec)
    assert [(r.anchor, r.accepted, r.verify_len) for r in rounds] == [(10, 2, 5), (13, 0, 5), (14, 3, 3)]
    assert _rounds(10, 1 + 3 + 1 + 2, spec)[-1].anchor == 14  # stopped inside the last step: still exact
    assert _rounds(10, 1 + 3 + 1 + 4 + 2, spec) is None  # two plain steps somewhere: no anchors


def test_the_vllm_backend_drafts_by_batch_size_under_auto_on_a_cpu():
    """`auto` on the vLLM backend is the cost policy's schedule when the target is on a CPU (as on the builtin
    engine); fixed / fixedK keep one draft length."""
    from types import SimpleNamespace

    from adaflash.server.vllm_backend import vllm_policy

    target = SimpleNamespace(model=tiny_target())
    assert vllm_policy("auto", target) == vllm_policy("cost", target) == "cost"
    assert vllm_policy("fixed", target) == vllm_policy("fixed4", target) == "fixed"


def test_a_hot_swap_into_vllm_puts_the_priors_schedule_back(tmp_path):
    """`serve --backend vllm --policy cost`: the traffic moved the schedule; a swapped-in version is a new drafter,
    so the schedule goes back to the prior's (the traffic's steps measured the old one), vLLM gets the file, and the
    stats say it. The child vLLM is a stand-in here (tests/test_vllm.py swaps into a real one)."""
    from types import SimpleNamespace

    from adaflash.server.vllm_backend import ScheduleFollower, VLLMEngine
    from test_policy_cost import linear_cost

    target = tiny_target()
    drafter = tiny_drafter(target)
    calls = []
    follower = ScheduleFollower(linear_cost(), [0.5] * (drafter.block_size - 1), 8, tmp_path / "schedule.json", every=1)
    start = follower.schedule
    server = SimpleNamespace(
        name="vLLM", num_spec=follower.k_max, rpc=lambda *a: calls.append(a) or ["ok"], reset_prefix_cache=lambda: calls.append("reset")
    )
    engine = VLLMEngine(server, drafter, "1", 8, 64, 512, tmp_path, 15, start, follower)
    assert engine.policy.name == "vllm-cost" and engine.k_blk == follower.k_max + 1
    spec = {"per_step_drafted": [follower.k_max] * 20, "per_step_accepted": [0] * 20}
    for i in range(8):  # traffic that accepts nothing: fewer drafts
        engine._follow(follower.observe(spec, 20, 16, running=1 + i))
    moved = engine.stats["schedule"]
    assert moved != start and engine.stats["schedule_updates"] == follower.updates >= 1
    engine.swap(tiny_drafter(target, seed=1), None, "2")
    assert calls[0][0] == "adaflash_load_draft" and calls[1] == "reset"
    assert engine.stats["schedule"] == follower.schedule == start and engine.stats["schedule_updates"] == follower.updates
    assert "version 2" in json.loads((tmp_path / "schedule.json").read_text())["tag"]
