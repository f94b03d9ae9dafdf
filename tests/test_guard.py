"""Automatic rollback on live acceptance (server/guard.py): the test statistic, and end to end on SmolLM2 with
a real MLflow registry: a promoted version that drafts badly (it would pass a gate that never saw it live)
is rolled back by the serving node, both versions are tagged with why, and the node swaps back."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from adaflash.server.guard import worse
from serve_util import running_server, serve_config

from adaflash.drafter import DEFAULT_DRAFTER, load_drafter
from adaflash.registry import Registry, bootstrap
from adaflash.target import load_target


def test_one_unlucky_request_is_not_a_regression():
    old = [2.2, 2.4, 2.1, 2.3, 2.5, 2.2, 2.0, 2.4]
    assert not worse(old[:-1] + [1.0], old, z=3.0, min_drop=0.05)[0]  # one bad request in the new window
    assert not worse([x - 0.05 for x in old], old, z=3.0, min_drop=0.05)[0]  # a small drop
    bad, stat = worse([1.0, 1.1, 1.0, 1.05, 1.0, 1.1, 1.0, 1.02], old, z=3.0, min_drop=0.05)
    assert bad and stat > 10
    assert not worse([2.3] * 8, [2.3] * 8, z=3.0, min_drop=0.05)[0]  # identical, zero variance


@pytest.mark.slow
def test_a_promoted_version_that_does_worse_live_is_rolled_back(mlflow_server, tmp_path):
    target = load_target("smollm2", "float32")
    reg = Registry(mlflow_server, model_name="guard-rollback", retries=2, backoff_s=0.2)
    assert bootstrap(reg, DEFAULT_DRAFTER) == "1"
    bad = load_drafter(DEFAULT_DRAFTER, target.model, target.identity, torch.float32)
    with torch.no_grad():
        for layer in bad.layers:  # same shapes, useless drafts
            layer.self_attn.o_proj.weight.neg_()
            layer.mlp.down_proj.weight.neg_()
    bad_dir = bad.save(tmp_path / "bad", torch.float32)
    cfg = serve_config(
        "smollm2", DEFAULT_DRAFTER, tmp_path / "buffer",
        model={"name": "smollm2", "drafter_dtype": "float32", "policy": "fixed6"},
        engine={"max_batch": 4, "max_model_len": 2048, "max_tokens_limit": 256},
        registry={"tracking_uri": mlflow_server, "model_name": reg.model_name, "cache_dir": str(tmp_path / "cache"),
                  "interval_s": 0.5, "retries": 2, "rollback_window": 6},
    )  # fmt: skip
    questions = [f"Tom has {n} boxes of 12 apples and sells 5. How many apples are left?" for n in range(3, 9)]

    def traffic(url):
        body = lambda q: {"model": "smollm2", "max_tokens": 32, "temperature": 0, "messages": [{"role": "user", "content": q}]}  # noqa: E731
        with ThreadPoolExecutor(3) as pool:
            rs = list(pool.map(lambda q: requests.post(f"{url}/v1/chat/completions", json=body(q), timeout=120), questions))
        assert all(r.status_code == 200 for r in rs)
        return [r.json()["adaflash"] for r in rs]

    def version(url):
        return requests.get(f"{url}/ready", timeout=5).json()["drafter_version"]

    def wait(cond, what, timeout=60):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.2)

    with running_server(cfg, target=target) as (url, state, _):
        wait(lambda: version(url) == "1", "the server did not take the champion v1")
        good = traffic(url)
        v2 = reg.register(bad_dir, tags={"gate": "passed", "note": "drafts badly: only live traffic shows it"})
        reg.set_champion(v2)
        wait(lambda: version(url) == v2, f"the server did not swap to v{v2}")
        worse_stats = traffic(url)
        assert all(s["drafter_version"] == v2 for s in worse_stats)
        wait(lambda: reg.champion() == "1", "the guard did not move champion back to v1")
        wait(lambda: version(url) == "1", "the server did not swap back to v1")
        tags = {v["version"]: v["tags"] for v in reg.versions()}
        metrics = requests.get(f"{url}/metrics", timeout=5).text
    mean = lambda stats: sum(s["tau"] for s in stats) / len(stats)  # noqa: E731
    assert mean(worse_stats) < 0.85 * mean(good)  # prompt lookup still accepts some tokens for the bad drafter
    assert "champion moved back to v1" in tags[v2]["rolled_back"] and "rolled back" in tags["1"]["restored"]
    assert any(k.startswith("live_tau.") for k in tags["1"])
    assert "adaflash_rollbacks_total 1.0" in metrics and 'adaflash_live_tau{version="1"}' in metrics
