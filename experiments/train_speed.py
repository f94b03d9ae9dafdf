"""Training on a CPU, full vocabulary vs draft vocabulary: steps/s, sequences/hour and held-out tau (issue 23).

    python -m adaflash.experiments.train_speed --out runs/train-speed

Two recipes, each in two arms trained from the same drafter on the same batches:
  online    the online trainer's step (configs/online_smollm2.yaml: OPD + length head, bf16 autocast,
            4 trajectories x 16 anchors): "full" = loss.vocab full with fp32 teacher features,
            "draft" = loss.vocab draft with the features stored in bf16 (trainer/data.py `supervise`)
  pretrain  pretraining's step (configs/pretrain_smollm2.yaml: ce, bf16 autocast, bf16 target head,
            4 sequences x 24 anchors): "full" vs "draft" (labels outside the draft vocabulary masked)
Data: the target's own greedy answers to GSM8K and HumanEval eval prompts (generated once, cached in OUT),
every other answer position an anchor; a hash-split quarter is held out. First `--profile-steps` steps per
arm are timed phase by phase (median; batch, teacher logits, drafter trunk, LM head, loss, backward; the
gradients are dropped, no optimizer step); then the arms train
`--steps` steps, ALTERNATING step by step (so both see the same machine load), timing every step;
held-out tau (teacher-forced, drafts as served: argmax inside the draft vocabulary) before and after.
Writes results.json and report.md into OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from adaflash.config import from_dict, load_config
from adaflash.recipe import LossSection, clip_per_group, deepspeed_config, loss_step, teacher_logits, train_step, train_vocab, vocab_head

REPO = Path(__file__).resolve().parent.parent
ARMS = ("full", "draft")


def answers(target, out: Path, per_domain: int, max_new_tokens: int) -> list[dict]:
    """The target's greedy answers to `per_domain` eval prompts of gsm8k and humaneval, cached as JSON."""
    from adaflash.pipelines.prompts import load_domain

    from adaflash.engine import Engine
    from adaflash.policies import ARPolicy
    from adaflash.request import Request

    path = out / "answers.json"
    key = {"target": target.identity, "per_domain": per_domain, "max_new_tokens": max_new_tokens}
    if path.exists() and json.loads(path.read_text())["key"] == key:
        return json.loads(path.read_text())["answers"]
    engine = Engine(target.model, None, ARPolicy(), target.eos_ids, max_batch=8)
    for domain in ("gsm8k", "humaneval"):
        recs = [r for r in load_domain(domain) if r.split == "eval"][:per_domain]
        for r in recs:
            engine.submit(Request(r.prompt_id, target.encode_chat(r.messages), max_new_tokens, domain=domain))
    done = []
    while not engine.idle:
        done += engine.step()
    rows = [{"id": s.req.request_id, "domain": s.req.domain, "prompt_ids": list(s.req.prompt_ids), "output_ids": list(s.out)} for s in done]
    path.write_text(json.dumps({"key": key, "answers": rows}))
    return rows


def sequences(rows: list[dict], k_blk: int) -> tuple[list, list]:
    """Answers -> (train, held-out) trainer Sequences, every other answer position with a full block an anchor."""
    from adaflash.trainer.data import Sequence, is_heldout

    seqs = []
    for a in rows:
        tokens = torch.tensor(a["prompt_ids"] + a["output_ids"], dtype=torch.long)  # [L]
        anchors = torch.arange(len(a["prompt_ids"]), len(tokens) - k_blk + 1, 2)
        if len(anchors):
            seqs.append(Sequence(a["id"], a["domain"], tokens, anchors))
    return [s for s in seqs if not is_heldout(s.request_id, 0.25)], [s for s in seqs if is_heldout(s.request_id, 0.25)]


