"""The SGLang backend as far as a machine without SGLang (no GPU, no AMX) can test it: the command
line, the parsing of SGLang's per-request stats into rounds, the config, the files the export writes
for SGLang, the hot-swap decisions, and the reader thread over a stand-in of SGLang's streamed
/generate. SGLang itself runs in scripts/gpu_check_sglang.sh (a GPU)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from adaflash.server.config import ModelSection, ServeConfig, SGLangSection
from adaflash.server.sglang_backend import SGLangEngine, SGLangServer, judge_probes, rounds_from_chunks, swap_plan
from conftest import tiny_drafter, tiny_target
from safetensors.torch import load_file

from adaflash.dflash_sglang import sglang_python, write_sglang_target
from adaflash.request import Request


def _server(tmp_path, drafter_dir="/d", extra=None) -> SGLangServer:
    python, log = Path("/opt/sglang/bin/python"), tmp_path / "s.log"
    return SGLangServer(python, Path("/t"), drafter_dir, 8, 4321, 2048, 16, "bfloat16", 0.7, log, extra)


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_command_line_starts_sglang_with_dflash_and_a_chunk_per_step(tmp_path):
    cmd = _server(tmp_path, extra=["--attention-backend", "triton"]).cmd
    assert cmd[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    assert _flag(cmd, "--model-path") == "/t" and _flag(cmd, "--host") == "127.0.0.1" and _flag(cmd, "--port") == "4321"
    assert _flag(cmd, "--speculative-algorithm") == "DFLASH" and _flag(cmd, "--speculative-draft-model-path") == "/d"
    assert _flag(cmd, "--speculative-num-draft-tokens") == "8"  # the verify length (block) per step
    assert _flag(cmd, "--stream-interval") == "1"  # what makes rounds exact
    assert _flag(cmd, "--mem-fraction-static") == "0.7" and _flag(cmd, "--context-length") == "2048"
    assert cmd[-2:] == ["--attention-backend", "triton"]
    plain = _server(tmp_path, drafter_dir=None).cmd
    assert "--speculative-algorithm" not in plain
    moved = _server(tmp_path).with_dirs(Path("/t2"), Path("/d2")).cmd  # a restart: same flags, new directories
    assert _flag(moved, "--model-path") == "/t2" and _flag(moved, "--speculative-draft-model-path") == "/d2"
    assert _flag(moved, "--port") == "4321"


# The final streamed /generate chunk of a DFLASH request. Its shape follows SGLang's
# TokenizerManager._calculate_spec_decoding_metrics (srt/managers/tokenizer_manager.py): spec_verify_ct,
# spec_accept_rate, spec_accept_length (completion_tokens / verify_ct), spec_num_correct_drafts /
# spec_num_proposed_drafts with their older aliases, and the per-step accepted-drafts histogram
# (spec_correct_drafts_histogram, alias spec_accept_histogram); finish_reason {"type", ...}.
FINAL = {
    "text": "...",
    "output_ids": list(range(100, 112)),
    "meta_info": {
        "id": "r0",
        "finish_reason": {"type": "length", "length": 12},
        "prompt_tokens": 5,
        "completion_tokens": 12,
        "spec_verify_ct": 3,
        "spec_accept_rate": 11 / 21,
        "spec_accept_length": 4.0,
        "spec_num_correct_drafts": 11,
        "spec_num_proposed_drafts": 21,
        "spec_accepted_drafts": 11,
        "spec_proposed_drafts": 21,
        "spec_correct_drafts_histogram": [0, 0, 1, 0, 1, 1, 0, 0],
        "spec_accept_histogram": [0, 0, 1, 0, 1, 1, 0, 0],
    },
}


def test_streamed_chunks_become_exact_rounds():
    # prefill: 1 token; then steps committing 3 (2 accepted), 6 (5 accepted) and 5 (4 accepted), of which
    # max_new_tokens keeps 2: the last round counts what was kept
    rounds = rounds_from_chunks(5, [1, 3, 6, 2], FINAL["meta_info"], 8)
    assert [(r.anchor, r.accepted, r.verify_len) for r in rounds] == [(5, 2, 8), (8, 5, 8), (14, 1, 8)]
    assert all(r.draft == [] and r.target == [] for r in rounds)


def test_merged_chunks_give_no_rounds_rather_than_invented_ones():
    meta = FINAL["meta_info"]
    assert rounds_from_chunks(5, [1, 9, 2], meta, 8) is None  # two steps in one chunk: boundaries unknown
    assert rounds_from_chunks(5, [4, 6, 2], meta, 8) is None  # prefill merged with a step
    assert rounds_from_chunks(5, [1, 3, 6, 2], {**meta, "spec_correct_drafts_histogram": [0, 3]}, 8) is None  # disagrees
    assert rounds_from_chunks(5, [1, 3, 6, 2], {"completion_tokens": 12}, 8) == []  # no speculation (plain decoding)
    old = {"spec_verify_ct": 3, "spec_accept_token_num": 11, "spec_accept_histogram": [0, 0, 1, 0, 1, 1]}  # older field names
    assert len(rounds_from_chunks(5, [1, 3, 6, 2], old, 8)) == 3


def test_config_validation_and_the_serve_flag():
    ServeConfig(backend="sglang")
    with pytest.raises(ValueError, match="'head' needs the builtin backend; with backend sglang"):
        ServeConfig(backend="sglang", model=ModelSection(policy="head"))
    with pytest.raises(ValueError, match="engine.tree needs the builtin backend"):
        from adaflash.server.config import EngineSection

        ServeConfig(backend="sglang", engine=EngineSection(tree=4))
    with pytest.raises(ValueError, match="sglang.swap must be"):
        SGLangSection(swap="sometimes")
    with pytest.raises(ValueError, match="mem_fraction_static"):
        SGLangSection(mem_fraction_static=1.5)
    with pytest.raises(ValueError, match="backend must be one of builtin, vllm, sglang"):
        ServeConfig(backend="trt")


def test_a_missing_sglang_venv_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.delenv("ADAFLASH_SGLANG_PYTHON", raising=False)
    with pytest.raises(FileNotFoundError, match="pip install 'sglang") as e:
        sglang_python(str(tmp_path / "none" / "python"))
    assert "sglang.python" in str(e.value) and "GPU" in str(e.value)
    (tmp_path / "python").write_text("")
    assert sglang_python(str(tmp_path / "python")) == tmp_path / "python"


def test_export_writes_what_sglang_needs(tmp_path, tiny_hf_dir, tiny_drafter_dir):
    """The drafter: DFlash config with the mask token's text and id; the target copy: the learned mask
    as row mask_token_id, the LM head untied and equal to the original embedding, every other row kept."""
    from adaflash.cli import main

    out, tgt = tmp_path / "dflash", tmp_path / "sglang-target"
    args = ["--target", str(tiny_hf_dir), "--dtype", "float32", "--sglang-target", str(tgt)]
    assert main(["export", str(tiny_drafter_dir), str(out), *args]) == 0
    dcfg = json.loads((out / "config.json").read_text())["dflash_config"]
    assert dcfg["mask_token_id"] == 15 and dcfg["mask_token"] == "<jupyter_script>"  # SGLang checks the pair
    mask = load_file(str(out / "model.safetensors"))["mask_embedding"]
    orig, new = load_file(str(tiny_hf_dir / "model.safetensors")), load_file(str(tgt / "model.safetensors"))
    e0, e1 = orig["model.embed_tokens.weight"], new["model.embed_tokens.weight"]  # [V, H]
    assert torch.equal(e1[15], mask) and not torch.equal(e0[15], mask)
    assert torch.equal(torch.cat([e1[:15], e1[16:]]), torch.cat([e0[:15], e0[16:]]))
    assert torch.equal(new["lm_head.weight"], e0)  # the target's logits are the original ones
    assert json.loads((tgt / "config.json").read_text())["tie_word_embeddings"] is False
    assert (tgt / "tokenizer.json").is_symlink()
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        write_sglang_target(tiny_hf_dir, tmp_path / "bad", 10**6, mask)


def test_swap_plan_and_probe_judgement():
    assert swap_plan("restart", False) == "restart"
    assert swap_plan("auto", False) == "inplace" and swap_plan("auto", True) == "restart"
    with pytest.raises(ValueError, match="MASK differs"):
        swap_plan("inplace", True)
    before = [((1, 2, 3), 10, 12), ((4, 5), 6, 3)]
    assert judge_probes(before, [((1, 2, 3), 9, 14), ((4, 5), 6, 3)]) == (True, "draft changed, target unchanged")
    assert judge_probes(before, list(before))[1].startswith("the draft did not change")
    assert judge_probes(before, [((1, 2, 9), 10, 12), ((4, 5), 6, 3)])[1].startswith("the target changed")


class _FakeSGLang(BaseHTTPRequestHandler):
    """Stands in for SGLang's two swap endpoints in this unit test of the swap decisions only."""

    update = (200, {"success": True, "message": "Succeeded to update model weights."})
    generated = {"output_ids": [7, 8, 9], "meta_info": {"spec_verify_ct": 2, "spec_num_correct_drafts": 1}}
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((self.path, body))
        code, out = self.update if self.path == "/update_weights_from_disk" else (200, self.generated)
        data = json.dumps(out).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_sglang():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeSGLang)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()


