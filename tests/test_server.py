"""`adaflash serve` over raw HTTP: every bad input gets its 4xx and a reason, 401 without the key,
429 + Retry-After when the queue is full, client disconnect cancels, /ready is 503 until loaded,
/metrics parses, and SIGTERM drains in-flight requests and flushes the trajectory buffer."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from serve_util import running_server, serve_config

from adaflash.buffer import ShardReader
from adaflash.target import load_target

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
COMP = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8}


@pytest.fixture(scope="module")
def target(tiny_hf_dir):
    return load_target(str(tiny_hf_dir), "float32")


@pytest.fixture(scope="module")
def server(target, tiny_hf_dir, tiny_drafter_dir, tmp_path_factory):
    """One request decodes at a time and one may wait: the third concurrent one is refused."""
    cfg = serve_config(tiny_hf_dir, tiny_drafter_dir, tmp_path_factory.mktemp("buffer"), engine={"max_batch": 1, "max_queued": 1})
    with running_server(cfg, target=target, api_key=KEY) as (url, state, _):
        yield url, state


def post(url, path, body, headers=AUTH, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(url + path, data=data, headers={"Content-Type": "application/json", **headers}, timeout=60, **kw)


CASES = [  # (path, body, status, param or code expected in the error)
    ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", 400, "invalid_json"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "temperature": 3}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {**CHAT, "seed": 1.5}, 400, "seed"),
    ("/v1/chat/completions", {**CHAT, "stop": 3}, 400, "stop"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/chat/completions", {**CHAT, "metadata": {"domain": 1}}, 400, "metadata"),
    ("/v1/chat/completions", {**CHAT, "ignore_eos": "yes"}, 400, "ignore_eos"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model_not_found"),
    ("/v1/chat/completions", {k: v for k, v in CHAT.items() if k != "model"}, 400, "model"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 401}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "n": 2}, 400, "n"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0.5}, 400, "unsupported_value"),
    ("/v1/chat/completions", {**CHAT, "tools": []}, 400, "unsupported_parameter"),
    ("/v1/completions", {**COMP, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {**COMP, "prompt": "\x16"}, 400, "prompt"),  # no tokens once tokenized (found by test_server_fuzz)
    ("/v1/completions", {**COMP, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {**COMP, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {**COMP, "prompt": [1, 10**9]}, 400, "prompt"),
    ("/v1/completions", {**COMP, "prompt": [1] * 200, "max_tokens": 400}, 400, "context_length_exceeded"),
    ("/v1/completions", {**COMP, "prompt": [1] * 300}, 400, "context_length_exceeded"),
    ("/v1/completions", {**COMP, "n": 3}, 400, "n"),
]


@pytest.mark.parametrize("path, body, status, expect", CASES, ids=[f"{i}-{c[3]}" for i, c in enumerate(CASES)])
def test_bad_input_gets_4xx_with_reason(server, path, body, status, expect):
    url, _ = server
    r = post(url, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and expect in (err["param"], err["code"]), err


def test_api_key_required(server):
    url, _ = server
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = post(url, "/v1/completions", COMP, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(f"{url}/v1/models", timeout=10).status_code == 401
    assert requests.get(f"{url}/health", timeout=10).status_code == 200  # liveness stays open
    assert post(url, "/v1/completions", COMP).status_code == 200


def status(url) -> dict:
    return requests.get(f"{url}/v1/status", headers=AUTH, timeout=10).json()


def wait_for(pred, what: str, timeout: float = 20):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_full_queue_429_and_disconnect_cancels(server):
    url, _ = server
    cancelled = status(url)["requests"].get("cancelled", 0)
    long = post(url, "/v1/completions", {**COMP, "max_tokens": 400, "temperature": 0, "stream": True}, stream=True)
    lines = long.iter_lines()
    assert next(line for line in lines if line).startswith(b"data: {")  # decoding: it holds the only batch slot
    queued: dict = {}
    waiter = threading.Thread(target=lambda: queued.update(r=post(url, "/v1/completions", COMP)))
    waiter.start()
    wait_for(lambda: status(url)["queue_depth"] == 1, "the second request to queue")
    r = post(url, "/v1/completions", COMP)
    assert r.status_code == 429 and r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "queue_full"
    long.close()  # client disconnect: the engine cancels the request, the queued one gets the slot
    waiter.join(60)
    assert queued["r"].status_code == 200 and queued["r"].json()["usage"]["completion_tokens"] == 8
    wait_for(lambda: status(url)["requests"].get("cancelled", 0) == cancelled + 1, "the cancellation")
    st = status(url)
    assert st["running"] == 0 and st["queue_depth"] == 0


def test_metrics_parse_and_count(server):
    url, _ = server
    assert post(url, "/v1/chat/completions", CHAT).status_code == 200
    text = requests.get(f"{url}/metrics", timeout=10).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    value = lambda name, **labels: next(  # noqa: E731
        s.value
        for s in fams[name].samples
        if s.name in (name, name + "_total", name + "_info") and all(s.labels.get(k) == v for k, v in labels.items())
    )
    for name in (
        "adaflash_generated_tokens",
        "adaflash_requests",
        "adaflash_verify_tokens",
        "adaflash_trajectory_rows",
        "adaflash_drafter_swaps",
        "adaflash_trajectory_rows_inexact",
        "adaflash_schedule_updates",
        "adaflash_drafted_rounds",
        "adaflash_policy_probes",
        "adaflash_registry_refused_versions",
        "adaflash_registry_poll_errors",
    ):
        assert fams[name].type == "counter", name
    for name in (
        "adaflash_tokens_per_second",
        "adaflash_tau",
        "adaflash_verify_tokens_per_step",
        "adaflash_queue_depth",
        "adaflash_running_requests",
        "adaflash_ready",
        "adaflash_drafted_round_share",
        "adaflash_policy_traffic_acceptance",
        "adaflash_policy_step_cost_error",
        "adaflash_policy_drafting_cost_factor",
    ):
        assert fams[name].type == "gauge", name
    assert value("adaflash_generated_tokens") >= 8 and value("adaflash_requests", finish_reason="length") >= 1
    assert value("adaflash_trajectory_rows") >= 1 and value("adaflash_ready") == 1
    assert value("adaflash_tau") >= 1 and 1 <= value("adaflash_verify_tokens_per_step") <= 4
    assert 0 <= value("adaflash_drafted_rounds") <= value("adaflash_verify_rounds") and 0 <= value("adaflash_drafted_round_share") <= 1
    assert 0 < value("adaflash_policy_traffic_acceptance") < 1 and value("adaflash_policy_step_cost_error") >= 0  # the cost policy's state
    st = status(url)["policy_state"]
    assert set(st) >= {"traffic_acceptance", "probes", "probe_payoff", "exploration_share", "step_cost_error"}
    assert value("adaflash_drafter_info", version="0", policy="cost") == 1  # auto: the cost policy
    assert value("adaflash_drafter_swaps") == 0 and value("adaflash_registry_refused_versions") == 0
    assert value("adaflash_trajectory_rows_inexact") == 0  # the builtin engine records every round
    assert value("adaflash_schedule_updates") == 0  # a schedule per batch size is vLLM's (policy cost)
    assert fams["adaflash_time_to_first_token_seconds"].type == "histogram"


def test_registry_down_keeps_serving(target, tiny_hf_dir, tiny_drafter_dir, tmp_path):
    """With a registry configured the HotSwapper runs; while MLflow is unreachable its poll errors show in
    /metrics and /v1/status, and the loaded drafter keeps serving."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens here once the socket is closed
    cfg = serve_config(
        tiny_hf_dir,
        tiny_drafter_dir,
        tmp_path,
        registry={"tracking_uri": dead, "cache_dir": str(tmp_path / "cache"), "interval_s": 0.2, "retries": 0},
    )
    with running_server(cfg, target=target) as (url, state, _):
        assert state.swapper is not None
        wait_for(lambda: status(url)["registry"]["poll_errors"] >= 1, "a failed registry poll")
        r = post(url, "/v1/completions", COMP)
        assert r.status_code == 200 and r.json()["adaflash"]["drafter_version"] == "0"
        text = requests.get(f"{url}/metrics", timeout=10).text
        errors = next(
            s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "adaflash_registry_poll_errors_total"
        )
        assert errors >= 1 and status(url)["registry"]["swaps"] == 0
    assert not state.swapper._thread.is_alive()  # stopped at shutdown