class Arm:
    """One (recipe, vocab) arm: its DeepSpeed engine, data and step."""

    def __init__(
        self,
        recipe: str,
        vocab: str,
        target,
        drafter_dir: str,
        lr: float,
        data: tuple[list, list],
        layers: int | None = None,
        autocast: bool | None = None,
    ):
        """layers: deepen the loaded drafter to this many layers (`drafter.deepen`); autocast: the pretraining
        recipe's bf16 autocast (None: its default)."""
        import deepspeed
        from adaflash.trainer.config import OnlineConfig
        from adaflash.trainer.online import OnlineModel, ds_config

        from adaflash.drafter import deepen, load_drafter_and_head
        from adaflash.length_head import LengthHead, LengthHeadConfig

        self.recipe, self.vocab_mode, self.target = recipe, vocab, target
        self.train, self.held = data
        drafter, head = load_drafter_and_head(drafter_dir, target, torch.float32)
        if layers is not None:
            drafter = deepen(drafter, target.model, layers)
        drafter.attach(target.model)  # share the target's head as the recipe does (bf16 target for pretraining)
        drafter.requires_grad_(True)
        if recipe == "online":
            cfg = load_config(REPO / "configs" / "online_smollm2.yaml", OnlineConfig)
            cfg.train.lr, cfg.loss.vocab = lr, vocab
            self.t, self.loss = cfg.train, cfg.loss
            head = head or LengthHead(LengthHeadConfig(hidden_size=drafter.config.hidden_size, block_size=drafter.block_size))
            model = OnlineModel(drafter, head.requires_grad_(True), vocab)
            groups = [{"params": list(drafter.parameters()), "lr": lr}, {"params": list(head.parameters()), "lr": self.t.head_lr}]
            self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config(cfg))
        else:
            from adaflash.pipelines.pretrain import TrainSection

            over = {} if autocast is None else {"autocast_bf16": autocast}
            self.t = from_dict(TrainSection, {"lr": lr, "vocab": vocab, **over})  # pretraining's defaults: 4 x 24, bf16 autocast
            self.loss = LossSection(kind="ce", gamma=self.t.gamma, vocab=vocab)
            self.engine, _, _, _ = deepspeed.initialize(
                model=drafter, model_parameters=drafter.parameters(), config=deepspeed_config(self.t)
            )
        self.drafter = drafter

    @property
    def vocab(self):
        return train_vocab(self.drafter, self.vocab_mode)

    def batch(self, i: int) -> dict:
        from adaflash.trainer.data import make_batch, train_items

        return make_batch(train_items(self.train, i, 0, 1, self.t.seqs_per_step, self.t.anchors_per_seq, 0, 1), self.drafter.block_size)

    def step(self, i: int) -> float:
        """One optimizer step of the recipe on batch i -> seconds (batch assembly included)."""
        t0 = time.perf_counter()
        batch = self.batch(i)
        if self.recipe == "online":
            clip = lambda e: {"grad_norm": clip_per_group(e, self.t.grad_clip)[0]}  # noqa: E731
            kw = dict(forward=self.engine, teacher=self.target.model, clip=clip, vocab=self.vocab)
            train_step(self.engine, batch, self.loss, autocast=self.t.autocast_bf16, **kw)
        else:
            train_step(self.engine, batch, self.loss, autocast=self.t.autocast_bf16, metrics=i % self.t.log_every == 0)
        return time.perf_counter() - t0

    def phases(self, i: int) -> dict:
        """One step's parts timed apart (the gradients are dropped: no optimizer step) -> {phase: seconds}."""
        times, t0 = {}, time.perf_counter()

        def lap(name):
            nonlocal t0
            times[name] = times.get(name, 0.0) + time.perf_counter() - t0
            t0 = time.perf_counter()

        batch = self.batch(i)
        lap("batch")
        vocab = self.vocab
        tgt = teacher_logits(self.target.model, batch, vocab) if self.loss.kind in ("opd", "osd") else None
        lap("teacher logits")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.t.autocast_bf16):
            if self.recipe == "online":
                h, block = self.engine.module.blocks(batch)
                pred = self.engine.module.head(block.float()).view(batch["anchors"].shape)
            else:
                h, pred = self.drafter(batch["feats"], batch["tokens"], batch["anchors"], batch["lengths"]), None
            lap("drafter trunk")
            logits = vocab_head(self.drafter, vocab)(h)  # [B, NB, K-1, V or Vd]
            lap("LM head")
        out = loss_step(logits, batch, self.loss, tgt, pred, metrics=False, vocab=vocab)
        lap("loss")
        out["loss"].backward()
        lap("backward")
        self.engine.zero_grad()
        return times

    def tau(self) -> float:
        """Held-out teacher-forced tau, drafts as served (the drafter's draft vocabulary)."""
        from adaflash.trainer.data import heldout_tau

        self.engine.eval()
        vocab = self.drafter.vocab

        def forward(batch):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.t.autocast_bf16):
                h = self.drafter(batch["feats"], batch["tokens"], batch["anchors"], batch["lengths"])
                return vocab_head(self.drafter, vocab)(h), torch.zeros(batch["anchors"].shape)

        with torch.no_grad():
            return heldout_tau(forward, self.held, self.drafter.block_size, 16, 8, vocab)["tau"]


