"""PNG plots for reports: acceptance by block position, and the training curve."""

from __future__ import annotations

import json
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_acceptance(report: dict, path: Path) -> Path:
    """One line per domain: P(block position j accepted | verified), j = 1..K-1, of the first variant.
    Reports that carry `accepted_at_least` (share of rounds accepting >= j drafts, comparable between
    chains and trees) plot that instead, with the fastest other variant (speedup on the first domain)
    dashed beside the first."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    variants = next(iter(report["domains"].values()))["variants"]  # the same variants in every domain
    names = list(variants)
    at_least = "accepted_at_least" in variants[names[0]]
    others = sorted(names[1:], key=lambda n: -variants[n].get("speedup", 0.0))
    shown = [names[0]] + (others[:1] if at_least else [])
    for ci, (domain, r) in enumerate(report["domains"].items()):
        for name, style in zip(shown, ("-", "--")):
            v = r["variants"][name]
            ys = [y for y in v["accepted_at_least" if at_least else "accept_by_position"] if y is not None]
            ax.plot(
                range(1, len(ys) + 1),
                ys,
                style,
                marker="o",
                color=f"C{ci}",
                label=f"{domain} {name.removeprefix('dflash-')} (tau {v['tau']:.2f})",
            )
    ax.set_xlabel("block position (1 = first drafted token)")
    ax.set_ylabel("share of rounds accepting >= j drafts" if at_least else "acceptance rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("DFlash drafter: acceptance by block position (greedy)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_training(log_path: Path, path: Path) -> Path:
    """Loss per step (smoothed) and, where logged, the greedy accepted length of training blocks."""
    plt = _pyplot()
    rows = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    loss = [r["loss"] for r in rows]
    window = max(1, len(loss) // 50)
    smooth = [sum(loss[max(0, i - window + 1) : i + 1]) / len(loss[max(0, i - window + 1) : i + 1]) for i in range(len(loss))]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot(steps, smooth, label="loss (position-weighted CE)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    acc = [(r["step"], r["acc_len"]) for r in rows if "acc_len" in r]
    if acc:
        ax2 = ax.twinx()
        ax2.plot(*zip(*acc), color="tab:orange", alpha=0.7, label="accepted drafts per block (train)")
        ax2.set_ylabel("accepted drafts per block")
        ax2.legend(loc="center right")
    ax.legend(loc="upper right")
    ax.set_title("Drafter pretraining")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
