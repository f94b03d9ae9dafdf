"""Continual pretraining on a tiny random target: training starts from an existing drafter (a directory
or a registry version) with its weights, shape and draft vocabulary, a drafter that does not fit is
refused, and the gate replaces the current drafter only when the candidate's tau is higher on every
domain (`decide` on hand-made tau tables; the gate stage end to end on the tiny model)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from adaflash.pipelines.drafter_start import start_drafter
from adaflash.pipelines.gate import GateSection, decide, install_drafter
from adaflash.pipelines.pretrain import PretrainConfig, run_stages
from safetensors.torch import load_file

from adaflash.config import ConfigError, from_dict
from adaflash.drafter import Drafter, DrafterConfig, load_drafter
from adaflash.target import load_target


def drafter_dir(target, out, seed=0, vocab=None, num_layers=1):
    """A random drafter (block 4) for the tiny target saved in fp32, optionally with a draft vocabulary."""
    torch.manual_seed(seed)
    d = Drafter(DrafterConfig.for_target(target.model, target.identity, num_layers=num_layers, block_size=4), target.model)
    if vocab is not None:
        d.set_vocab(vocab)
    return d.save(out, dtype=torch.float32)


def continue_config(tmp_path, source: str, init: str, max_steps: int, **drafter) -> PretrainConfig:
    return from_dict(
        PretrainConfig,
        {
            "run_dir": str(tmp_path / "run"),
            "drafter_out": str(tmp_path / "candidate"),
            "target": {"source": source},
            "regen": {"domains": ["gsm8k"], "batch_size": 4, "max_new_tokens": 12, "dtype": "float32", "limit_per_domain": 4},
            "drafter": {"init": init, **drafter},
            "train": {"seqs_per_step": 2, "anchors_per_seq": 4, "max_steps": max_steps, "save_every": 1, "autocast_bf16": False},
            "eval": {"domains": ["gsm8k", "humaneval"], "per_domain": 2, "max_new_tokens": 16, "verify_lens": [4]},
        },
    )


@pytest.fixture(scope="module")
def target(tiny_hf_dir):
    return load_target(str(tiny_hf_dir), "float32")


def test_decide_replaces_only_when_every_domain_improves():
    assert decide({"gsm8k": 2.0, "chat": 1.5}, {"gsm8k": 2.1, "chat": 1.6}) == (
        True,
        ["gsm8k: tau 2.000 -> 2.100 (better)", "chat: tau 1.500 -> 1.600 (better)"],
    )
    assert not decide({"gsm8k": 2.0, "chat": 1.5}, {"gsm8k": 3.0, "chat": 1.5})[0]  # a tie is not a win
    replace, lines = decide({"gsm8k": 2.0, "chat": 1.5}, {"gsm8k": 3.0, "chat": 1.4})
    assert not replace and lines[1] == "chat: tau 1.500 -> 1.400 (not better)"
    with pytest.raises(ValueError, match="same domains"):
        decide({"gsm8k": 2.0}, {"gsm8k": 2.5, "chat": 3.0})
    with pytest.raises(ValueError, match="same domains"):
        decide({}, {})


def test_install_drafter_writes_beside_then_renames(tmp_path, target):
    src = drafter_dir(target, tmp_path / "src", vocab=torch.arange(0, 49152, 7))
    (src / "eval.md").write_text("| table |")
    (src / "optimizer.pt").write_bytes(b"pickle")
    dest = drafter_dir(target, tmp_path / "models" / "drafter", seed=1)
    (dest / "length_head.json").write_text("{}")
    install_drafter(src, dest, {"gate.json": "{}\n"})
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "draft_vocab.safetensors", "gate.json", "model.safetensors"]
    assert (dest / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert [p.name for p in dest.parent.iterdir()] == ["drafter"]  # nothing left beside it
    with pytest.raises(FileNotFoundError, match="not a drafter directory"):
        install_drafter(tmp_path / "models", tmp_path / "elsewhere")


def test_continue_from_a_drafter_directory(tmp_path, tiny_hf_dir, target):
    """The run starts from the init drafter's exact weights, shape and draft vocabulary (the first warmup step
    runs at lr 0, so its checkpoint still equals them), then trains, and the export keeps shape and vocabulary."""
    vocab = torch.arange(0, 49152, 5)
    init = drafter_dir(target, tmp_path / "init-drafter", vocab=vocab)
    want = load_file(str(init / "model.safetensors"))
    cfg = continue_config(tmp_path, str(tiny_hf_dir), str(init), max_steps=1)
    cfg.train.vocab = "full"  # the tiny target's answers lie outside this draft vocabulary: learn from every label
    assert cfg.drafter.num_layers is None and cfg.drafter.block_size is None  # the shape comes from the init drafter

    start = start_drafter(cfg, target, tmp_path / "run")
    assert start.state_dict().keys() == want.keys()
    assert all(torch.equal(start.state_dict()[k], v) for k, v in want.items())
    assert torch.equal(start.vocab, vocab) and start.config.num_layers == 1 and start.block_size == 4
    assert json.loads((tmp_path / "run" / "init" / "start.json").read_text())["init"] == str(init)

    run_stages(cfg, ["prompts", "regenerate", "train"])
    ckpt = tmp_path / "run" / "checkpoints"
    step1 = load_file(str(ckpt / "step1" / "drafter.safetensors"))
    assert all(torch.equal(step1[k], v) for k, v in want.items())
    cfg.train.max_steps = 3
    run_stages(cfg, ["train"])  # resumes from step 1
    step3 = load_file(str(ckpt / "step3" / "drafter.safetensors"))
    assert any(not torch.equal(step3[k], v) for k, v in want.items())

    shutil.rmtree(init)  # the run keeps its own copy: the export does not need the init drafter any more
    run_stages(cfg, ["export"])
    meta = json.loads((tmp_path / "candidate" / "config.json").read_text())
    assert meta["num_layers"] == 1 and meta["block_size"] == 4 and meta["draft_vocab_size"] == vocab.numel()
    assert meta["training"]["init"]["init"] == str(init) and meta["training"]["steps"] == 3
    assert torch.equal(load_file(str(tmp_path / "candidate" / "draft_vocab.safetensors"))["ids"], vocab)

    other = drafter_dir(target, tmp_path / "other")
    cfg.drafter.init = str(other)
    with pytest.raises(ValueError, match="was started from drafter.init"):
        run_stages(cfg, ["train"])


def test_a_deeper_drafter_continues_one_and_drafts_the_same_until_trained(tmp_path, tiny_hf_dir, target):
    """drafter.num_layers above the init drafter's deepens it: its layers, then identity layers (output
    projections zeroed), so the deeper drafter's blocks equal the init's before any step; it trains."""
    init = drafter_dir(target, tmp_path / "init-drafter", vocab=torch.arange(0, 49152, 5))
    deep = start_drafter(continue_config(tmp_path, str(tiny_hf_dir), str(init), max_steps=1, num_layers=3), target, tmp_path / "run")
    shallow = load_drafter(init, target.model, target.identity, torch.float32)
    assert deep.config.num_layers == 3 and torch.equal(deep.vocab, shallow.vocab) and deep.training
    assert deep.layers[2].self_attn.o_proj.weight.requires_grad and not deep.layers[2].mlp.down_proj.weight.any()
    seq = torch.randint(0, 64, (1, 9))
    feats = target.model(seq, target.model.new_cache(1, 16))[1]  # [1, 9, n*H]
    blocks = []
    for d in (shallow, deep.eval()):
        cache = d.new_cache(1, 16)
        d.extend_context(feats[:, :-1], cache)
        blocks.append(d.draft(cache, seq[:, -1])[1])
    torch.testing.assert_close(blocks[1], blocks[0], atol=1e-5, rtol=1e-5)


def test_an_init_drafter_that_does_not_fit_is_refused(tmp_path, tiny_hf_dir, target):
    with pytest.raises(ConfigError, match="init must be 'random', 'target-last', a drafter directory or 'registry:"):
        from_dict(PretrainConfig, {"drafter": {"init": str(tmp_path / "nothing")}})
    with pytest.raises(ConfigError, match="names no version"):
        from_dict(PretrainConfig, {"drafter": {"init": "registry:"}})
    init = drafter_dir(target, tmp_path / "init-drafter", vocab=torch.arange(0, 49152, 5))
    with pytest.raises(ConfigError, match="keeps its draft vocabulary; remove drafter.draft_vocab"):
        from_dict(PretrainConfig, {"drafter": {"init": str(init), "draft_vocab": str(init)}})

    cfg = continue_config(tmp_path / "a", str(tiny_hf_dir), str(init), max_steps=1, block_size=8)
    with pytest.raises(ValueError, match="drafter.block_size is 8 but the init drafter .* has 4: the architecture comes from"):
        start_drafter(cfg, target, tmp_path / "a" / "run")
    deep = drafter_dir(target, tmp_path / "deep", num_layers=2)
    cfg = continue_config(tmp_path / "d", str(tiny_hf_dir), str(deep), max_steps=1, num_layers=1)
    with pytest.raises(ValueError, match="drafter.num_layers is 1 but the init drafter .* has 2: .*only num_layers may grow"):
        start_drafter(cfg, target, tmp_path / "d" / "run")
    cfg = continue_config(tmp_path / "b", str(tiny_hf_dir), str(init), max_steps=1, num_layers=1, block_size=4)
    assert start_drafter(cfg, target, tmp_path / "b" / "run").config.num_layers == 1  # the same values are fine

    foreign = drafter_dir(target, tmp_path / "foreign")  # a drafter of another target: its recorded identity differs
    meta = json.loads((foreign / "config.json").read_text())
    meta["target"]["fingerprint"] = "0123456789abcdef"
    (foreign / "config.json").write_text(json.dumps(meta))
    cfg = continue_config(tmp_path / "c", str(tiny_hf_dir), str(foreign), max_steps=1)
    with pytest.raises(ValueError, match="cannot continue on target .*fingerprint=0123456789abcdef.*drafter.init: random"):
        start_drafter(cfg, target, tmp_path / "c" / "run")


def test_continue_from_a_registry_version(tmp_path, tiny_hf_dir, target, mlflow_server):
    from adaflash.registry import Registry

    name = f"continue-{tmp_path.name}"[:60]
    reg = Registry(mlflow_server, name)
    first, second = drafter_dir(target, tmp_path / "v1", seed=1), drafter_dir(target, tmp_path / "v2", seed=2)
    assert reg.register(first) == "1" and reg.register(second) == "2"
    reg.set_champion("1")
    for ref, src in (("champion", first), ("2", second)):
        cfg = continue_config(tmp_path / ref, str(tiny_hf_dir), f"registry:{ref}", max_steps=1, tracking_uri=mlflow_server, model_name=name)
        drafter = start_drafter(cfg, target, tmp_path / ref / "run")
        want = load_file(str(src / "model.safetensors"))
        assert all(torch.equal(drafter.state_dict()[k], v) for k, v in want.items())
        assert json.loads((tmp_path / ref / "run" / "init" / "start.json").read_text())["version"] == src.name[1:]
    cfg = continue_config(tmp_path / "x", str(tiny_hf_dir), "registry:stable", max_steps=1, tracking_uri=mlflow_server, model_name=name)
    with pytest.raises(ValueError, match=r"no version or alias 'stable' \(versions: 1, 2; aliases: champion\)"):
        start_drafter(cfg, target, tmp_path / "x" / "run")


def test_gate_stage_end_to_end(tmp_path, tiny_hf_dir, target):
    """The tiny target repeats itself, which a drafter learns in a few dozen steps: continued from a random
    drafter, the candidate beats it on both domains and is installed (at gate.out, then over gate.current);
    against a copy of itself it ties and nothing is written."""
    current = drafter_dir(target, tmp_path / "models" / "drafter")
    (current / "length_head.json").write_text("{}")
    cfg = continue_config(tmp_path, str(tiny_hf_dir), str(current), max_steps=100)
    cfg.regen.domains, cfg.train.lr, cfg.train.save_every = ["gsm8k", "humaneval"], 3e-3, 100
    cfg.gate = GateSection(current=str(current), out=str(tmp_path / "trial"))
    out = run_stages(cfg, ["prompts", "regenerate", "train", "export", "gate"])

    result = json.loads((tmp_path / "run" / "gate.json").read_text())
    assert out["gate"]["replaced"] == str(tmp_path / "trial") == result["installed"]
    for d in ("gsm8k", "humaneval"):
        r = result["domains"][d]
        assert r["prompts"] == 2 and r["current"]["identical_greedy"] == r["candidate"]["identical_greedy"] == 2
        assert r["candidate"]["tau"] > r["current"]["tau"] >= 1.0
    assert set(result["eval"]["domains"]["gsm8k"]["variants"]) == {"current/dflash-v4", "candidate/dflash-v4"}
    table = (tmp_path / "run" / "gate.md").read_text()
    assert "| gsm8k | 2 |" in table and "is now" in table and "fit-head" in table  # the current one has a length head
    candidate = tmp_path / "candidate"
    assert sorted(p.name for p in (tmp_path / "trial").iterdir()) == ["config.json", "gate.json", "model.safetensors"]
    assert (tmp_path / "trial" / "model.safetensors").read_bytes() == (candidate / "model.safetensors").read_bytes()
    assert (current / "length_head.json").exists()  # gate.out elsewhere: the current drafter is untouched

    cfg.gate.out = None
    assert run_stages(cfg, ["gate"])["gate"]["replaced"] == str(current)
    assert (current / "model.safetensors").read_bytes() == (candidate / "model.safetensors").read_bytes()
    assert not (current / "length_head.json").exists()

    shutil.copytree(candidate, tmp_path / "same")
    cfg.gate = GateSection(current=str(tmp_path / "same"), out=str(tmp_path / "tie"))
    assert run_stages(cfg, ["gate"])["gate"]["replaced"] is None
    assert not (tmp_path / "tie").exists() and "Kept" in (tmp_path / "run" / "gate.md").read_text()
    cfg.gate.current = str(candidate)
    with pytest.raises(ValueError, match="drafter_out is gate.current"):
        run_stages(cfg, ["gate"])


def test_shipped_continue_config():
    """configs/pretrain_smollm2_continue.yaml: its first line runs it, it continues the committed drafter and gates
    against it on domains that have held-out prompts."""
    from pathlib import Path

    from adaflash.pipelines.prompts import EVAL_PERCENT, available_domains

    from adaflash.config import load_config
    from adaflash.drafter import DEFAULT_DRAFTER

    path = Path(__file__).parent.parent / "configs" / "pretrain_smollm2_continue.yaml"
    assert path.read_text().startswith("# adaflash pretrain --config configs/pretrain_smollm2_continue.yaml --stage ")
    cfg = load_config(path, PretrainConfig)
    assert Path(cfg.drafter.init).resolve() == Path(cfg.gate.current).resolve() == DEFAULT_DRAFTER
    assert cfg.drafter.continues and cfg.drafter.num_layers is None and cfg.gate.out is None
    assert set(cfg.regen.domains) <= set(available_domains()) and Path(cfg.drafter_out) != Path(cfg.gate.current)
    assert all(d in available_domains() and EVAL_PERCENT[d] > 0 for d in cfg.eval.domains)


def test_pretrain_cli_explains_the_gate(tmp_path, capsys):
    from adaflash.cli import main

    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    help_text = capsys.readouterr().out
    assert "registry:<version|alias>" in help_text and "--gate-out DIR" in help_text and "higher on every domain" in help_text
    plain = tmp_path / "plain.yaml"
    plain.write_text(f"run_dir: {tmp_path / 'run'}\n")
    assert main(["pretrain", "--config", str(plain), "--stage", "gate", "--gate-out", str(tmp_path / "x")]) == 2
    assert "has no gate: section" in capsys.readouterr().err
    assert main(["pretrain", "--config", str(plain), "--stage", "gate"]) == 1
    assert "needs a `gate:` section" in capsys.readouterr().err