def test_policy_follows_the_drafter_dir(target, tiny_hf_dir, tiny_drafter_dir, tmp_path, monkeypatch):
    """auto: the cost policy, with or without a length head in the drafter dir; explicit policies as named."""
    import shutil

    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path / "cache"))  # the cost policy's calibration

    from adaflash.server.app import build_engine

    from adaflash.length_head import LengthHead, LengthHeadConfig, save_length_head

    with_head = tmp_path / "drafter-with-head"
    shutil.copytree(tiny_drafter_dir, with_head)
    save_length_head(LengthHead(LengthHeadConfig(hidden_size=64, inner=8, block_size=4, min_len=1)), with_head)
    built = lambda drafter, policy: build_engine(  # noqa: E731
        serve_config(tiny_hf_dir, drafter, tmp_path, model={"policy": policy}), target
    )
    assert built(tiny_drafter_dir, "auto").policy.name == "cost"
    assert built(with_head, "auto").policy.name == "cost"
    engine = built(with_head, "head")
    assert engine.policy.name == "head" and engine.slot.head is not None
    assert built(tiny_drafter_dir, "fixed2").policy.k == 2 and built(tiny_drafter_dir, "ema").policy.name == "ema"
    assert built(tiny_drafter_dir, "ar").drafter is None
    assert built(tiny_drafter_dir, "cost").policy.name == "cost"  # step costs of this target and drafter measured at start
    # stock engines have no per-request knob: vLLM takes cost as a draft length per batch size, SGLang refuses it
    assert serve_config(tiny_hf_dir, tiny_drafter_dir, tmp_path, backend="vllm", model={"policy": "cost"}).model.policy == "cost"
    with pytest.raises(ValueError, match="'cost' needs the builtin backend"):
        serve_config(tiny_hf_dir, tiny_drafter_dir, tmp_path, backend="sglang", model={"policy": "cost"})
    with pytest.raises(ValueError, match=r"'head' needs the builtin backend.*cost \(drafts per step by batch size"):
        serve_config(tiny_hf_dir, tiny_drafter_dir, tmp_path, backend="vllm", model={"policy": "head"})
    # prompt lookup is on by default (engine.lookup 4) and configurable; bad values are refused with the key
    assert (built(tiny_drafter_dir, "fixed").lookup, built(tiny_drafter_dir, "fixed").lookup_min) == (4, 2)
    off = build_engine(serve_config(tiny_hf_dir, tiny_drafter_dir, tmp_path, engine={"lookup": 0}), target)
    assert off.lookup == 0
    for bad, msg in (
        ({"lookup": -1}, "engine.lookup must be >= 0"),
        ({"lookup_min_ngram": 4}, "engine.lookup_min_ngram"),
        ({"tree": -1}, "engine.tree must be >= 0"),
    ):
        with pytest.raises(ValueError, match=msg):
            serve_config(tiny_hf_dir, tiny_drafter_dir, tmp_path, engine=bad)
    # token trees are off by default and configurable; they need a drafter
    assert built(tiny_drafter_dir, "fixed").tree == 0
    assert build_engine(serve_config(tiny_hf_dir, tiny_drafter_dir, tmp_path, engine={"tree": 8}), target).tree == 8
    with pytest.raises(ValueError, match="engine.tree needs"):
        serve_config(tiny_hf_dir, tiny_drafter_dir, tmp_path, engine={"tree": 8}, model={"policy": "ar"})


