"""`adaflash experiment domain-shift | replay | swap | soak`: the online-learning measurements (registered into the `adaflash` CLI)."""

from __future__ import annotations

import argparse
import json

DOMAIN_SHIFT = """\
A drafter pretrained without code serves code traffic; per arm (opd, osd, head, none), from the same
drafter, for each online round: serve the round's prompts through the engine, write them to the arm's
trajectory buffer, let the arm's online trainer (OPD or OSD; head: the drafter frozen, only the length
head learns; none: no update) run one update round and publish to the MLflow registry, then serve the
held-out HumanEval prompts with the arm's champion to measure tau (tokens per target forward) and the
length head's error, beside the starting head's error on the same blocks. Writes results.json,
report.md and PNGs into --out and prints whether the gate is met (OPD tau >= min_gain x start,
OPD >= OSD). Rerun the same command to resume after a crash: finished (arm, round) rows are kept.

Example: adaflash experiment domain-shift --config configs/experiment_domain_shift.yaml --out runs/domain-shift
"""

REPLAY = """\
Compares distillation losses (OPD, OSD, variants) offline on traffic a run already recorded, over
several seeds: the buffer's trajectories in time order are cut into rounds; for each loss and seed, from
the same starting drafter, each round trains on its trajectories (plus replayed earlier rounds) through
the online trainer's data path and loss, then measures teacher-forced tau on the target's greedy answers
to held-out eval prompts (more prompts than the online run serves, no serving cost). Tells apart losses
that one online run per arm cannot. Reads the buffer without consuming or moving anything. Writes
runs.jsonl (resumable: finished (loss, seed) pairs are kept), results.json, report.md and
tau_per_round.png into --out.

Example: adaflash experiment replay --config configs/experiment_replay.yaml --out runs/replay
"""

SWAP = """\
Serves streaming chat completions from a real in-process `adaflash serve` app, registers a second
drafter version and moves `champion` to it while clients stream; measures failed requests (must be 0),
inter-token latency p50/p95 before vs during the swap (p95 ratio must be <= max_ratio) and the swap
duration. Writes swap.json and swap.md into --out.

Example: adaflash experiment swap --config configs/experiment_swap.yaml --out runs/swap-bench
"""

SOAK = """\
Runs the whole loop (`adaflash up` on private ports) under N streaming clients for an hour, SIGKILLs
the server in the middle (`up` restarts it), and reports: requests and failures (those in flight at the
kill apart), trajectory rows vs completed requests (by request id), the server's RSS over time, p50/p99
latency per 5 minutes, and the bytes of the buffer and the trainer folder on disk. Writes report.md,
summary.json, samples.jsonl and soak.png into --out. Not part of CI (an hour of the machine).

Example: adaflash experiment soak --config configs/experiment_soak.yaml --out runs/soak
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("experiment", help="online-learning measurements: domain-shift recovery, hot-swap cost")
    sub = p.add_subparsers(dest="experiment", required=True)
    d = sub.add_parser(
        "domain-shift",
        help="OPD vs OSD vs no update after a domain shift, per online round",
        description=DOMAIN_SHIFT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r = sub.add_parser(
        "replay",
        help="losses side by side on recorded traffic, over seeds (offline)",
        description=REPLAY,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s = sub.add_parser(
        "swap",
        help="failed requests and inter-token latency around a registry hot-swap",
        description=SWAP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for q, func, example in (
        (d, run_domain_shift, "configs/experiment_domain_shift.yaml"),
        (r, run_replay, "configs/experiment_replay.yaml"),
        (s, run_swap, "configs/experiment_swap.yaml"),
    ):
        q.add_argument("--config", required=True, help=f"YAML, e.g. {example}")
        q.add_argument("--out", required=True, help="output folder (results, report, plots)")
        if q is not r:  # the replay touches no registry
            q.add_argument(
                "--tracking-uri",
                default=None,
                help="MLflow server URL (overrides tracking_uri; default: a private server under OUT/mlflow)",
            )
        q.set_defaults(func=func)
    k = sub.add_parser(
        "soak",
        help="an hour of streaming load on the whole loop, with a server kill -9: failures, rows, memory, disk",
        description=SOAK,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    k.add_argument("--config", default="configs/experiment_soak.yaml", help="YAML (default: configs/experiment_soak.yaml)")
    k.add_argument("--out", required=True, help="output folder (a new one: the loop starts empty)")
    k.add_argument("--duration-s", type=float, default=None, help="override duration_s (seconds the clients send)")
    k.add_argument("--kill-at-s", type=float, default=None, help="override kill_at_s (0 = no kill)")
    k.set_defaults(func=run_soak)
    d.add_argument("--arms", default=None, help="comma list of arms to run, overriding the config's (e.g. head,opd)")


def run_domain_shift(args: argparse.Namespace) -> int:
    from adaflash.experiments.online_experiment import Experiment, ExperimentConfig

    from adaflash.config import load_config

    cfg = load_config(args.config, ExperimentConfig)
    cfg.tracking_uri = args.tracking_uri or cfg.tracking_uri
    if args.arms:
        cfg.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
        cfg.__post_init__()  # the same check as in the YAML
    Experiment(cfg, args.out).run()
    print(f"report: {args.out}/report.md")
    return 0


def run_replay(args: argparse.Namespace) -> int:
    from adaflash.experiments.loss_replay import Replay, ReplayConfig

    from adaflash.config import load_config

    cfg = load_config(args.config, ReplayConfig)
    Replay(cfg, args.out).run()
    print(f"report: {args.out}/report.md")
    return 0


def run_swap(args: argparse.Namespace) -> int:
    from adaflash.experiments.swap_bench import SwapConfig, run_swap_bench

    from adaflash.config import load_config

    cfg = load_config(args.config, SwapConfig)
    cfg.tracking_uri = args.tracking_uri or cfg.tracking_uri
    run_swap_bench(cfg, args.out)
    print(f"report: {args.out}/swap.md")
    return 0


def run_soak(args: argparse.Namespace) -> int:
    from adaflash.experiments.soak import Soak, SoakConfig

    from adaflash.config import load_config

    cfg = load_config(args.config, SoakConfig)
    if args.duration_s is not None:
        cfg.duration_s = args.duration_s
    if args.kill_at_s is not None:
        cfg.kill_at_s = args.kill_at_s
    cfg.__post_init__()
    summary = Soak(cfg, args.out).run()
    print(json.dumps({k: v for k, v in summary.items() if k != "latency_windows"}, indent=1))
    print(f"report: {args.out}/report.md")
    return 0
