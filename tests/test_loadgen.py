"""`adaflash loadgen`: mix and schedule parsing, and real runs against a real `adaflash serve` process
(tiny target) including the 429 + Retry-After path of a deliberately tiny queue."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml
from adaflash.cli import main
from adaflash.cli.loadgen import Phase, load_pools, parse_duration, parse_mix, parse_schedule, phase_at


def test_mix_and_duration_parsing():
    assert parse_mix("gsm8k:3,humaneval:1") == {"gsm8k": 0.75, "humaneval": 0.25}
    assert parse_mix("gsm8k, humaneval") == {"gsm8k": 0.5, "humaneval": 0.5}
    assert parse_mix("gsm8k:1,aime:0") == {"gsm8k": 1.0}
    assert [parse_duration(x) for x in ("90", "90s", "5m", "1.5h")] == [90, 90, 300, 5400]
    for bad in ("", "gsm8k:x", "gsm8k:-1", "gsm8k,gsm8k", "gsm8k:0", "a b"):
        with pytest.raises(ValueError):
            parse_mix(bad)
    for bad in ("0", "5 minutes", "-3s", "m"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_schedule_parsing_and_phase_lookup():
    phases = parse_schedule("gsm8k for 5m, then humaneval:1,gsm8k:1 for 30s; then humaneval")
    assert phases == [Phase({"gsm8k": 1.0}, 300.0), Phase({"humaneval": 0.5, "gsm8k": 0.5}, 30.0), Phase({"humaneval": 1.0}, None)]
    assert [phase_at(phases, t) for t in (0, 299.9, 300, 329.9, 330, 1e6)] == [0, 0, 1, 1, 2, 2]
    finite = parse_schedule("gsm8k for 10s then humaneval for 10s")
    assert phase_at(finite, 25) == 1  # past the end: the last phase stays in force
    with pytest.raises(ValueError, match="needs 'for DURATION'"):
        parse_schedule("gsm8k, then humaneval")
    with pytest.raises(ValueError):
        parse_schedule("  ")


def test_domains_missing_from_built_prompt_sets_come_from_their_loader(tmp_path):
    """Prompt sets built before the Magpie prompts existed still serve magpie_* traffic, split kept."""
    from adaflash.pipelines.prompts import build_prompt_sets, load_domain

    build_prompt_sets(tmp_path, ["aime"])
    pools = load_pools(tmp_path, "train", None, {"magpie_chat"})
    want = [r.messages for r in load_domain("magpie_chat") if r.split == "train"]
    assert pools["magpie_chat"] == want and len(want) > 100


def test_usage_errors(capsys, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hi", "domain": "gsm8k"}) + "\n")
    cases = [
        (["--requests", "2", "--model", "m", "--domains", "humaneval"], "no prompts for domain(s) ['humaneval']"),
        (["--model", "m"], "give --duration or --requests"),
        (["--requests", "2", "--model", "m", "--schedule", "gsm8k, then x"], "needs 'for DURATION'"),
        (["--requests", "0", "--model", "m"], "must be >= 1"),
        (["--requests", "1", "--domains", "gsm8k", "--url", "http://127.0.0.1:9"], "cannot list models"),  # no server
    ]
    for extra, message in cases:
        code = main(["loadgen", "--prompts-file", str(f), *extra])
        err = capsys.readouterr().err
        assert code == 2 and message in err, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_hf_dir, tiny_drafter_dir, tmp_path_factory):
    """A real `adaflash serve` process on the tiny target, with a queue of 1 so bursts get 429."""
    root = tmp_path_factory.mktemp("serve")
    cfg = {
        "port": _free_port(),
        "model": {
            "name": "tiny",
            "target": str(tiny_hf_dir),
            "drafter": str(tiny_drafter_dir),
            "drafter_dtype": "float32",
            "policy": "fixed",
        },
        "engine": {"max_batch": 2, "max_queued": 1, "token_budget": 256},
        "trajectories": {"buffer_dir": str(root / "buffer")},
    }
    (root / "serve.yaml").write_text(yaml.safe_dump(cfg))
    log = open(root / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "adaflash.cli", "serve", "--config", str(root / "serve.yaml")], stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{cfg['port']}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if requests.get(url + "/ready", timeout=1).status_code == 200:
                break
        except requests.RequestException:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"adaflash serve did not get ready:\n{(root / 'serve.log').read_text()[-3000:]}")
        time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(30)
    log.close()


@pytest.fixture
def prompts(tmp_path) -> Path:
    f = tmp_path / "p.jsonl"
    rows = [{"prompt": f"What is {i} plus {i}?", "domain": "gsm8k"} for i in range(4)]
    rows += [{"prompt": f"Write a function that returns {i}.", "domain": "humaneval"} for i in range(4)]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return f


@pytest.mark.parametrize("stream", [False, True])
def test_schedule_run_against_real_server(server, prompts, tmp_path, capsys, stream):
    """4 requests/s, a shift after 1 s: the first 4 are gsm8k, the rest humaneval; all answer with tau stats
    (streamed too: the stats and usage come from the final chunks, and the time to the first token is kept)."""
    out = tmp_path / "results.jsonl"
    code = main(
        [
            "loadgen",
            *(["--stream"] if stream else []),
            "--url",
            server,
            "--prompts-file",
            str(prompts),
            "--rate",
            "4",
            "--concurrency",
            "4",
            "--schedule",
            "gsm8k for 1s, then humaneval",
            "--requests",
            "6",
            "--max-tokens",
            "8",
            "--max-retries",
            "30",
            "--out",
            str(out),
            "--json",
            "--report-every",
            "1",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert summary["ok"] == summary["requests"] == len(rows) == 6 and summary["failed"] == 0
    assert summary["completion_tokens"] == sum(r["completion_tokens"] for r in rows) > 0
    assert summary["mean_tau"] is not None and summary["mean_tau"] >= 1.0
    assert summary["drafter_versions"] == ["0"]
    assert sorted((r["phase"], r["domain"]) for r in rows) == [(0, "gsm8k")] * 4 + [(1, "humaneval")] * 2
    assert set(summary["per_domain"]) == {"gsm8k", "humaneval"} and len(summary["per_phase"]) == 2
    assert "loadgen t=" in captured.err  # progress lines
    assert all(r["id"] for r in rows) and all((r["ttft_s"] is not None) == stream for r in rows)


def test_retries_on_429_honouring_retry_after(server, prompts, capsys):
    """8 requests at once into a server that queues 1 and batches 2: 429s are retried until all succeed."""
    code = main(
        [
            "loadgen",
            "--url",
            server,
            "--prompts-file",
            str(prompts),
            "--rate",
            "0",
            "--concurrency",
            "8",
            "--requests",
            "8",
            "--domains",
            "gsm8k:1,humaneval:1",
            "--max-tokens",
            "16",
            "--max-retries",
            "30",
            "--json",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out)
    assert summary["requests"] == summary["ok"] == 8
    assert summary["retries"] > 0  # the queue of 1 did refuse some
    assert summary["wall_s"] >= 1.0  # ... and each refusal waited the server's Retry-After (1 s)