def run(args) -> dict:
    from adaflash.trainer.data import supervise

    from adaflash.distributed import init_distributed
    from adaflash.target import load_target

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fp32, bf16 = load_target("smollm2", "float32"), load_target("smollm2", "bfloat16")
    rows = answers(fp32, out, args.per_domain, args.max_new_tokens)
    train, held = sequences(rows, 16)
    t0 = time.perf_counter()
    supervise(fp32.model, train + held, 8)
    supervise_s = time.perf_counter() - t0
    as_bf16 = lambda seqs: [replace(s, feats=s.feats.to(torch.bfloat16)) for s in seqs]  # noqa: E731  what supervise(feats_dtype=bf16) stores
    feat_bytes = {
        dt: sum(s.feats.numel() * s.feats.element_size() for s in seqs)
        for dt, seqs in (("fp32", train + held), ("bf16", as_bf16(train + held)))
    }
    init_distributed()
    arms = {
        ("online", "full"): Arm("online", "full", fp32, args.drafter, args.lr, (train, held)),
        ("online", "draft"): Arm("online", "draft", fp32, args.drafter, args.lr, (as_bf16(train), as_bf16(held))),
        ("pretrain", "full"): Arm("pretrain", "full", bf16, args.drafter, args.lr, (train, held)),
        ("pretrain", "draft"): Arm("pretrain", "draft", bf16, args.drafter, args.lr, (train, held)),
    }
    res = {
        "load_start": os.getloadavg(),
        "supervise_s": supervise_s,
        "feature_bytes": feat_bytes,
        "train_seqs": len(train),
        "held_seqs": len(held),
    }
    res["phases"] = {}
    for (r, v), a in arms.items():
        laps = [a.phases(i) for i in range(args.profile_steps)]
        res["phases"][f"{r}/{v}"] = {ph: statistics.median(x[ph] for x in laps) for ph in laps[0]}
    taus = {k: [a.tau()] for k, a in arms.items()}
    secs = {k: [] for k in arms}
    for i in range(args.steps):
        keys = list(arms) if i % 2 == 0 else list(reversed(arms))  # alternate who goes first
        for k in keys:
            secs[k].append(arms[k].step(i))
        print(f"step {i + 1}/{args.steps} " + " ".join(f"{r}/{v} {secs[(r, v)][-1]:.2f}s" for r, v in arms), flush=True)
    for k, a in arms.items():
        taus[k].append(a.tau())
    res["load_end"] = os.getloadavg()
    res["arms"] = {
        f"{r}/{v}": {
            "s_per_step": statistics.median(secs[(r, v)]),
            "steps_per_s": 1 / statistics.median(secs[(r, v)]),
            "seqs_per_hour": arms[(r, v)].t.seqs_per_step * 3600 / statistics.median(secs[(r, v)]),
            "tau_before": taus[(r, v)][0],
            "tau_after": taus[(r, v)][1],
        }
        for r, v in arms
    }
    (out / "results.json").write_text(json.dumps(res, indent=1))
    lines = ["| recipe | head | s/step (median) | steps/s | sequences/hour | held-out tau before -> after |", "|---|---|---|---|---|---|"]
    for name, m in res["arms"].items():
        r, v = name.split("/")
        tau = f"{m['tau_before']:.3f} -> {m['tau_after']:.3f}"
        lines.append(f"| {r} | {v} | {m['s_per_step']:.3f} | {m['steps_per_s']:.2f} | {m['seqs_per_hour']:,.0f} | {tau} |")
    lines += ["", "| phase (s) | " + " | ".join(res["phases"]) + " |", "|---|" + "---|" * len(res["phases"])]
    for ph in next(iter(res["phases"].values())):
        lines.append(f"| {ph} | " + " | ".join(f"{p[ph]:.3f}" for p in res["phases"].values()) + " |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    mb = {k: round(v / 1e6, 1) for k, v in feat_bytes.items()}
    print(f"load average start {res['load_start']}, end {res['load_end']}; teacher features MB {mb}")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m adaflash.experiments.train_speed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="runs/train-speed", help="folder for answers.json, results.json, report.md")
    p.add_argument("--drafter", default="models/drafter-smollm2", help="the starting drafter of every arm (needs a draft vocabulary)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per arm, alternated step by step")
    p.add_argument("--profile-steps", type=int, default=3, help="steps timed phase by phase per arm (median)")
    p.add_argument("--lr", type=float, default=1e-4, help="the drafter's learning rate in every arm")
    p.add_argument("--per-domain", type=int, default=16, help="eval prompts answered per domain (gsm8k, humaneval)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
