"""The `llamacpp` bench peer: its decoding loop, the bench's checks before anything loads, and (where
`make llamacpp` built it) a real llama.cpp run on the packaged GGUF beside our engine."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
from adaflash.cli import main
from adaflash.pipelines.bench import llamacpp_python

PEER = Path(__file__).resolve().parents[1] / "pipelines" / "llamacpp_peer.py"


def peer_module():
    spec = importlib.util.spec_from_file_location("llamacpp_peer", PEER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Counting:
    """Fixed-output stand-in for llama_cpp.Llama inside this unit test of the loop alone: it yields
    prompt[-1] + 1, + 2, ... forever, as Llama.generate yields tokens until the caller stops."""

    def reset(self):
        pass

    def generate(self, ids, temp, reset):
        assert temp == 0.0 and reset
        t = ids[-1]
        while True:
            t += 1
            yield t


def test_peer_loop_keeps_eos_and_stops_at_max_new():
    outputs, wall = peer_module().run_cell(Counting(), [[1, 2], [10], [40]], 4, eos={13})
    assert outputs == [[3, 4, 5, 6], [11, 12, 13], [41, 42, 43, 44]] and wall >= 0


def test_bench_refuses_llamacpp_before_loading_anything(tmp_path, monkeypatch):
    common = ["bench", "--target", "smollm2", "--out", str(tmp_path / "b")]
    assert main([*common, "--methods", "ar,llamacpp", "--concurrency", "8"]) == 2  # one request at a time
    assert main([*common, "--methods", "ar,llamacpp", "--concurrency", "1", "--interleave"]) == 2
    monkeypatch.setenv("ADAFLASH_LLAMACPP_PYTHON", str(tmp_path / "missing" / "python"))
    with pytest.raises(FileNotFoundError, match="make llamacpp"):
        llamacpp_python()
    assert main([*common, "--methods", "ar,llamacpp", "--concurrency", "1"]) == 2


def _built() -> bool:
    try:
        python = llamacpp_python()
    except FileNotFoundError:
        return False
    return subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _built(), reason="llama.cpp peer not built (`make llamacpp`; not part of `make test`)")
def test_llamacpp_decodes_the_packaged_gguf_beside_the_engine(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}? Answer briefly.", "domain": "math"}) + "\n" for i in range(2)))
    out = tmp_path / "b"
    common = ["--target", "smollm2", "--dtype", "float32", "--prompts-file", str(prompts), "--max-new-tokens", "12"]
    assert main(["bench", *common, "--methods", "ar,llamacpp", "--concurrency", "1", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert rows["llamacpp"]["tokens_per_s"] > 0 and rows["llamacpp"]["n_requests"] == 2
    assert 2 <= rows["llamacpp"]["committed_tokens"] <= 24 and rows["ar"]["vs_best_peer"] > 0
