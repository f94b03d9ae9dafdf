"""`adaflash fit-head` and `adaflash bench` end to end on a tiny random target with a real tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
from adaflash.cli import main


def test_fit_head_then_bench_all_methods(tiny_hf_dir, tiny_drafter_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path / "cache"))  # where `cost` keeps its step-cost calibration
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}: what is {i} + {i}?", "domain": "math"}) + "\n" for i in range(6)))
    drafter = tmp_path / "drafter"  # fit-head writes the head beside the drafter: keep the shared fixture head-free
    shutil.copytree(tiny_drafter_dir, drafter)
    common = ["--target", str(tiny_hf_dir), "--drafter", str(drafter), "--prompts-file", str(prompts), "--max-new-tokens", "10"]
    assert main(["fit-head", *common, "--concurrency", "3", "--epochs", "2"]) == 0
    metrics = json.loads((drafter / "length_head.json").read_text())["metrics"]
    assert metrics["rounds"] > 0 and metrics["n_val"] > 0
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            *common,
            "--methods",
            "ar,fixed,fixed2,ema,head,cost,hf,hf-pld",
            "--concurrency",
            "1,3",
            "--token-budget",
            "64",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    rows = res["rows"]
    assert len(rows) == 8 * 2 - 1  # hf-pld (batch-1 only in transformers) runs at concurrency 1 only
    assert {r["concurrency"] for r in rows if r["method"] == "hf-pld"} == {1}
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["n_requests"] == 6
        if r["method"] == "ar":
            assert r["speedup_vs_ar"] == 1.0 and r["tau"] == 1.0
    # every engine method commits the same greedy tokens as plain decoding
    committed = {(r["method"], r["concurrency"]): r["committed_tokens"] for r in rows}
    assert len({v for (m, c), v in committed.items() if m in ("ar", "fixed", "fixed2", "ema", "head", "cost")}) == 1
    assert all(r["same_as_ar"] == 1.0 for r in rows if not r["method"].startswith("hf"))  # token for token, per request
    assert (out / "throughput.png").exists() and (out / "head_pred_vs_true.png").exists()
    report = (out / "report.md").read_text()
    assert "| math | 3 | head |" in report and "| fastest | method | vs ar | vs the best fixed length |" in report
    assert "cores, torch threads" in report and "ATen " in report and "; target float32, drafter " in report  # which machine and forms
    # the calibration's caching is test_policy_cost's (a sweep disturbed by other processes is not kept)
    assert "| cost | " in report.split("vs the best fixed length |")[1]
    assert main(["bench", *common, "--methods", "warp"]) == 2
    # --min-requests: a cell runs max(min_requests, concurrency) prompts; with a draft vocabulary,
    # `-fullvocab` runs the same method drafting from the whole vocabulary, and both stay lossless
    import torch
    from adaflash.pipelines.draft_vocab import write

    write(drafter, torch.arange(0, 49152, 2), {"size": 24576})
    # `-lookup` adds prompt lookup in the engine (ar-lookup: lookup alone), output unchanged
    assert (
        main(
            [
                "bench",
                *common,
                "--methods",
                "ar,fixed,fixed-fullvocab,fixed-lookup,ar-lookup",
                "--concurrency",
                "1,3",
                "--min-requests",
                "2",
                "--lookup-len",
                "3",
                "--lookup-min-ngram",
                "1",
                "--out",
                str(tmp_path / "b2"),
            ]
        )
        == 0
    )
    rows = json.loads((tmp_path / "b2" / "results.json").read_text())["rows"]
    assert {(r["concurrency"], r["n_requests"]) for r in rows} == {(1, 2), (3, 3)}
    assert len({r["committed_tokens"] for r in rows if r["concurrency"] == 3}) == 1 and len(rows) == 10
    assert all((r["lookup_rounds"] > 0) == r["method"].endswith("-lookup") for r in rows)
    # `treeN`: greedy token trees in the engine (`-lookup` grafts the chain into each tree), output unchanged
    trees = ["--methods", "ar,tree3,tree3-lookup", "--concurrency", "1,3", "--min-requests", "3", "--out", str(tmp_path / "bt")]
    assert main(["bench", *common, *trees]) == 0
    rows = json.loads((tmp_path / "bt" / "results.json").read_text())["rows"]
    assert len(rows) == 6 and len({r["committed_tokens"] for r in rows}) == 1
    assert main(["bench", *common, "--methods", "ar-fullvocab"]) == 2
    assert main(["bench", *common, "--methods", "ar-lookup", "--lookup-min-ngram", "4"]) == 2
    write(drafter, None, None)
    # --repeats: every method runs N times per cell; the row keeps each run and the median of the ratios
    assert (
        main(
            [
                "bench",
                *common,
                "--methods",
                "ar,fixed",
                "--concurrency",
                "2",
                "--min-requests",
                "2",
                "--repeats",
                "3",
                "--out",
                str(tmp_path / "b3"),
            ]
        )
        == 0
    )
    res = json.loads((tmp_path / "b3" / "results.json").read_text())
    ar, fixed = sorted(res["rows"], key=lambda r: r["method"])
    assert res["meta"]["repeats"] == 3 and len(ar["tokens_per_s_runs"]) == len(fixed["tokens_per_s_runs"]) == 3
    assert ar["tokens_per_s"] == sorted(ar["tokens_per_s_runs"])[1] and ar["speedup_vs_ar"] == 1.0
    ratios = sorted(f / a for f, a in zip(fixed["tokens_per_s_runs"], ar["tokens_per_s_runs"]))
    assert fixed["speedup_vs_ar"] == ratios[1]
    assert "3 repeats per cell" in (tmp_path / "b3" / "report.md").read_text()
    # the roofline: each engine row says what fraction of the measured machine limit its steps reach
    lim = ar["machine_limits"]
    assert lim["gflops"] > 0 and lim["gbps"] > 0 and 0 < ar["of_limit"] <= 1.0 and 0 < fixed["of_limit"] <= 1.0
    assert "GFLOP/s" in (tmp_path / "b3" / "report.md").read_text()
    assert main(["bench", *common, "--repeats", "0"]) == 2
    # --temperature: seeded sampled requests, and every engine method (cost, trees, lookup) emits plain
    # decoding's seeded sample token for token; --unseeded ones take the rejection rule, not compared
    sampled = ["--concurrency", "3", "--min-requests", "3", "--temperature", "0.9"]
    methods = ["--methods", "ar,fixed,cost,tree3-lookup"]
    assert main(["bench", *common, *methods, *sampled, "--out", str(tmp_path / "b4")]) == 0
    rows = json.loads((tmp_path / "b4" / "results.json").read_text())["rows"]
    assert len(rows) == 4 and all(r["same_as_ar"] == 1.0 for r in rows)
    assert "sampled at temperature 0.9, seeded" in (tmp_path / "b4" / "report.md").read_text()
    assert main(["bench", *common, *methods, *sampled, "--unseeded", "--out", str(tmp_path / "b5")]) == 0
    rows = json.loads((tmp_path / "b5" / "results.json").read_text())["rows"]
    assert len(rows) == 4 and all("same_as_ar" not in r for r in rows)
    assert main(["bench", *common, "--methods", "ar,hf", "--temperature", "0.9"]) == 2  # peers decode greedily
    assert main(["bench", *common, "--methods", "ar,fixed", "--unseeded"]) == 2  # unseeded needs sampling


def test_fit_head_on_a_shorter_block_then_serve_it(tiny_hf_dir, tiny_drafter_dir, tmp_path):
    """`fit-head --draft-len L` fits the head on L-position blocks; the head policy then drafts and
    verifies at most L, still committing plain decoding's greedy tokens. Out-of-range L is a usage error."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Count {i} apples and {i} pears."}) + "\n" for i in range(5)))
    drafter = tmp_path / "drafter"
    shutil.copytree(tiny_drafter_dir, drafter)
    common = ["--target", str(tiny_hf_dir), "--drafter", str(drafter), "--prompts-file", str(prompts), "--max-new-tokens", "10"]
    k = json.loads((drafter / "config.json").read_text())["block_size"]
    assert main(["fit-head", *common, "--draft-len", str(k + 1)]) == 2
    assert main(["fit-head", *common, "--draft-len", "3", "--concurrency", "2", "--epochs", "2"]) == 0
    meta = json.loads((drafter / "length_head.json").read_text())
    assert meta["config"]["block_size"] == 3 and meta["metrics"]["rounds"] > 0
    out = tmp_path / "bench"
    assert main(["bench", *common, "--methods", "ar,head", "--concurrency", "2", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert rows["head"]["committed_tokens"] == rows["ar"]["committed_tokens"]
    assert rows["head"]["max_step_tokens"] <= 2 * 3


def test_roofline_costs_count_each_linear_weight_once():
    import torch
    from adaflash.pipelines.roofline import step_fraction, target_costs

    net = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 8, bias=False))
    net[1].weight = torch.nn.Parameter(net[0].weight.t().contiguous())
    tied = torch.nn.ModuleList([net[0], net[0]])  # one weight reached twice counts once
    assert target_costs(tied) == {"flops_per_token": 2 * 128, "bytes_per_step": 128 * 4}
    from adaflash.quant import Int8Linear

    quant = torch.nn.ModuleList([Int8Linear(torch.randn(16, 8), torch.bfloat16)])  # int8 weight + a bf16 scale per row
    assert target_costs(quant) == {"flops_per_token": 2 * 128, "bytes_per_step": 128 + 16 * 2}
    costs, limits = {"flops_per_token": 2e9, "bytes_per_step": 1e9}, {"gflops": 100.0, "gbps": 10.0}
    assert step_fraction(1, 0.2, costs, limits) == 0.5  # memory-bound: reading 1 GB at 10 GB/s takes 0.1 s
    assert step_fraction(100, 4.0, costs, limits) == 0.5  # compute-bound: 200 GFLOP at 100 GFLOP/s take 2 s


