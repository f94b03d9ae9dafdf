"""Prompts the target writes itself (pipelines/magpie.py): sampling shards, filters, the prompt-set domains."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from adaflash.pipelines import magpie, prompts


def test_kinds_match_the_prompt_set_domains_and_the_plan_is_balanced():
    assert tuple(magpie.TOPICS) == prompts.MAGPIE_KINDS == tuple(magpie.REQUEST)
    jobs = magpie.plan(60)
    kinds = [k for k, _ in jobs]
    assert all(kinds.count(k) == 10 for k in prompts.MAGPIE_KINDS)
    assert magpie.plan(30) == jobs[:30]  # a larger n extends the plan: a rerun continues it
    assert len({t for k, t in jobs if k == "math"}) == 10  # each kind walks its topics


def test_user_prefix_is_the_template_up_to_the_user_turn(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prefix = magpie.user_prefix(tok, "You are a helpful assistant.")
    assert prefix.endswith("<|im_start|>user\n") and "You are a helpful assistant." in prefix


def test_sampling_writes_resumable_reproducible_shards(tiny_hf_dir, tmp_path):
    from adaflash.target import load_target

    target = load_target(str(tiny_hf_dir), "float32")
    a, b = tmp_path / "a", tmp_path / "b"
    stats = magpie.generate_raw(target, a, n=12, batch_size=6, max_new_tokens=6)
    assert stats["sampled_now"] == 12 and stats["tokens"] > 0
    assert [f.name for f in sorted(a.glob("raw-*.parquet"))] == ["raw-0000000.parquet", "raw-0000006.parquet"]
    again = magpie.generate_raw(target, a, n=18, batch_size=6, max_new_tokens=6)  # continues: only jobs 12..17
    assert again["sampled_now"] == 6
    magpie.generate_raw(target, b, n=6, batch_size=6, max_new_tokens=6)
    magpie.generate_raw(target, b, n=18, batch_size=6, max_new_tokens=6)  # stopped and resumed elsewhere
    rows = lambda d: [r for f in sorted(d.glob("raw-*.parquet")) for r in pq.read_table(f).to_pylist()]  # noqa: E731
    assert rows(a) == rows(b)  # a shard depends only on the seed and its first job
    assert [(r["kind"], r["topic"]) for r in rows(a)] == magpie.plan(18)


def _raw(d, texts):
    d.mkdir(parents=True, exist_ok=True)
    jobs = magpie.plan(len(texts))
    rows = [dict(kind=k, topic=t, seed=i, text=x, finished=f) for i, ((k, t), (x, f)) in enumerate(zip(jobs, texts))]
    pq.write_table(pa.Table.from_pylist(rows, schema=magpie.RAW_SCHEMA), d / "raw-0000000.parquet")


def test_filter_keeps_usable_turns_and_says_why_it_drops_the_rest(tmp_path):
    texts = [
        ("How do I plan a week-long trip to Portugal on a small budget?", True),
        ("Write a short poem about the sea at night, in four lines.", True),
        ("If every cat is an animal and some animals are black, are some cats black?", True),
        ("Why is the sky blue during the day but red at sunset?", True),
        ("A shirt costs $20 and is on sale for 15% off. What is the sale price?", True),
        ("Sure! Here is a Python function that sorts a list.", True),  # assistant voice
        ("How do I plan a week long trip to Portugal on a small budget please?", True),  # near-duplicate of 0
        ("Explain", True),  # too short
        ("Qu'est-ce que c'est la photosynthèse? Expliquez-moi en détail s'il vous plaît.", True),  # not English
        ("What is the boiling point of water at high altitude and why does it", False),  # truncated
        ("As an AI language model I cannot browse, but what is the capital of Peru?", True),  # refusal voice
        ("What is the derivative of x squared times the sine of x?", True),
    ]
    _raw(tmp_path, texts)
    rep = magpie.filter_raw(tmp_path)
    assert rep["raw_turns"] == 12 and rep["kept"] == 6
    assert rep["reasons"] == {
        "kept": 6,
        "assistant voice or refusal": 2,
        "near-duplicate": 1,
        "too short": 1,
        "not English": 1,
        "truncated": 1,
    }
    kept = [json.loads(line) for line in (tmp_path / "magpie.jsonl").read_text().splitlines()]
    assert [k["text"] for k in kept] == [texts[i][0] for i in (0, 1, 2, 3, 4, 11)]
    assert rep["kinds"]["chat"]["kept"] == 1 and 0 < rep["distinct_1"] <= 1
    assert "| chat | 1 |" in (tmp_path / "report.md").read_text()


def test_near_duplicates_are_found_past_common_phrases(tmp_path):
    """A 3-gram held by many kept turns ("how do i") stops proposing candidates (the check would grow
    with the square of the turns); a near-duplicate still shares its rarer 3-grams and is dropped."""
    words = [f"w{i}x" for i in range(400)]
    w = [words[4 * i : 4 * i + 4] for i in range(90)]
    texts = [(f"How do I {a} the {b} with {c} and {d} today?", True) for a, b, c, d in w]
    texts.append(("How do I " + texts[80][0][len("How do I ") : -len(" today?")] + " tomorrow?", True))
    _raw(tmp_path, texts)
    rep = magpie.filter_raw(tmp_path)
    assert magpie.COMMON_SHINGLE < 90 and rep["reasons"] == {"kept": 90, "near-duplicate": 1}


def test_magpie_domains_load_with_a_deterministic_split(tmp_path, monkeypatch):
    _raw(tmp_path, [(f"Question number {i}: what is {i} plus {i * 7} in words, exactly?", True) for i in range(60)])
    magpie.filter_raw(tmp_path, dup_jaccard=1.01)  # near-identical on purpose: keep them all
    monkeypatch.setattr(prompts, "MAGPIE_FILE", tmp_path / "magpie.jsonl")
    assert "magpie_math" in prompts.available_domains()
    recs = prompts.load_domain("magpie_math")
    assert len(recs) == 10 and all(r.prompt_id.startswith("magpie_math/") for r in recs)
    assert [r.split for r in recs] == [prompts.split_for(r.prompt_id, 10) for r in recs]
    paths = prompts.build_prompt_sets(tmp_path / "sets", domains=[f"magpie_{k}" for k in prompts.MAGPIE_KINDS])
    n = sum(pq.read_metadata(p).num_rows for p in paths.values())
    assert n == 60
    monkeypatch.setattr(prompts, "MAGPIE_FILE", tmp_path / "missing.jsonl")
    assert "magpie_math" not in prompts.available_domains()
    with pytest.raises(FileNotFoundError, match="adaflash prompts"):
        prompts.load_domain("magpie_math")


def test_cli_filter_only_without_shards_says_what_to_do(tmp_path, capsys):
    from adaflash.cli import main

    assert main(["prompts", "--filter-only", "--out", str(tmp_path)]) == 2
    assert "run without --filter-only first" in capsys.readouterr().err


def test_the_magpie_stage_continues_the_committed_set_and_adds_only_new_prompts(tmp_path, tiny_hf_dir, monkeypatch):
    """pretrain's `magpie` stage (the GPU recipe's first) continues the base (committed) set: its raw turns
    copied, more sampled by the target after them, all filtered in one pass (a new turn that copies a
    committed prompt is dropped: it could be in their eval slice), the kept new prompts appended to the
    run's prompt sets, each to its split, after the rows there; a rerun adds nothing."""
    from adaflash.pipelines.pretrain import PretrainConfig, run_stages

    from adaflash.config import from_dict

    def raw(d, first, texts):  # turns of jobs first.. as sampled (one shard)
        d.mkdir(parents=True, exist_ok=True)
        jobs = magpie.plan(first + len(texts))[first:]
        rows = [dict(kind=k, topic=t, seed=first + i, text=x, finished=True) for i, ((k, t), x) in enumerate(zip(jobs, texts))]
        pq.write_table(pa.Table.from_pylist(rows, schema=magpie.RAW_SCHEMA), d / f"raw-{first:07d}.parquet")

    committed = "How do I keep basil alive on a windowsill through the winter months?"
    base, run = tmp_path / "base", tmp_path / "run"
    raw(base, 0, [committed])
    magpie.filter_raw(base)
    monkeypatch.setattr(prompts, "MAGPIE_FILE", base / "magpie.jsonl")
    sets = prompts.build_prompt_sets(run / "prompts", ["gsm8k", *(f"magpie_{k}" for k in prompts.MAGPIE_KINDS)])
    before = {s: prompts.read_prompts(p) for s, p in sets.items()}
    new = [f"Could you explain topic number {i} about {w} in plain words for a beginner?" for i, w in enumerate("abcdefghijkl")]
    raw(run / "magpie", 1, [committed, *new])  # sampled before a stop: the stage resumes after them
    cfg = from_dict(
        PretrainConfig,
        {
            "run_dir": str(run),
            "target": {"source": str(tiny_hf_dir), "device": "cpu"},
            "regen": {"dtype": "float32"},
            "magpie": {"n": 18, "base": str(base), "batch_size": 6, "max_new_tokens": 4},
        },
    )
    out = run_stages(cfg, ["magpie"])["magpie"]
    assert out["base_turns"] == 1 and out["sampled_now"] == 5  # jobs 14..18, for real
    assert out["kept"] == 13  # the committed prompt and the 12 new; its copy and the tiny target's cut turns dropped
    added = [r for s in prompts.SPLITS for r in prompts.read_prompts(sets[s])[len(before[s]) :]]
    assert sorted(r.messages[0]["content"] for r in added) == sorted(new)
    assert sum(out["added"].values()) == 12 and all(r.split == prompts.split_for(r.prompt_id, 10) for r in added)
    for s in prompts.SPLITS:  # the rows there before stay first: an eval of the first N reads the same prompts
        assert prompts.read_prompts(sets[s])[: len(before[s])] == before[s]
    assert run_stages(cfg, ["magpie"])["magpie"]["added"] == {"train": 0, "eval": 0}
    kept = (run / "magpie" / "magpie.jsonl").read_text().splitlines()
    assert kept[0] == (base / "magpie.jsonl").read_text().strip()  # a drop-in successor: the base's prompts first
