"""`adaflash policy-eval`: how well the cost policy's acceptance model tells blocks apart, on held-out rounds.

Rounds are recorded live with every drafted position verified (`fit_head.record_full_blocks`: the
labels are uncensored and the drafter's block states are kept); the drafter's confidence per position
is recomputed from those states (`drafter.logits`), the length head's prediction too when the drafter
has one. Every other request is held out. The models are fitted online, in serving order, on the
other requests' rounds exactly as `CostPolicy.observe` fits them (labels up to the first rejection,
the same running acceptance), then frozen and scored on the held-out rounds:

- AUC of P(position 1 accepted);
- R^2 of the predicted accepted length E[A] = sum_j prod_{m<=j} p_m against the accepted length A;
- reliability: predicted P(position j accepted | the ones before were) in ten bins against how often
  it was (`reliability.png`).

Compared on the same rounds: `prior` (position and running acceptance: what the policy decides
drafting with), `confidence` (+ the drafter's per-position confidence: what it verifies with), and
the length head alone (AUC of its prediction, R^2 of (pred * K - 1) against A).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from adaflash.acceptance import AcceptanceModel, Running, block_features, confidence, prior_features, round_labels

MODELS = {  # name -> initial theta, as CostPolicy starts them
    "prior": [0.0, 0.0, 1.0],
    "confidence": [0.0, 0.0, 0.0, 1.0],
}


@dataclass
class Block:
    """One verified full block."""

    request: int  # index of its request (serving order of submission)
    domain: str
    t_ns: int
    conf: np.ndarray  # [J] drafter top-1 probability per drafted position
    head: float  # length-head prediction (nan without a head)
    accepted: int  # of J drafts


@torch.no_grad()
def blocks_from_states(states, domains: list[str], drafter, head=None) -> list[Block]:
    """Finished requests (rounds with kept block states, every draft verified) -> blocks in serving order."""
    out = []
    for i, (s, dom) in enumerate(zip(states, domains)):
        for r in s.rounds:
            if r.hidden is None or r.source != "drafter" or len(r.draft) != r.hidden.shape[0] - 1:
                continue
            h = r.hidden[None]  # [1, K, H]
            pred = float(head(h.float())) if head is not None else float("nan")
            out.append(Block(i, dom, r.t_ns, confidence(drafter.logits(h[:, 1:]))[0], pred, r.accepted))
    return sorted(out, key=lambda b: (b.t_ns, b.request))


def features(name: str, conf: np.ndarray, run: np.ndarray) -> np.ndarray:
    """[R, J] confidences, [R] running acceptance -> [R, J, d] features of model `name`."""
    return prior_features(run, conf.shape[1]) if name == "prior" else block_features(conf, run)


def replay(blocks: list[Block], heldout: set[int]) -> dict[str, dict]:
    """Fit both models online on the fitting requests' blocks, in serving order and as CostPolicy.observe
    does; -> per model the held-out blocks' per-position predictions [N, J] (frozen model) with their
    accepted lengths and domains."""
    fitted = {name: AcceptanceModel(theta0) for name, theta0 in MODELS.items()}
    running = Running()
    for b in blocks:
        if b.request in heldout:
            continue
        conf, key = b.conf[None], str(b.request)
        run = running.rate([key])
        y, seen = round_labels([b.accepted], [len(b.conf)], len(b.conf))  # [1, J]
        x = features("confidence", conf, run)  # [1, J, 4]
        guess = fitted["confidence"].predict(x)  # [1, J]: what the prior model learns where no label is seen
        fitted["confidence"].update(x[seen], y[seen])
        fitted["prior"].update(features("prior", conf, run)[0], np.where(seen, y, guess)[0])
        running.update([key], [float(y[seen].sum())], [float(seen.sum())])
    out = {name: {"p": [], "accepted": [], "domain": []} for name in MODELS}
    for b in blocks:  # held-out: the running acceptance still follows each request's own rounds
        if b.request not in heldout:
            continue
        key = str(b.request)
        run = running.rate([key])
        for name in MODELS:
            out[name]["p"].append(fitted[name].predict(features(name, b.conf[None], run))[0])
            out[name]["accepted"].append(b.accepted)
            out[name]["domain"].append(b.domain)
        y, seen = round_labels([b.accepted], [len(b.conf)], len(b.conf))
        running.update([key], [float(y[seen].sum())], [float(seen.sum())])
    for name in MODELS:
        out[name]["theta"] = fitted[name].theta.tolist()
    return out


# ----------------------------------------------------------------------------- metrics
def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half); nan with one class only."""
    pos, neg = score[label.bool()], score[~label.bool()]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    diff = pos[:, None] - neg[None, :]  # [P, N]
    return float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())


def r2(pred: torch.Tensor, y: torch.Tensor) -> float:
    y, pred = y.double(), pred.double()
    sst = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float(((y - pred) ** 2).sum()) / sst if sst > 0 else float("nan")