def test_trajectories_flushed_by_age(target, tiny_hf_dir, tiny_drafter_dir, tmp_path):
    cfg = serve_config(tiny_hf_dir, tiny_drafter_dir, tmp_path, trajectories={"max_age_s": 0.3})
    with running_server(cfg, target=target) as (url, _, _):
        rid = post(url, "/v1/completions", {**COMP, "metadata": {"domain": "aged"}}).json()["id"]
        wait_for(lambda: list(tmp_path.glob("test-node-*.parquet")), "a shard published by age")
        (row,) = [t for b in ShardReader(tmp_path).poll() for t in b.trajectories()]
        assert row.request_id == rid and row.domain == "aged" and len(row.output_ids) == 8


def test_ready_is_503_until_loaded(target, tiny_hf_dir, tiny_drafter_dir, tmp_path):
    gate = threading.Event()
    cfg = serve_config(tiny_hf_dir, tiny_drafter_dir, tmp_path)
    with running_server(cfg, target=lambda: gate.wait(30) and target, wait_ready=False) as (url, state, _):
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        r = requests.get(f"{url}/ready", timeout=10)
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = post(url, "/v1/completions", COMP, headers={})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready" and "Retry-After" in r.headers
        gate.set()
        wait_for(lambda: requests.get(f"{url}/ready", timeout=10).status_code == 200, "ready")
        assert post(url, "/v1/completions", COMP, headers={}).status_code == 200


