"""The vLLM backend's cost schedule following the traffic, against the start-up schedule kept (issue 22 item 3).

    python -m adaflash.experiments.vllm_follow --out runs/vllm-follow --concurrency 16 --requests 96 \
        --phases mtbench,humaneval,humaneval,mtbench --follow 16,0

For each `--follow` value F, one real `adaflash serve` from `--config` (the vLLM backend, policy auto = cost on a
CPU) with `vllm.follow_every: F` (0: the start-up schedule stays) and `engine.max_batch` at least the
concurrency, and `adaflash loadgen` sending each phase's prompt domain in turn (closed loop, `--requests` each):
per phase its tok/s, mean tau, the schedule in force as it ended and `adaflash_schedule_updates` from /metrics.
The servers run one after the other on the same machine; F = 0 is the baseline. Writes results.json and report.md
into OUT. Needs vLLM's venv (`make vllm`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml


def _get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def serve_and_load(args, follow: int) -> list[dict]:
    """One server with vllm.follow_every = `follow`, the phases sent to it in turn -> a row per phase."""
    work = Path(args.out) / f"follow{follow}"
    work.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load(Path(args.config).read_text())
    cfg.update(port=args.port, backend="vllm")
    cfg["vllm"].update(follow_every=follow, work_dir=str(work / "vllm"))
    cfg["engine"]["max_batch"] = max(cfg["engine"]["max_batch"], args.concurrency)
    cfg["trajectories"]["buffer_dir"] = str(work / "buffer")
    cfg["registry"]["tracking_uri"] = None  # no hot-swaps here: the schedule moves with the traffic alone
    (work / "serve.yaml").write_text(yaml.safe_dump(cfg))
    exe, url, log = [sys.executable, "-m", "adaflash.cli"], f"http://127.0.0.1:{args.port}", work / "serve.log"
    with open(log, "w") as out:
        cmd = [*exe, "serve", "--config", str(work / "serve.yaml")]
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    rows = []
    try:
        t0 = time.monotonic()
        while True:
            try:
                _get(url + "/ready")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() - t0 > 900:
                    raise RuntimeError(f"the server did not get ready; see {log}") from None
                time.sleep(2)
        for i, domain in enumerate(args.phases.split(",")):
            cmd = [*exe, "loadgen", "--url", url, "--domains", domain, "--requests", str(args.requests), "--rate", "0"]
            cmd += ["--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens), "--prompt-sets", args.prompt_sets]
            cmd += ["--seed", str(i), "--json"]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            summary = json.loads(out[out.index("{") :])
            updates = re.search(r"^adaflash_schedule_updates_total (\S+)", _get(url + "/metrics"), re.M)
            text = log.read_text()
            changes = re.findall(r"by batch size now (\[.*?\]) \(", text)
            start = re.search(r"drafts\): (\[.*?\])", text)
            rows.append(
                {
                    "follow_every": follow,
                    "phase": i + 1,
                    "domain": domain,
                    "tokens_per_s": summary["tokens_per_s"],
                    "mean_tau": summary.get("mean_tau"),
                    "ok": summary["ok"],
                    "schedule": changes[-1] if changes else start.group(1) if start else "?",
                    "schedule_updates": float(updates.group(1)) if updates else 0.0,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(120)
    return rows


def report(rows: list[dict], args) -> str:
    base = {r["phase"]: r["tokens_per_s"] for r in rows if r["follow_every"] == 0}
    lines = [
        f"# vLLM schedule following the traffic: concurrency {args.concurrency}, {args.requests} requests a phase, "
        f"{args.max_tokens} tokens max\n",
        "| follow_every | phase | domain | tok/s | vs follow_every 0 | mean tau | updates so far | schedule at the phase's end |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['tokens_per_s'] / base[r['phase']]:.2f}x" if r["phase"] in base else "-"
        tau = "-" if r["mean_tau"] is None else f"{r['mean_tau']:.2f}"  # None: no request verified a draft
        lines.append(
            f"| {r['follow_every']} | {r['phase']} | {r['domain']} | {r['tokens_per_s']:.1f} | {ratio} | {tau} | "
            f"{r['schedule_updates']:.0f} | {r['schedule']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m adaflash.experiments.vllm_follow", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/vllm-follow")
    p.add_argument("--config", default="configs/serve_vllm.yaml", help="the serve config each server starts from")
    p.add_argument("--follow", default="16,0", help="vllm.follow_every values, one server each (0 = the start-up schedule)")
    p.add_argument("--phases", default="mtbench,humaneval,humaneval,mtbench", help="prompt domains sent in turn")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=96, help="requests per phase")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-sets", default="runs/prompt-sets")
    p.add_argument("--port", type=int, default=8125)
    args = p.parse_args(argv)
    rows = [r for f in args.follow.split(",") for r in serve_and_load(args, int(f))]
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    (out / "report.md").write_text(report(rows, args))
    print(report(rows, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