def test_bench_shift_serves_two_domains_on_one_engine_per_method(tiny_hf_dir, tiny_drafter_dir, tmp_path, monkeypatch):
    """`bench --shift FROM,TO`: rounds of FROM's prompts, then TO's, each method on one engine kept across
    rounds; per round tok/s, the ratio to ar and the share of undrafted rounds, output unchanged."""
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "p.jsonl"
    lines = [{"prompt": f"Question {i}: what is {i} + {i}?", "domain": "math"} for i in range(4)]
    lines += [{"prompt": f"Write a poem about the number {i}.", "domain": "poems"} for i in range(6)]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    common = ["bench", "--target", str(tiny_hf_dir), "--drafter", str(tiny_drafter_dir), "--prompts-file", str(prompts)]
    common += ["--max-new-tokens", "8", "--concurrency", "2", "--out", str(tmp_path / "shift")]
    assert main([*common, "--methods", "ar,cost,fixed2", "--shift", "math,poems", "--shift-rounds", "2,3"]) == 0
    rows = json.loads((tmp_path / "shift" / "shift.json").read_text())["rows"]
    assert [(r["round"], r["domain"], r["after_shift"]) for r in rows if r["method"] == "cost"] == [
        (1, "math", None),
        (2, "math", None),
        (3, "poems", 1),
        (4, "poems", 2),
        (5, "poems", 3),
    ]
    for rnd in range(1, 6):
        here = {r["method"]: r for r in rows if r["round"] == rnd}
        assert here["ar"]["speedup_vs_ar"] == 1.0 and len({r["committed_tokens"] for r in here.values()}) == 1
        assert (
            here["ar"]["undrafted_rounds"] == 1.0 and here["fixed2"]["undrafted_rounds"] < 0.5
        )  # 1 only where max_new_tokens leaves no draft
    assert "| 3 | poems | 1 |" in (tmp_path / "shift" / "shift.md").read_text() and (tmp_path / "shift" / "shift.png").exists()
    assert main([*common, "--methods", "ar,cost", "--shift", "math,poems", "--shift-rounds", "1,2", "--repeats", "3"]) == 0
    rows = json.loads((tmp_path / "shift" / "shift.json").read_text())["rows"]  # each round: three runs on fresh engines
    assert len(rows) == 6 and all(len(r["speedup_runs"]) == 3 and len(r["tokens_per_s_runs"]) == 3 for r in rows)
    cost = [r for r in rows if r["method"] == "cost"]
    assert all(r["speedup_vs_ar"] == sorted(r["speedup_runs"])[1] for r in cost)  # the median
    md = (tmp_path / "shift" / "shift.md").read_text()
    assert "x [" in md and "1.00x [1.00-1.00]" not in md  # the range beside the median, none for ar against itself
    assert main([*common, "--methods", "cost", "--shift", "math,poems"]) == 2  # no ar to compare with
    assert main([*common, "--methods", "ar,cost", "--shift", "math,math"]) == 2
    assert main([*common, "--methods", "ar,cost", "--shift", "math,poems", "--shift-rounds", "3,1"]) == 2  # 6 math prompts needed