def test_failed_load_reports_why(tiny_hf_dir, tmp_path):
    errors = []
    cfg = serve_config(tiny_hf_dir, tmp_path / "no-such-drafter", tmp_path)
    with running_server(cfg, wait_ready=False, on_load_error=errors.append) as (url, _, _):
        wait_for(lambda: errors, "the load error", timeout=60)
        r = requests.get(f"{url}/ready", timeout=10)
        assert r.status_code == 503 and r.json()["status"] == "failed" and "no-such-drafter" in r.json()["error"]


def test_sigterm_drains_then_flushes(tiny_hf_dir, tiny_drafter_dir, tmp_path):
    """A real `adaflash serve` process: on SIGTERM a short in-flight stream still finishes, a long one is
    cancelled at the end of the grace period with an error event, all trajectories are flushed, exit 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    buffer_dir = tmp_path / "buffer"
    # grace 2 s, and the "long" stream ignores EOS: the tiny model's greedy answer ends with EOS after ~200
    # tokens, which one fast CI run finished in 0.5 s (nothing left to cancel); 3000 tokens take far longer than
    # the grace, while 40 "short" tokens need a fraction of it
    cfg = {
        "port": port,
        "shutdown_grace_s": 2,
        "log_level": "warning",
        "model": {"name": "tiny", "target": str(tiny_hf_dir), "drafter": str(tiny_drafter_dir), "drafter_dtype": "float32"},
        "engine": {"max_model_len": 4096, "max_tokens_limit": 3000},
        "trajectories": {"buffer_dir": str(buffer_dir), "writer_id": "sigterm-node", "max_age_s": 600},
    }
    path = tmp_path / "serve.yaml"
    path.write_text("# adaflash serve --config serve.yaml\n" + json.dumps(cfg))
    env = {**os.environ, "ADAFLASH_API_KEY": KEY, "OMP_NUM_THREADS": "1"}  # a tiny model needs no thread pool
    proc = subprocess.Popen(
        [sys.executable, "-m", "adaflash.cli", "serve", "--config", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    url = f"http://127.0.0.1:{port}"
    streams: dict[str, list] = {"short": [], "long": []}
    ended: dict[str, float] = {}
    try:

        def ready():
            try:
                return requests.get(f"{url}/ready", timeout=2).status_code == 200
            except requests.ConnectionError:
                assert proc.poll() is None, proc.stdout.read().decode()
                return False

        wait_for(ready, "the subprocess server", timeout=60)
        first = post(url, "/v1/completions", {**COMP, "metadata": {"domain": "warmup"}}).json()

        def read(name, max_tokens):
            body = {**COMP, "max_tokens": max_tokens, "stream": True, "ignore_eos": name == "long"}
            r = post(url, "/v1/completions", body, stream=True)
            for line in r.iter_lines():
                if line:
                    streams[name].append(line)
            ended[name] = time.monotonic()

        readers = [threading.Thread(target=read, args=a) for a in (("short", 40), ("long", 3000))]
        for t in readers:
            t.start()
        wait_for(lambda: streams["short"] and streams["long"], "both streams to start")
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(40) == 0, proc.stdout.read().decode()
        for t in readers:
            t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    with pytest.raises(requests.ConnectionError):  # no longer listening
        requests.get(f"{url}/health", timeout=2)
    assert ended["short"] > t_term and streams["short"][-1] == b"data: [DONE]"  # drained within the grace period
    assert streams["long"][-1] == b"data: [DONE]" and b'"code": "cancelled"' in streams["long"][-2]
    short_rid, long_rid = (json.loads(streams[k][0][6:])["id"] for k in ("short", "long"))
    rows = {t.request_id: t for b in ShardReader(buffer_dir).poll() for t in b.trajectories()}
    assert {first["id"], short_rid, long_rid} <= set(rows)
    assert rows[first["id"]].domain == "warmup" and len(rows[short_rid].output_ids) == 40
    assert 0 < len(rows[long_rid].output_ids) < 3000