def test_in_place_update_request_and_refusal(tmp_path, fake_sglang):
    s = _server(tmp_path)
    s.url = f"http://127.0.0.1:{fake_sglang.server_address[1]}"
    _FakeSGLang.seen.clear()
    assert s.update_draft(Path("/x/dflash-v3"), "3", {"update_speculative_draft": True}) == (True, "Succeeded to update model weights.")
    path, body = _FakeSGLang.seen[-1]
    assert path == "/update_weights_from_disk" and body["model_path"] == "/x/dflash-v3" and body["weight_version"] == "3"
    assert body["abort_all_requests"] is False and body["update_speculative_draft"] is True  # drop nothing; selector passed on
    assert s.probe([[1, 2]], 16) == [((7, 8, 9), 2, 1)]
    assert _FakeSGLang.seen[-1][1]["sampling_params"] == {"max_new_tokens": 16, "temperature": 0.0}
    _FakeSGLang.update = (400, {"success": False, "message": "draft_runners"})  # e.g. the DFlash routing bug
    assert s.update_draft(Path("/x"), "4", {}) == (False, "draft_runners")
    _FakeSGLang.update = (200, {"success": True, "message": "Succeeded to update model weights."})


class _StreamingSGLang(BaseHTTPRequestHandler):
    """SGLang's streamed /generate (server-sent events, cumulative output_ids, a chunk per verify step) for
    the reader thread's test; the prompt's first id picks the answer: 0 the four chunks of FINAL's
    request, 1 a refusal, 2 a long slow stream (its client leaving is recorded in `aborted`)."""

    aborted = threading.Event()

    def do_POST(self):
        kind = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["input_ids"][0]
        if kind == 1:
            self.send_response(503)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"busy")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        sizes, ids = [1, 3, 6, 2] if kind == 0 else [1] * 500, []
        try:
            for i, n in enumerate(sizes):
                ids += range(100 + len(ids), 100 + len(ids) + n)
                meta = FINAL["meta_info"] if i == len(sizes) - 1 else {"id": "r0"}
                self.wfile.write(f"data: {json.dumps({'output_ids': ids, 'meta_info': meta})}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.02 * (kind == 2))
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            type(self).aborted.set()

    def log_message(self, *args):
        pass


def test_streamed_requests_finish_with_their_tokens_rounds_errors_stops_and_cancels(tmp_path):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _StreamingSGLang)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    server = _server(tmp_path)
    server.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    drafter = tiny_drafter(tiny_target(), block_size=8)
    engine = SGLangEngine(server, drafter, "1", 8, (4, 512, 2048), SGLangSection(work_dir=str(tmp_path)), tmp_path, None, [])

    def run(rid, prompt, stop=None, cancel_after_first=False):
        engine.submit(Request(rid, prompt, max_new_tokens=1000, stop=stop))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if cancel_after_first and any(s.out for s in engine.running):
                engine.cancel(rid)
                cancel_after_first = False
            if done := engine.step():
                return done[0]
        raise TimeoutError(rid)

    st = run("a", [0, 1, 2, 3, 4])
    assert st.finish_reason == "length" and st.out == list(range(100, 112))
    assert [(r.anchor, r.accepted, r.verify_len) for r in st.rounds] == [(5, 2, 8), (8, 5, 8), (14, 1, 8)]
    st = run("b", [1, 2])
    assert st.finish_reason == "error" and st.out == [] and st.rounds == []
    _StreamingSGLang.aborted.clear()
    st = run("c", [2, 3], stop=lambda out: 3 if len(out) >= 5 else None)
    assert st.finish_reason == "stop" and st.out == [100, 101, 102]
    assert _StreamingSGLang.aborted.wait(10)  # leaving the stream aborts the request
    _StreamingSGLang.aborted.clear()
    st = run("d", [2, 4], cancel_after_first=True)
    assert st.finish_reason == "cancelled" and st.out[:1] == [100] and st.rounds == []
    assert _StreamingSGLang.aborted.wait(10)
    assert engine.idle and engine.stats["rows_inexact"] == 0
    httpd.shutdown()
