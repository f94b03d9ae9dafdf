"""Is the serving path the single-request path? Per prompt, `adaflash generate` (its own wall_s) and then the
same prompt through a running `adaflash serve` at concurrency 1 (timed by the client, HTTP included),
alternating so that drifts in machine load hit both alike. Prints one JSON line per pair and the ratio.

    adaflash serve --config SERVE.yaml &      # engine.tree / lookup / lookup_min_ngram as generate's flags
    python -m adaflash.experiments.server_vs_generate --url http://127.0.0.1:8000 --prompts-file P.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--prompts-file", required=True, help="JSONL in `adaflash generate` format")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", type=int, default=8)
    p.add_argument("--lookup", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model", default="smollm2")
    args = p.parse_args(argv)
    prompts = [json.loads(line) for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        one = Path(tmp) / "one.jsonl"
        for rep in range(args.repeats):
            for i, prompt in enumerate(prompts):
                one.write_text(json.dumps(prompt) + "\n")
                cmd = [sys.executable, "-m", "adaflash.cli", "generate", "--method", "dflash", "--prompts-file", str(one)]
                cmd += ["--max-new-tokens", str(args.max_new_tokens), "--tree", str(args.tree), "--lookup", str(args.lookup), "--json"]
                gen = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
                messages = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
                body = {"model": args.model, "messages": messages, "max_tokens": args.max_new_tokens, "temperature": 0}
                headers = {"Content-Type": "application/json"}
                req = urllib.request.Request(f"{args.url}/v1/chat/completions", json.dumps(body).encode(), headers)
                t0 = time.perf_counter()
                srv = json.load(urllib.request.urlopen(req, timeout=600))
                srv_s = time.perf_counter() - t0
                row = dict(rep=rep, i=i, gen_tok=len(gen["output_ids"]), gen_s=gen["wall_s"], gen_tau=gen["tau"])
                row.update(srv_tok=srv["usage"]["completion_tokens"], srv_s=round(srv_s, 3), srv_tau=srv.get("adaflash", {}).get("tau"))
                rows.append(row)
                print(json.dumps(row), flush=True)
    ratios = [(r["srv_tok"] / r["srv_s"]) / (r["gen_tok"] / r["gen_s"]) for r in rows]
    g = sum(r["gen_tok"] for r in rows) / sum(r["gen_s"] for r in rows)
    s = sum(r["srv_tok"] for r in rows) / sum(r["srv_s"] for r in rows)
    same = all(r["gen_tau"] == r["srv_tau"] and r["gen_tok"] == r["srv_tok"] for r in rows)
    print(f"generate {g:.2f} tok/s | server {s:.2f} tok/s | server/generate {s / g:.3f} (median pair {statistics.median(ratios):.3f})")
    print(f"same tokens and tau per prompt: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
