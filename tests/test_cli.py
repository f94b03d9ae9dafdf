"""`adaflash generate`: JSON output fields, lossless greedy across methods, clear input errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from adaflash.cli import CPU_TREE, LOOKUP, main


def run(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_both_methods_agree(tiny_hf_dir, tiny_drafter_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "What is 2+3?", "domain": "math"})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "Say hi."}]})
        + "\n"
    )
    common = [
        "generate",
        "--prompts-file",
        str(prompts),
        "--target",
        str(tiny_hf_dir),
        "--drafter",
        str(tiny_drafter_dir),
        "--max-new-tokens",
        "12",
        "--json",
    ]
    code, ar_out, _ = run(common + ["--method", "ar"], capsys)
    assert code == 0
    code, sd_out, _ = run(common + ["--method", "dflash"], capsys)
    assert code == 0
    ar_rows = [json.loads(x) for x in ar_out.splitlines()]
    sd_rows = [json.loads(x) for x in sd_out.splitlines()]
    assert len(ar_rows) == len(sd_rows) == 2
    for a, s in zip(ar_rows, sd_rows):
        assert a["output_ids"] == s["output_ids"]
        for key in ("output_ids", "text", "tau", "target_forwards", "wall_s"):
            assert key in s
    assert ar_rows[0]["domain"] == "math" and ar_rows[0]["target_forwards"] == len(ar_rows[0]["output_ids"])
    code, v2_out, _ = run(common + ["--method", "dflash", "--verify-len", "2"], capsys)  # anchor + 1 draft per round
    v2_rows = [json.loads(x) for x in v2_out.splitlines()]
    assert code == 0 and [r["output_ids"] for r in v2_rows] == [r["output_ids"] for r in ar_rows]
    assert all(a is None for r in v2_rows for a in r["accept_by_position"][1:])
    # CPU greedy default: a tree with a prompt-lookup branch
    assert all(r["tree"] == CPU_TREE and r["lookup"] == LOOKUP for r in sd_rows)
    assert all(r["tree"] is None and r["lookup"] == 0 for r in v2_rows)
    code, t3_out, _ = run(common + ["--method", "dflash", "--tree", "3", "--lookup", "2"], capsys)
    t3_rows = [json.loads(x) for x in t3_out.splitlines()]
    assert code == 0 and [r["output_ids"] for r in t3_rows] == [r["output_ids"] for r in ar_rows]
    assert all(r["tree"] == 3 and r["lookup"] == 2 for r in t3_rows)
    code, _, err = run(common + ["--method", "dflash", "--verify-len", "0"], capsys)
    assert code == 2 and "--verify-len must be >= 1" in err
    for extra, message in (
        (["--tree", "4", "--temperature", "0.5"], "greedily only"),
        (["--tree", "4", "--verify-len", "3"], "not both"),
        (["--tree", "-1"], "--tree must be >= 0"),
        (["--lookup", "4", "--verify-len", "3"], "into a token tree"),
        (["--lookup", "4", "--tree", "0"], "into a token tree"),
        (["--lookup", "-1"], "--lookup must be >= 0"),
    ):
        code, _, err = run(common + extra, capsys)
        assert code == 2 and message in err


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "hi"\n', "not valid JSON"),
        ('{"text": "hi"}\n', "exactly one of"),
        ('{"messages": []}\n', "non-empty list"),
        ('{"prompt": ""}\n', "non-empty string"),
        ("\n", "holds no prompts"),
    ],
)
def test_bad_prompts_file(tmp_path, tiny_hf_dir, capsys, content, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    code, _, err = run(["generate", "--prompts-file", str(f), "--target", str(tiny_hf_dir)], capsys)
    assert code == 2 and message in err


def test_missing_file_and_too_long_prompt(tmp_path, tiny_hf_dir, tiny_drafter_dir, capsys):
    code, _, err = run(["generate", "--prompts-file", str(tmp_path / "none.jsonl")], capsys)
    assert code == 2 and "does not exist" in err
    code, _, err = run(["generate", "--prompt", "word " * 9000, "--target", str(tiny_hf_dir), "--method", "ar"], capsys)
    assert code == 2 and "exceeds the target's context" in err
    code, _, err = run(["generate", "--prompt", "hi", "--max-new-tokens", "0"], capsys)
    assert code == 2 and "--max-new-tokens" in err
    code, _, err = run(["generate", "--prompt", "hi", "--target", str(tiny_hf_dir), "--drafter", str(tmp_path)], capsys)
    assert code == 1 and "not a drafter directory" in err


def test_help_runs():
    out = subprocess.run([sys.executable, "-m", "adaflash.cli", "generate", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--prompts-file" in out.stdout


def test_eval_any_drafter_dir(tiny_hf_dir, tiny_drafter_dir, tmp_path, capsys):
    """`adaflash eval --drafter DIR`: the single-request eval of a drafter directory in AdaFlash's format or
    DFlash's, report into --out (the drafter directory stays untouched); bad variant lists are refused."""
    dflash = tmp_path / "dflash"
    assert main(["export", str(tiny_drafter_dir), str(dflash), "--target", str(tiny_hf_dir), "--dtype", "float32"]) == 0
    common = ["eval", "--target", str(tiny_hf_dir), "--prompt-sets", str(tmp_path / "prompts"), "--domains", "gsm8k"]
    common += ["--per-domain", "2", "--max-new-tokens", "8", "--drafter-dtype", "float32"]
    for name, drafter in (("adaflash", tiny_drafter_dir), ("dflash", dflash)):
        out = tmp_path / f"eval-{name}"
        args = ["--drafter", str(drafter), "--verify-lens", "3", "--trees", "3", "--lookup", "0", "2", "--out", str(out)]
        code, stdout, _ = run(common + args, capsys)
        assert code == 0 and "| gsm8k | 2 | dflash-tree3-lookup2 | 2/2 |" in stdout
        report = json.loads((out / "eval.json").read_text())
        variants = report["domains"]["gsm8k"]["variants"]
        assert list(variants) == ["dflash-v3", "dflash-tree3", "dflash-tree3-lookup2"]
        assert all(v["identical_greedy"] == 2 and v["tau"] >= 1.0 for v in variants.values())
        assert (out / "eval.md").exists() and (out / "accept_by_position.png").exists()
        assert not (drafter / "eval.json").exists()
    code, _, err = run(common + ["--drafter", str(tiny_drafter_dir), "--verify-lens", "--out", str(tmp_path / "none")], capsys)
    assert code == 1 and "at least one of verify_lens (chains) or trees" in err
    help_text = subprocess.run([sys.executable, "-m", "adaflash.cli", "eval", "--help"], capture_output=True, text=True).stdout
    assert "--drafter" in help_text and "--trees" in help_text and "--lookup" in help_text
