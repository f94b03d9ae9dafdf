"""GPU check of the SGLang backend (run by scripts/gpu_check_sglang.sh; writes $OUT/sglang_check.json).

Exports the committed drafter for SGLang, serves SmolLM2 with stock SGLang plain and with DFLASH,
checks greedy output equality on a few prompts, reports acceptance, exact-row share and speedup at
concurrency 1, then hot-swaps a perturbed drafter (same MASK, so the in-place path is tried first)
through SGLangEngine.swap and checks that the draft changed and the target did not.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path

import httpx
import torch
from adaflash.server.config import SGLangSection
from adaflash.server.sglang_backend import PROBE_TEXTS, SGLangEngine, SGLangServer, rounds_from_chunks
from adaflash.server.stock_backend import free_port

from adaflash.dflash_format import export_dflash
from adaflash.dflash_sglang import sglang_python, write_sglang_target
from adaflash.drafter import DEFAULT_DRAFTER, load_drafter
from adaflash.target import load_target, stock_hf_dir

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many clips did she sell altogether?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash table is to a new programmer.",
    "A train travels 60 km in 45 minutes. What is its average speed in km per hour?",
]
MAX_NEW = 128


def generate(url: str, ids: list[int]) -> tuple[list[int], dict, list[int], float]:
    """One streamed greedy /generate: (output ids, final meta_info, new tokens per chunk, seconds)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0, "no_stop_trim": True}, "stream": True}
    out, meta, chunks, t0 = [], {}, [], time.perf_counter()
    with httpx.stream("POST", url + "/generate", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                c = json.loads(line[6:])
                new = (c.get("output_ids") or [])[len(out) :]
                if new:
                    chunks.append(len(new))
                    out += new
                meta = c.get("meta_info") or meta
    return out, meta, chunks, time.perf_counter() - t0


def serve(python, target_dir, draft_dir, k, work, name, extra) -> SGLangServer:
    s = SGLangServer(python, target_dir, draft_dir, k, free_port(), 4096, 8, "bfloat16", 0.3, work / f"{name}.log", extra)
    s.start(600)
    return s


def run_all(server, prompts) -> dict:
    generate(server.url, prompts[0])  # warm-up
    res = [generate(server.url, p) for p in prompts]
    return {"outputs": [r[0] for r in res], "metas": [r[1] for r in res], "chunks": [r[2] for r in res], "seconds": sum(r[3] for r in res)}


def main() -> int:
    out = Path(os.environ.get("OUT", "runs/gpu-check-sglang"))
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"status": "error", "steps": {}}
    extra = os.environ.get("SGLANG_EXTRA", "--cuda-graph-max-bs 4").split()
    try:
        python = sglang_python(None)
        target = load_target(os.environ.get("TARGET", "smollm2"), "float32")
        base = stock_hf_dir(os.environ.get("TARGET", "smollm2"))
        drafter = load_drafter(DEFAULT_DRAFTER, target.model, target.identity, torch.float32)
        k = drafter.block_size
        mask_token = target.tokenizer.convert_ids_to_tokens(15)
        draft_dir = export_dflash(drafter, work / "dflash-v0", 15, None, mask_token)
        tgt = write_sglang_target(base, work / "target-v0", 15, drafter.mask_embedding.detach().float())
        report["steps"]["export"] = {"drafter": str(draft_dir), "target": str(tgt), "block_size": k}
        prompts = [target.encode_chat(p) for p in PROMPTS]

        plain = serve(python, base, None, k, work, "plain", extra)
        try:
            ref = run_all(plain, prompts)
        finally:
            plain.stop()
        spec_server = serve(python, tgt, draft_dir, k, work, "dflash", extra)
        spec = run_all(spec_server, prompts)
        equal = [a == b for a, b in zip(ref["outputs"], spec["outputs"])]
        verify = sum(m.get("spec_verify_ct") or 0 for m in spec["metas"])
        tokens = sum(len(o) for o in spec["outputs"])
        exact = [rounds_from_chunks(len(p), c, m, k) is not None for p, c, m in zip(prompts, spec["chunks"], spec["metas"])]
        report["steps"]["serve"] = {
            "greedy_equal": equal,
            "tau": round(tokens / verify, 3) if verify else None,
            "plain_s": round(ref["seconds"], 3),
            "dflash_s": round(spec["seconds"], 3),
            "speedup": round(ref["seconds"] / spec["seconds"], 3),
            "rows_exact": exact,
            "meta_example": spec["metas"][0],
        }

        # hot-swap through the product path: a perturbed drafter with the same MASK (in place first)
        new = copy.deepcopy(drafter)
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            for name, p in new.named_parameters():
                if name.startswith("layers.") and p.dim() == 2:
                    p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.5)
        cfg = SGLangSection(work_dir=str(work), swap=os.environ.get("SWAP", "auto"), startup_timeout_s=600)
        probes = [target.encode_chat(t) for t in PROBE_TEXTS]
        engine = SGLangEngine(spec_server, drafter, "0", k, (8, 512, 4096), cfg, base, mask_token, probes)
        before = spec_server.probe(probes, cfg.probe_tokens)
        t0 = time.perf_counter()
        try:
            engine.swap(new, None, "1")
            swap_error = None
        except Exception as e:
            swap_error = f"{type(e).__name__}: {e}"
        after = engine.server.probe(probes, cfg.probe_tokens)
        report["steps"]["swap"] = {
            "mode": engine.stats["swap_mode"],
            "error": swap_error,
            "seconds": round(time.perf_counter() - t0, 2),
            "target_unchanged": [b[0] == a[0] for b, a in zip(before, after)],
            "draft_changed": [b[1:] != a[1:] for b, a in zip(before, after)],
            "probe_before": [b[1:] for b in before],
            "probe_after": [a[1:] for a in after],
        }
        engine.server.stop()
        s = report["steps"]
        ok = all(s["serve"]["greedy_equal"]) and all(s["swap"]["target_unchanged"]) and any(s["swap"]["draft_changed"])
        report["status"] = "pass" if ok and swap_error is None else "fail"
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
    (out / "sglang_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, indent=2, default=str)[:6000])
    return 0 if report["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