def test_shift_repeats_serve_each_domains_prompts_in_another_order():
    """A shift's first repeat serves the prompts in the order given, each later one in another (seeded) order of the
    same prompts: the same order made every repeat probe the same requests at the same steps."""
    from adaflash.pipelines.bench import shift_plan

    before, after = [f"b{i}" for i in range(8)], [f"a{i}" for i in range(12)]

    def served(rep: int) -> list[list[str]]:
        return [prompts[i * 4 : (i + 1) * 4] for prompts, i, _ in shift_plan(before, after, (2, 3), rep)]

    first = served(0)
    assert first == [before[:4], before[4:], after[:4], after[4:8], after[8:]]
    assert [since for *_, since in shift_plan(before, after, (2, 3), 1)] == [None, None, 1, 2, 3]
    later = [served(rep) for rep in (1, 2)]
    assert all(sorted(sum(x[:2], [])) == sorted(before) and sorted(sum(x[2:], [])) == sorted(after) for x in later)
    assert first != later[0] != later[1] and served(1) == later[0]  # another order each repeat, the same each time


def test_bench_prompts_per_domain_split(tmp_path):
    """`--domains name:split` reads that domain from its own split of the built prompt sets."""
    import argparse

    from adaflash.cli import _bench_prompts
    from adaflash.pipelines.prompts import PromptRecord, _write_parquet

    from adaflash.config import UsageError

    sets = tmp_path / "sets"
    sets.mkdir()
    for split, doms in (("train", ("code", "gsm8k")), ("eval", ("gsm8k",))):
        recs = [
            PromptRecord(f"{d}/{split}{i}", d, split, [{"role": "user", "content": f"{d} {split} {i}"}], None)
            for d in doms
            for i in range(3)
        ]
        _write_parquet(recs, sets / f"{split}.parquet")

    class Tok:
        def encode_chat(self, messages):
            return [len(messages[0]["content"])]

    args = argparse.Namespace(prompts_file=None, prompt_sets=str(sets), split="eval", n_prompts=2, domains="gsm8k,code:train")
    out = _bench_prompts(args, Tok())
    assert list(out) == ["gsm8k", "code"] and [len(v) for v in out.values()] == [2, 2]
    args.domains = "gsm8k:test"
    with pytest.raises(UsageError):
        _bench_prompts(args, Tok())
    args.domains = "code"  # code has no eval prompts
    with pytest.raises(UsageError):
        _bench_prompts(args, Tok())


