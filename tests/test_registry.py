"""MLflow registry and hot-swap against a real `mlflow server` (session fixture `mlflow_server`):
register / champion / download round trip, bootstrap, CLI promote, refusal of broken versions,
rollback through MLflow's REST alias endpoint (what the UI does), and a registry that is down."""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import time
import uuid

import pytest
import requests
import torch
from adaflash.cli import main as cli_main
from adaflash.server.swap import HotSwapper
from conftest import free_port
from safetensors.torch import load_file, save_file

from adaflash.drafter import Drafter, DrafterConfig, load_drafter
from adaflash.engine import Engine
from adaflash.length_head import LengthHead, LengthHeadConfig, save_length_head
from adaflash.policies import FixedPolicy
from adaflash.registry import Registry, RegistryUnavailable, bootstrap
from adaflash.request import Request
from adaflash.target import load_target

_ids = itertools.count()


def registry(url: str, **kw) -> Registry:
    return Registry(url, model_name=f"drafter-{uuid.uuid4().hex[:8]}", **kw)


@pytest.fixture(scope="module")
def target(tiny_hf_dir):
    return load_target(str(tiny_hf_dir), "float32")


def drafter_variant(target, src, out, seed=1, edit=None, config_edit=None):
    """A drafter directory for the tiny target: another seed, optionally with edited weights / config."""
    torch.manual_seed(seed)
    cfg = json.loads((src / "config.json").read_text())
    d = Drafter(
        DrafterConfig.for_target(target.model, target.identity, num_layers=cfg["num_layers"], block_size=cfg["block_size"]), target.model
    )
    d.save(out, dtype=torch.float32)
    if edit is not None:
        state = load_file(str(out / "model.safetensors"))
        edit(state)
        save_file(state, str(out / "model.safetensors"))
    if config_edit is not None:
        cfg = json.loads((out / "config.json").read_text())
        config_edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def drive(engine, prompt, until, timeout, log=None, in_flight=2):
    """Step the engine, keeping `in_flight` short requests going, until until() or timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        while len(engine.running) + len(engine.waiting) < in_flight:
            engine.submit(Request(f"r{next(_ids)}", prompt, max_new_tokens=12))
        for st in engine.step():
            if log is not None:
                log.append(st)
        if until():
            return
    raise AssertionError(f"condition not reached within {timeout} s")


def test_register_champion_download_roundtrip(mlflow_server, tiny_drafter_dir, tmp_path):
    src = tmp_path / "drafter"
    shutil.copytree(tiny_drafter_dir, src)
    save_length_head(LengthHead(LengthHeadConfig(hidden_size=64, block_size=4)), src)
    (src / "eval.json").write_text('{"tau": 1.5}')
    (src / "optimizer.pt").write_bytes(b"not for servers")
    reg = registry(mlflow_server)
    assert reg.champion() is None and reg.versions() == []  # no model yet

    assert reg.register(src, tags={"stage": "test"}) == "1"
    assert reg.champion() is None  # registering does not promote
    reg.set_champion("1")
    reg.tag_version("1", "eval_tau", "1.5")
    (row,) = reg.versions()
    assert row["version"] == "1" and row["aliases"] == ["champion"] and reg.champion() == "1"
    assert row["tags"]["stage"] == "test" and row["tags"]["eval_tau"] == "1.5"
    ident = json.loads((src / "config.json").read_text())["target"]
    assert row["tags"]["target"].startswith(f"{ident['name']} ({ident['fingerprint']}; ")  # readable, not a JSON blob
    assert f"vocab size {ident['vocab_size']}" in row["tags"]["target"]

    path = reg.download("1", tmp_path / "cache")
    want = {"config.json", "model.safetensors", "length_head.json", "length_head.safetensors", "eval.json"}
    assert {p.name for p in path.iterdir()} == want  # the pickle-format file was never registered
    for name in want:
        assert (path / name).read_bytes() == (src / name).read_bytes()
    dead = Registry(f"http://127.0.0.1:{free_port()}", reg.model_name, retries=0)
    assert dead.download("1", tmp_path / "cache") == path  # cached per version: no server needed

    # a run the caller owns (the trainer logs its metrics there): the version points at it, the run stays open
    exp = reg.client.get_experiment_by_name("adaflash").experiment_id
    run_id = reg.client.create_run(exp).info.run_id
    assert reg.register(src, run_id=run_id) == "2"
    assert reg.client.get_model_version(reg.model_name, "2").run_id == run_id
    assert reg.client.get_run(run_id).info.status == "RUNNING"


def test_bootstrap_is_idempotent_and_cli_promotes(mlflow_server, tiny_drafter_dir, capsys):
    reg = registry(mlflow_server)
    assert bootstrap(reg, tiny_drafter_dir) == "1"
    assert bootstrap(reg, tiny_drafter_dir) == "1"
    assert [r["version"] for r in reg.versions()] == ["1"] and reg.champion() == "1"
    reg.client.delete_registered_model_alias(reg.model_name, "champion")  # alias lost: re-pointed, not re-registered
    assert bootstrap(reg, tiny_drafter_dir) == "1" and len(reg.versions()) == 1

    args = ["--tracking-uri", mlflow_server, "--model-name", reg.model_name]
    assert cli_main(["registry", "register", "--drafter", str(tiny_drafter_dir), "--tag", "note=second", *args]) == 0
    assert cli_main(["registry", "promote", "2", *args]) == 0
    assert reg.champion() == "2"
    capsys.readouterr()
    assert cli_main(["registry", "status", *args]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[-1].split()[:2] == ["2", "champion"] and "note=second" in table[-1]
    assert table[-2].split()[:2] == ["1", "-"] and "source=bootstrap" in table[-2]
    assert cli_main(["registry", "promote", "7", *args]) == 2  # unknown version: usage error, champion unchanged
    assert reg.champion() == "2"


def test_hotswap_refuses_bad_versions_and_rolls_back(mlflow_server, target, tiny_drafter_dir, tmp_path, caplog):
    reg = registry(mlflow_server)
    assert bootstrap(reg, tiny_drafter_dir) == "1"
    v2 = reg.register(drafter_variant(target, tiny_drafter_dir, tmp_path / "v2"))
    nan = reg.register(
        drafter_variant(target, tiny_drafter_dir, tmp_path / "nan", edit=lambda s: s["fc.weight"].__setitem__((0, 0), float("nan")))
    )
    shape = reg.register(
        drafter_variant(
            target, tiny_drafter_dir, tmp_path / "shape", edit=lambda s: s.__setitem__("fc.weight", s["fc.weight"][:-1].contiguous())
        )
    )
    other = reg.register(
        drafter_variant(
            target, tiny_drafter_dir, tmp_path / "other", config_edit=lambda c: c["target"].update(fingerprint="0123456789abcdef")
        )
    )
    engine = Engine(
        target.model,
        load_drafter(tiny_drafter_dir, target.model, target.identity),
        FixedPolicy(),
        target.eos_ids,
        max_batch=4,
        token_budget=256,
        version="1",
    )
    prompt = target.encode_chat("Hello there")
    events, done = [], []
    interval = 0.5
    swapper = HotSwapper(reg, engine, target, tmp_path / "cache", interval_s=interval, on_event=events.append).start()
    try:
        # a request that runs until released: it spans the swap and must keep drafter v1 throughout (its token
        # budget far beyond the test's steps: it took 541 tokens before the release on a VM whose steps took ~15 ms, past the 500 it had)
        release = []
        engine.submit(Request("long", prompt, max_new_tokens=6000, stop=lambda out: len(out) if release else None))
        drive(engine, prompt, lambda: engine.stats["steps"] > 3, 30)
        reg.set_champion(v2)
        drive(engine, prompt, lambda: engine.version == v2, 30, done)
        long = next(s for s in engine.running if s.req.request_id == "long")
        assert long.slot.version == "1"  # running requests keep the drafter their cache was built with
        drive(engine, prompt, lambda: any(s.slot.version == v2 for s in done), 30, done)

        with caplog.at_level(logging.ERROR, logger="adaflash.registry"):
            for n, bad in enumerate([nan, shape, other], 1):
                reg.set_champion(bad)
                drive(engine, prompt, lambda: swapper.refused == n, 30, done)
                assert engine.version == v2 and swapper.version == v2  # the old drafter keeps serving
            later = time.monotonic() + 3 * interval
            drive(engine, prompt, lambda: time.monotonic() > later, 30, done)  # champion still on `other`
        assert swapper.refused == 3  # refused once each, not again on every poll
        reasons = swapper.refused_versions
        assert "non-finite" in reasons[nan] and "size mismatch" in reasons[shape] and "trained for target" in reasons[other]
        assert sum("refused version" in r.message for r in caplog.records) == 3

        # rollback the way the UI does it: MLflow's REST alias endpoint
        r = requests.post(
            f"{mlflow_server}/api/2.0/mlflow/registered-models/alias",
            json={"name": reg.model_name, "alias": "champion", "version": "1"},
            timeout=10,
        )
        r.raise_for_status()
        t0 = time.monotonic()
        drive(engine, prompt, lambda: swapper.version == "1", 10, done)
        assert time.monotonic() - t0 < 2 * interval + 0.5  # within two polls (+ download and load)
        drive(engine, prompt, lambda: engine.version == "1" and any(s.slot.version == "1" for s in done[-2:]), 30, done)
        release.append(True)
        drive(engine, prompt, lambda: any(s.req.request_id == "long" for s in done), 30, done)
    finally:
        swapper.stop()
    assert swapper.swaps == 2 and swapper.poll_errors == 0
    assert [e["event"] for e in events] == ["swap", "refused", "refused", "refused", "swap"]
    assert engine.stats["swaps"] == 2
    # greedy decoding is lossless: every drafter version produced the same tokens for the same prompt
    short = [s for s in done if s.req.request_id != "long"]
    assert {s.slot.version for s in short} >= {"1", v2} and all(s.finish_reason in ("length", "stop") for s in short)
    assert all(s.out == short[0].out for s in short if s.finish_reason == "length")
    long = next(s for s in done if s.req.request_id == "long")
    assert long.slot.version == "1" and long.finish_reason == "stop" and long.out[:12] == short[0].out[:12]


def test_registry_down_retries_then_unavailable_while_engine_serves(target, tiny_drafter_dir, tmp_path, caplog):
    reg = Registry(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.05)
    with caplog.at_level(logging.WARNING, logger="adaflash.registry"):
        t0 = time.monotonic()
        with pytest.raises(RegistryUnavailable, match="unreachable after 3 attempts"):
            reg.champion()
        assert time.monotonic() - t0 < 5
        retries = [r.message for r in caplog.records if "retry" in r.message]
        assert len(retries) == 2 and "retry 2/2" in retries[-1] and "ConnectionRefusedError" in retries[0]

        engine = Engine(
            target.model,
            load_drafter(tiny_drafter_dir, target.model, target.identity),
            FixedPolicy(),
            target.eos_ids,
            max_batch=4,
            token_budget=256,
            version="1",
        )
        swapper = HotSwapper(reg, engine, target, tmp_path / "cache", interval_s=0.05).start()
        done = []
        try:
            drive(engine, target.encode_chat("Hi"), lambda: swapper.poll_errors >= 2 and len(done) >= 4, 30, done)
        finally:
            swapper.stop(timeout=10)
    assert not swapper._thread.is_alive()
    assert engine.version == "1" and swapper.version == "1" and swapper.swaps == 0 and swapper.refused == 0
    assert all(s.finish_reason in ("length", "stop") for s in done)  # serving went on while the registry was down
    assert any("keeps serving" in r.message for r in caplog.records)
    assert swapper.metrics() == {"swaps": 0, "refused": 0, "poll_errors": swapper.poll_errors, "version": "1"}