def reliability(p: torch.Tensor, accepted: torch.Tensor, bins: int = 10) -> list[dict]:
    """Conditional predictions p [N, J] (position j given the earlier ones accepted) against their
    labels over the observed positions, in `bins` equal-width bins of the prediction."""
    y, seen = round_labels(accepted.numpy(), np.full(len(accepted), p.shape[1]), p.shape[1])
    pp, yy = p[torch.from_numpy(seen)], torch.from_numpy(y[seen])
    idx = (pp * bins).long().clamp(max=bins - 1)
    return [
        {"bin": b, "n": int((idx == b).sum()), "pred": float(pp[idx == b].mean()), "observed": float(yy[idx == b].mean())}
        for b in range(bins)
        if bool((idx == b).any())
    ]


def scores(p: torch.Tensor, accepted: torch.Tensor) -> dict:
    """p [N, J] conditional predictions, accepted [N] -> AUC (position 1), R^2 (accepted length), ECE, reliability."""
    expected = p.cumprod(-1).sum(-1)  # [N] predicted accepted length
    rel = reliability(p, accepted)
    n = sum(b["n"] for b in rel)
    return {
        "blocks": len(accepted),
        "auc_pos1": auc(p[:, 0], (accepted >= 1).double()),
        "r2_accepted": r2(expected, accepted),
        "ece": sum(b["n"] * abs(b["pred"] - b["observed"]) for b in rel) / max(1, n),
        "reliability": rel,
    }


def evaluate(blocks: list[Block], k_blk: int) -> dict:
    """Held-out scores per model, overall and per domain, plus the length head's own R^2."""
    n_req = 1 + max(b.request for b in blocks)
    heldout = set(range(1, n_req, 2))
    preds = replay(blocks, heldout)
    report = {"fit_blocks": sum(b.request not in heldout for b in blocks), "models": {}}
    for name, r in preds.items():
        p, acc, dom = torch.from_numpy(np.stack(r["p"])), torch.tensor(r["accepted"]), r["domain"]
        entry = {"theta": r["theta"], "all": scores(p, acc), "domains": {}}
        for d in sorted(set(dom)):
            m = torch.tensor([x == d for x in dom])
            entry["domains"][d] = {k: v for k, v in scores(p[m], acc[m]).items() if k != "reliability"}
        report["models"][name] = entry
    held = [b for b in blocks if b.request in heldout]
    head = torch.tensor([b.head for b in held])
    if bool(torch.isfinite(head).all()):
        acc = torch.tensor([b.accepted for b in held])
        report["length_head"] = {"r2_accepted": r2(head * k_blk - 1, acc), "auc_pos1": auc(head, (acc >= 1).double())}
    return report


def plot_reliability(report: dict, path: Path) -> Path:
    from adaflash.pipelines.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 5))
    for name, m in report["models"].items():
        rel = m["all"]["reliability"]
        ax.plot([b["pred"] for b in rel], [b["observed"] for b in rel], marker="o", label=f"{name} (ECE {m['all']['ece']:.3f})")
    ax.plot([0, 1], [0, 1], color="gray", lw=1)
    ax.set_xlabel("predicted P(position accepted | earlier accepted)")
    ax.set_ylabel("observed frequency (held-out rounds)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report_markdown(report: dict, meta: dict) -> str:
    lines = [
        f"Command: `{meta['command']}`",
        "",
        f"{report['fit_blocks']} blocks fitted on, held-out blocks below (every other request).",
        "",
        "| model | domain | blocks | AUC position 1 | R^2 accepted length | ECE |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in report["models"].items():
        for dom, s in [("all", m["all"])] + sorted(m["domains"].items()):
            lines.append(f"| {name} | {dom} | {s['blocks']} | {s['auc_pos1']:.3f} | {s['r2_accepted']:.3f} | {s['ece']:.3f} |")
    if "length_head" in report:
        h = report["length_head"]
        lines += ["", f"Length head alone on the same blocks: AUC position 1 {h['auc_pos1']:.3f}, R^2 {h['r2_accepted']:.3f}."]
    return "\n".join(lines) + "\n"


def policy_eval(target, drafter, head, prompts: dict[str, list[list[int]]], max_new: int, concurrency: int, eos: list[int]) -> dict:
    """Record full blocks on the prompts (all domains in one run) and score the acceptance models."""
    from adaflash.pipelines.fit_head import record_full_blocks

    ids = [p for ps in prompts.values() for p in ps]
    domains = [d for d, ps in prompts.items() for _ in ps]
    states = record_full_blocks(target, drafter, ids, max_new, concurrency, eos)
    return evaluate(blocks_from_states(states, domains, drafter, head), drafter.block_size)


def write_policy_eval(report: dict, meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, **report}, indent=2) + "\n")
    (out / "report.md").write_text(report_markdown(report, meta))
    plot_reliability(report, out / "reliability.png")