def test_bench_interleave_runs_methods_in_lockstep(tiny_hf_dir, tiny_drafter_dir, tmp_path, monkeypatch):
    """`--interleave`: a cell's engine methods step in turn on their own engines; rows as usual (same
    greedy tokens, ratios to ar) without per-request latencies; -fullvocab is refused with it."""
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}: what is {i} + {i}?", "domain": "math"}) + "\n" for i in range(4)))
    common = ["bench", "--target", str(tiny_hf_dir), "--drafter", str(tiny_drafter_dir), "--prompts-file", str(prompts)]
    common += ["--max-new-tokens", "8", "--concurrency", "1,2", "--min-requests", "2", "--out", str(tmp_path / "b"), "--interleave"]
    assert main([*common, "--methods", "ar,fixed2,cost,cost-lookup"]) == 0
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    assert res["meta"]["interleave"] and len(res["rows"]) == 8
    for c in (1, 2):
        here = {r["method"]: r for r in res["rows"] if r["concurrency"] == c}
        assert len({r["committed_tokens"] for r in here.values()}) == 1 and here["ar"]["speedup_vs_ar"] == 1.0
        assert all(r["same_as_ar"] == 1.0 for r in here.values())
        assert all(r["latency_per_token_p50"] is None and r["tokens_per_s"] > 0 for r in here.values())
    assert "in lockstep" in (tmp_path / "b" / "report.md").read_text()
    assert main([*common, "--methods", "ar,fixed2-fullvocab"]) == 2


