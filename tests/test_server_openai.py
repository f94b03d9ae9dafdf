"""`adaflash serve` through the official `openai` client: chat and completions, streaming and not;
greedy output equals plain decoding (the server verifies token trees with a prompt-lookup branch);
stop strings; every finished request lands in the trajectory buffer, flushed by the graceful shutdown."""

from __future__ import annotations

import openai
import pytest
from conftest import greedy_reference
from serve_util import running_server, serve_config

from adaflash.buffer import ShardReader
from adaflash.target import load_target

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def target(tiny_hf_dir):
    return load_target(str(tiny_hf_dir), "float32")


@pytest.fixture(scope="module")
def served(target, tiny_hf_dir, tiny_drafter_dir, tmp_path_factory):
    """One server for the module; yields (client, state, record of finished request ids -> (ids, domain))."""
    buffer_dir = tmp_path_factory.mktemp("buffer")
    cfg = serve_config(tiny_hf_dir, tiny_drafter_dir, buffer_dir, engine={"tree": 4, "lookup": 4, "lookup_min_ngram": 1})
    finished: dict[str, tuple] = {}
    with running_server(cfg, target=target, api_key="sk-test") as (url, state, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0, timeout=60)
        yield client, state, finished
    # The lifespan shutdown has flushed the writer: every finished request is in a shard.
    rows = {t.request_id: t for b in ShardReader(buffer_dir).poll() for t in b.trajectories()}
    assert set(finished) <= set(rows), f"missing trajectories: {set(finished) - set(rows)}"
    for rid, (ids, domain) in finished.items():
        assert rows[rid].output_ids == ids and rows[rid].domain == domain and rows[rid].writer_id == "test-node"
        assert rows[rid].drafter_version == "0" and len(rows[rid].rounds) >= 1


def plain(target, ids, n) -> tuple[list[int], str]:
    out = greedy_reference(target.model, ids, n, target.eos_ids)
    return out, target.tokenizer.decode(out, skip_special_tokens=True)


def test_models_list(served):
    client, _, _ = served
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_chat_greedy_equals_plain_decoding(served, target):
    client, _, finished = served
    ids, text = plain(target, target.encode_chat(MESSAGES), 24)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, metadata={"domain": "math"})
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("stop" if ids[-1] in target.eos_ids else "length")
    assert r.usage.prompt_tokens == len(target.encode_chat(MESSAGES)) and r.usage.completion_tokens == len(ids)
    stats = r.model_extra["adaflash"]
    assert stats["drafter_version"] == "0" and stats["policy"] == "cost"  # auto: the cost policy
    assert stats["target_forwards"] == stats["rounds"] + 1 and sum(stats["accepted"]["histogram"]) == stats["rounds"]
    assert stats["tau"] == pytest.approx((len(ids) - 1) / stats["rounds"], abs=1e-3)
    finished[r.id] = (ids, "math")


def test_chat_stream_equals_non_stream(served, target):
    client, _, finished = served
    ids, text = plain(target, target.encode_chat(MESSAGES), 24)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    body = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert body == text
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason in ("stop", "length") and last.model_extra["adaflash"]["rounds"] >= 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert len({c.id for c in chunks}) == 1
    finished[chunks[0].id] = (ids, None)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_equals_plain_decoding(served, target, stream):
    client, _, finished = served
    ids, text = plain(target, target.tokenizer.encode(PROMPT), 20)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, extra_body={"metadata": {"domain": "geo"}})
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        got, rid, finish = "".join(c.choices[0].text for c in chunks), chunks[0].id, chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**kw)
        got, rid, finish = r.choices[0].text, r.id, r.choices[0].finish_reason
        assert r.usage.completion_tokens == len(ids)
    assert got == text and finish in ("stop", "length")
    finished[rid] = (ids, "geo")


def test_stop_string_truncates_text_and_output(served, target):
    client, _, finished = served
    _, text = plain(target, target.tokenizer.encode(PROMPT), 20)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "the greedy text should have a non-blank middle to stop at"
    for stream in (False, True):
        kw = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop, "\x00never"])
        if stream:
            chunks = list(client.completions.create(stream=True, **kw))
            got, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            r = client.completions.create(**kw)
            got, finish = r.choices[0].text, r.choices[0].finish_reason
            # the engine stopped at the token completing the stop string: fewer tokens than max_tokens
            assert r.usage.completion_tokens < 20
        assert got == text[: text.index(stop)] and finish == "stop"


def test_seeded_sampling_is_reproducible(served):
    client, _, _ = served
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text


def test_concurrent_requests_all_match_plain(served, target):
    """Requests decoded in one batch each still equal their own plain decoding."""
    from concurrent.futures import ThreadPoolExecutor

    client, _, _ = served
    prompts = [f"Count to {i}:" for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        texts = list(
            pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text, prompts)
        )
    for p, got in zip(prompts, texts):
        assert got == plain(target, target.tokenizer.encode(p), 16)[1]
