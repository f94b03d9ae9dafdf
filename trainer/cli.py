"""`adaflash train`: the online trainer (registered into the one `adaflash` CLI)."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Online trainer. Tails the trajectory buffer that serving writes (buffer.dir); whenever at least
buffer.min_new_rounds verification rounds are buffered it runs one update round:
  - splits the trajectories train / held-out by request_id hash (held-out ones are never trained on)
  - recomputes the teacher with its own frozen target (one forward per trajectory)
  - trains drafter + length head with DeepSpeed at the blocks that were actually drafted
    (loss.kind opd: top-1 CE + clipped reverse KL; osd: forward-KL baseline)
  - measures held-out tau (1 + mean accepted length, teacher-forced) before and after
  - checkpoints, then commits the shards to the buffer ledger (exactly once across kills)
  - registers the drafter in the MLflow registry (mlflow.model_name) and moves the champion
    alias when tau after >= tau before - gate.tolerance; otherwise tags it gate=rejected
Each round is one MLflow run (params, per-step losses, data window, held-out tau per domain).
Start from the registry's champion (or drafter.init_dir); rerun the same command after a crash.
Prints one line per round: rows, loss, tau before -> after, promoted or rejected.

Example: adaflash train --config configs/online_smollm2.yaml
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="online trainer: buffer -> OPD/OSD update rounds -> MLflow registry",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="YAML, e.g. configs/online_smollm2.yaml")
    p.add_argument("--max-rounds", type=int, default=None, help="update rounds before exiting (overrides max_rounds; 0 = forever)")
    p.add_argument("--tracking-uri", default=None, help="MLflow server URL (overrides mlflow.tracking_uri)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from adaflash.trainer.config import OnlineConfig
    from adaflash.trainer.online import OnlineTrainer

    from adaflash.config import UsageError, load_config

    cfg = load_config(args.config, OnlineConfig)
    if args.max_rounds is not None:
        if args.max_rounds < 0:
            raise UsageError("--max-rounds must be >= 0 (0 = forever)")
        cfg.max_rounds = args.max_rounds
    if args.tracking_uri:
        cfg.mlflow.tracking_uri = args.tracking_uri
    trainer = OnlineTrainer(cfg, log=lambda line: print(line, flush=True))
    try:
        done = trainer.run()
    except KeyboardInterrupt:
        print("[train] stopped; a round still in training (if any) is not registered: the next start trains its shards", flush=True)
        return 130
    print(f"[train] {done} update round(s) done; state in {cfg.checkpoint.dir}/state.json", flush=True)
    return 0