def test_bench_steady_cycles_prompts_and_times_the_full_batch(tiny_hf_dir, tiny_drafter_dir, tmp_path, monkeypatch):
    """`--steady`: 3 prompts served again in order up to --min-requests 7; tok/s is over the steps that
    ended with requests waiting (fewer seconds than the whole run), the whole run's kept beside it."""
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}: what is {i} + {i}?", "domain": "math"}) + "\n" for i in range(3)))
    common = ["bench", "--target", str(tiny_hf_dir), "--drafter", str(tiny_drafter_dir), "--prompts-file", str(prompts)]
    common += ["--max-new-tokens", "6", "--concurrency", "1,2", "--out", str(tmp_path / "b")]
    assert main([*common, "--methods", "ar,fixed2", "--min-requests", "7", "--steady"]) == 0
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    assert res["meta"]["steady"] and len(res["rows"]) == 4
    for r in res["rows"]:
        assert r["n_requests"] == 7 and r["same_as_ar"] == 1.0
        assert 0 < r["steady_s"] < r["wall_s"] and r["tokens_per_s"] == r["steady_tokens_per_s"] > 0
        assert r["whole_tokens_per_s"] == pytest.approx(r["committed_tokens"] / r["wall_s"])
    assert "steady tok/s" in (tmp_path / "b" / "report.md").read_text()
    assert main([*common, "--methods", "ar", "--waves", "3", "--steady"]) == 0  # 3 and 6 requests at concurrency 1 and 2
    assert [r["n_requests"] for r in json.loads((tmp_path / "b" / "results.json").read_text())["rows"]] == [3, 6]
    assert main([*common, "--methods", "ar,fixed2", "--min-requests", "2", "--steady"]) == 2  # not above concurrency 2
    assert main([*common, "--methods", "ar,hf", "--min-requests", "7", "--steady"]) == 2  # a peer's run is whole


def test_a_greedy_mismatch_is_kept_and_reported():
    """A method whose greedy output differs from plain decoding's gets where they part in results.json and
    a line in the report (a rare mismatch must be visible after the run, not only as a percentage)."""
    from adaflash.pipelines.bench import mismatches, report_markdown

    ref = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [1, 1]]
    got = mismatches([[1, 2, 3, 9, 5, 6], [7, 8, 9], [1, 1, 2]], ref)
    assert got == [
        {"request": 0, "at": 3, "method": [1, 2, 3, 9, 5, 6], "ar": [1, 2, 3, 4, 5, 6]},
        {"request": 2, "at": 2, "method": [1, 1, 2], "ar": [1, 1]},
    ]
    assert mismatches(ref, ref) == []
    row = {"domain": "gsm8k", "concurrency": 8, "method": "cost", "tokens_per_s": 1.0, "speedup_vs_ar": 1.0, "tau": 1.0,
           "verify_tokens_per_step": 1.0, "latency_per_token_p50": None, "latency_per_token_p95": None, "n_requests": 3,
           "same_as_ar": 1 / 3, "peak_rss_mib": 1, "mismatches": got}  # fmt: skip
    meta = {"command": "adaflash bench", "machine": "x", "max_new_tokens": 6, "token_budget": 512}
    assert "**Greedy output differs from plain decoding** in gsm8k c=8 cost (2)" in report_markdown([row], meta)
    assert "differs" not in report_markdown([row | {"mismatches": []}], meta)
