"""`adaflash experiment domain-shift`: does online distillation win back a drafter's speed after a domain shift?

A drafter pretrained WITHOUT code serves code traffic (HumanEval + stdlib "write this function"
prompts, train split) through the real pieces, one arm at a time, every arm from the same drafter:

  for each online round r = 1..R:
    1. serve the round's traffic through `adaflash.engine.Engine` (greedy) with the arm's drafter; with
       policy `fixed` whole blocks are verified and the head's prediction is recorded: its error on
       live traffic it has not trained on yet (traffic head MAE)
    2. write the finished requests as trajectories (`ShardWriter`, one shard per round, the arm's buffer)
    3. the arm's `OnlineTrainer` (loss.kind = opd | osd | head) runs one update round on that shard and
       publishes to the MLflow registry; it moves `champion` only if its gate passes. Arm `head` keeps
       the drafter frozen and trains only the length head (its error, without the drafter moving the
       labels). Arm `none` does not train.
    4. the arm's drafter becomes the registry's champion (downloaded, loaded, checked as a server would)
    5. held-out tau: the HumanEval eval split actually served with that drafter, verifying whole
       blocks (tau = tokens per target forward); when the drafter has a length head, its prediction is
       recorded for each block and compared with the acceptance rate (accepted + 1) / K: head MAE;
       likewise the starting drafter's head on the same blocks (start head MAE: what not updating costs).

Round 0 is the starting drafter's held-out tau. Held-out measurements are cached by weights digest
(greedy serving is deterministic), so an unchanged drafter (arm `none`, a rejected round) is measured once.
Resumable: each finished (arm, round) is a line of OUT/rows.jsonl and is never redone; a round cut
short is redone from its start (its stale shard is removed first; the trainer resumes from its own
checkpoint and finishes a round it had made durable). Outputs: results.json, report.md, tau_per_round.png,
head_error_per_round.png, head_r2_per_round.png.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from adaflash.config import ConfigError, from_dict, to_dict
from adaflash.engine import Engine
from adaflash.policies import FixedPolicy, HeadPolicy
from adaflash.request import Request, RequestState

ARMS = ("opd", "osd", "head", "none")  # head: the drafter stays frozen, only its length head learns


@dataclass
class TrafficSection:
    domains: list[str] = field(default_factory=lambda: ["humaneval", "code"])  # train split, interleaved
    prompts_per_round: int = 16
    max_new_tokens: int = 96
    max_prompt_tokens: int = 320  # longer prompts are skipped (the step token budget bounds prefill)

    def __post_init__(self):
        if not self.domains:
            raise ValueError("traffic.domains must name at least one domain")
        for k in ("prompts_per_round", "max_new_tokens", "max_prompt_tokens"):
            if getattr(self, k) < 1:
                raise ValueError(f"traffic.{k} must be >= 1, got {getattr(self, k)}")


@dataclass
class HeldoutSection:
    domain: str = "humaneval"  # its eval split: never part of the traffic (train split)
    prompts: int = 12
    max_new_tokens: int = 96

    def __post_init__(self):
        if self.prompts < 1 or self.max_new_tokens < 1:
            raise ValueError("heldout.prompts and heldout.max_new_tokens must be >= 1")


@dataclass
class ServeSection:
    policy: str = "fixed"  # traffic: fixed (verify the whole block) | head (the arm's length head once it has one)
    drafter_dtype: str = "float32"  # float32 | bfloat16 | q4 | auto (q4 or bf16 where this CPU runs it fast)
    max_batch: int = 8  # requests decoded together
    token_budget: int = 512  # verify tokens per engine step

    def __post_init__(self):
        if self.policy not in ("fixed", "head"):
            raise ValueError(f"serve.policy must be 'fixed' or 'head', got {self.policy!r}")
        if self.max_batch < 1 or self.token_budget < 1:
            raise ValueError("serve.max_batch and serve.token_budget must be >= 1")


@dataclass
class ExperimentConfig:
    target: str = "smollm2"
    dtype: str = "float32"
    drafter: str = "runs/drafter-smollm2-nocode"  # the starting drafter of every arm
    prompt_sets: str = "runs/pretrain-smollm2/prompts"  # train/eval.parquet (built if missing)
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    rounds: int = 4
    traffic: TrafficSection = field(default_factory=TrafficSection)
    heldout: HeldoutSection = field(default_factory=HeldoutSection)
    serve: ServeSection = field(default_factory=ServeSection)
    trainer: dict = field(default_factory=dict)  # OnlineConfig keys shared by the training arms (train, gate, ...)
    tracking_uri: str | None = None  # MLflow server; null: a private one under OUT/mlflow for this run
    min_gain: float = 1.25  # gate: OPD's final held-out tau >= min_gain x the starting tau

    def __post_init__(self):
        bad = [a for a in self.arms if a not in ARMS] + [a for a in set(self.arms) if self.arms.count(a) > 1]
        if bad or not self.arms:
            raise ValueError(f"arms must be distinct names from {list(ARMS)}, got {self.arms}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        owned = {"target", "max_rounds", "checkpoint", "mlflow"} & set(self.trainer)
        owned |= {
            f"{s}.{k}"
            for s, ks in (("drafter", ("init_dir", "from_registry")), ("loss", ("kind",)), ("buffer", ("dir", "min_new_rounds")))
            for k in ks
            if k in self.trainer.get(s, {})
        }
        if owned:
            raise ValueError(f"trainer: {sorted(owned)} are set by the experiment per arm; remove them")


# ----------------------------------------------------------------------------- pieces


@dataclass
class Prompt:
    prompt_id: str
    domain: str
    ids: list[int]


@dataclass
class Slot:
    """An arm's serving drafter: where its files are, the loaded modules, its registry version."""

    path: Path
    drafter: object
    head: object | None
    version: str
    digest: str  # dir_digest of `path`


def dir_digest(path: Path) -> str:
    """Hash of a drafter directory's weight files (drafter, draft vocabulary, length head): equal iff the
    served weights are equal (unlike target.fingerprint, which tells targets apart)."""
    h = hashlib.sha256()
    for name in ("model.safetensors", "draft_vocab.safetensors", "length_head.safetensors"):
        if (path / name).exists():
            h.update((path / name).read_bytes())
    return h.hexdigest()[:16]


def load_slot(path: Path, target, dtype: str, version: str) -> Slot:
    from adaflash.drafter import load_drafter_and_head

    return Slot(Path(path), *load_drafter_and_head(path, target, dtype), version, dir_digest(Path(path)))


class ProbePolicy(FixedPolicy):
    """Verify the whole block (so the drafter's acceptance is observed uncensored) and record what the
    length head, if the drafter has one, predicted for it: the head's error against true labels. With
    `ref_head`, also what that head (the starting one) predicts for the same blocks: `ref` holds
    (request state, index of its round, prediction)."""

    name = "fixed+probe"

    def __init__(self, ref_head=None):
        super().__init__()
        self.ref_head, self.ref = ref_head, []

    def lengths(self, states, hidden, k_blk):
        head = states[0].slot.head
        with torch.no_grad():
            if self.ref_head is not None:
                self.ref += [(s, len(s.rounds), p) for s, p in zip(states, self.ref_head(hidden.float()).tolist())]
            if head is None:
                return [k_blk] * len(states), [float("nan")] * len(states)
            pred = head(hidden.float())  # [R]
        return [k_blk] * len(states), pred.tolist()


def serve(
    target, slot: Slot, policy, prompts: list[Prompt], max_new: int, sc: ServeSection, id_prefix: str, desc: str
) -> tuple[list[RequestState], dict]:
    """Serve prompts through a fresh engine with `slot`'s drafter -> (the finished requests, their stats)."""
    engine = Engine(target.model, slot.drafter, policy, target.eos_ids, sc.max_batch, sc.token_budget, head=slot.head, version=slot.version)
    for p in prompts:
        engine.submit(Request(f"{id_prefix}-{p.prompt_id}", p.ids, max_new, domain=p.domain))
    t0 = time.perf_counter()
    bar, states = tqdm(total=len(prompts), desc=desc, unit="req", leave=False), []
    while not engine.idle:
        states += engine.step()
        bar.update(len(states) - bar.n)
    bar.close()
    wall = time.perf_counter() - t0
    tokens, rounds = sum(len(s.out) for s in states), sum(len(s.rounds) for s in states)
    k = engine.k_blk
    pairs = [
        (r.pred, min(1.0, (r.accepted + 1) / k)) for s in states for r in s.rounds if r.pred == r.pred and r.verify_len == k
    ]  # full blocks the head predicted: (prediction, label)
    st = {
        "tau": (tokens - len(states)) / max(1, rounds),
        "tokens": tokens,
        "rounds": rounds,
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "policy": policy.name,
        **head_error(pairs),
    }
    if getattr(policy, "ref_head", None) is not None:  # the starting head on the same blocks
        ref = [(p, min(1.0, (s.rounds[i].accepted + 1) / k)) for s, i, p in policy.ref if s.rounds[i].verify_len == k]
        st.update({f"start_{key}": v for key, v in head_error(ref).items()})
    return states, st


def head_error(pairs: list[tuple[float, float]]) -> dict:
    """The head's error on (prediction, label) pairs: MAE, and R^2 = 1 - MSE / variance of the labels (the
    share of the blocks' acceptance variance it explains; 0 = no better than always predicting the mean).
    MAE alone grows with the drafter's acceptance (labels spread out); R^2 does not."""
    if not pairs:
        return {"head_mae": None, "head_r2": None, "head_blocks": 0}
    n = len(pairs)
    mean = sum(y for _, y in pairs) / n
    var = sum((y - mean) ** 2 for _, y in pairs) / n
    mse = sum((p - y) ** 2 for p, y in pairs) / n
    return {"head_mae": sum(abs(p - y) for p, y in pairs) / n, "head_r2": 1 - mse / var if var > 0 else None, "head_blocks": n}


def interleave(lists: list[list]) -> list:
    """Round robin: the first of each list, then the second of each, ... (shorter lists drop out)."""
    return [xs[i] for i in range(max(map(len, lists), default=0)) for xs in lists if i < len(xs)]


def load_prompts(cfg: ExperimentConfig, target) -> tuple[list[list[Prompt]], list[Prompt]]:
    """-> (traffic prompts per round, held-out prompts)."""
    from adaflash.pipelines.prompts import build_prompt_sets, read_prompts

    sets = Path(cfg.prompt_sets)
    if not (sets / "train.parquet").exists() or not (sets / "eval.parquet").exists():
        build_prompt_sets(sets)

    def encode(recs) -> list[Prompt]:
        out = [Prompt(r.prompt_id, r.domain, target.encode_chat(r.messages)) for r in recs]
        return [p for p in out if len(p.ids) <= min(cfg.traffic.max_prompt_tokens, cfg.serve.token_budget)]

    per_domain = [encode(read_prompts(sets / "train.parquet", [d])) for d in cfg.traffic.domains]
    pool = interleave(per_domain)
    if not pool:
        raise ConfigError(f"no train prompts of {cfg.traffic.domains} within {cfg.traffic.max_prompt_tokens} tokens in {sets}")
    n = cfg.traffic.prompts_per_round
    traffic = [[pool[(r * n + i) % len(pool)] for i in range(n)] for r in range(cfg.rounds)]
    held = encode(read_prompts(sets / "eval.parquet", [cfg.heldout.domain]))[: cfg.heldout.prompts]
    if not held:
        raise ConfigError(f"no eval prompts of {cfg.heldout.domain!r} within {cfg.traffic.max_prompt_tokens} tokens in {sets}")
    return traffic, held


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def tracking_server(uri: str | None, root: Path):
    """`uri` as is, or a private real `mlflow server` (SQLite + artifacts under `root`) for the block."""
    if uri:
        yield uri
        return
    from adaflash.pipelines.mlflow_server import start_mlflow_server, stop_mlflow_server, wait_ready

    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = start_mlflow_server(
        port=port,
        store_uri=f"sqlite:///{(root / 'mlflow.db').resolve()}",
        artifacts_dir=str((root / "artifacts").resolve()),
        log_path=root / "server.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, 180, proc)
        yield url
    finally:
        stop_mlflow_server(proc)


def run_meta(out: Path, cfg: ExperimentConfig, kind: str) -> dict:
    """OUT/experiment.json: a run tag (unique registry names per run) and the config; a rerun into the
    same OUT must use the same config (rounds and arms may grow)."""
    path = out / "experiment.json"
    now = to_dict(cfg)
    if path.exists():
        meta = json.loads(path.read_text())
        keep = lambda d: {k: v for k, v in d.items() if k not in ("rounds", "arms")}  # noqa: E731
        if meta["kind"] != kind or keep(meta["config"]) != keep(now):
            raise ConfigError(f"{out} holds a run with another config ({path}): use a new --out, or delete it to start over")
        meta["config"] = now
    else:
        meta = {"kind": kind, "run_tag": time.strftime("%Y%m%d-%H%M%S") + f"-{random.randrange(16**4):04x}", "config": now}
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=1))
    return meta


# ----------------------------------------------------------------------------- the experiment


def trainer_config(cfg: ExperimentConfig, arm: str, arm_dir: Path, uri: str, model_name: str):
    """The arm's OnlineConfig: the shared `trainer` keys plus what the experiment owns."""
    from adaflash.trainer.config import OnlineConfig

    data = json.loads(json.dumps(cfg.trainer))
    own = {
        "target": {"source": cfg.target, "dtype": cfg.dtype},
        "drafter": {"init_dir": cfg.drafter, "from_registry": False},
        "buffer": {"dir": str(arm_dir / "buffer"), "min_new_rounds": 1},  # one shard = one online round
        "loss": {"kind": arm},
        "checkpoint": {"dir": str(arm_dir / "ckpt")},
        "mlflow": {"tracking_uri": uri, "experiment": "domain-shift", "model_name": model_name},
        "max_rounds": 0,
    }
    for k, v in own.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) else v
    return from_dict(OnlineConfig, data, "trainer")


class Experiment:
    def __init__(self, cfg: ExperimentConfig, out: Path, log=None):
        from adaflash.target import load_target

        self.cfg, self.out = cfg, Path(out)
        self.log = log or (lambda line: tqdm.write(line))
        self.meta = run_meta(self.out, cfg, "domain-shift")
        self.target = load_target(cfg.target, cfg.dtype)
        self.traffic, self.held = load_prompts(cfg, self.target)
        self.start = load_slot(Path(cfg.drafter), self.target, cfg.serve.drafter_dtype, "start")
        self.rows_path, self.evals_path = self.out / "rows.jsonl", self.out / "evals.json"
        self.rows = [json.loads(x) for x in self.rows_path.read_text().splitlines()] if self.rows_path.exists() else []
        self.evals = json.loads(self.evals_path.read_text()) if self.evals_path.exists() else {}

    def run(self) -> dict:
        with tracking_server(self.cfg.tracking_uri, self.out / "mlflow") as uri:
            for arm in self.cfg.arms:
                self.run_arm(arm, uri)
        return write_report(self.rows, self.cfg, self.meta, self.out, self.log)

    def heldout(self, slot: Slot) -> dict:
        """Held-out tau and head MAE of `slot` (cached by weights digest)."""
        if slot.digest not in self.evals:
            _, st = serve(
                self.target,
                slot,
                ProbePolicy(self.start.head),
                self.held,
                self.cfg.heldout.max_new_tokens,
                self.cfg.serve,
                "heldout",
                f"held-out v{slot.version}",
            )
            self.evals[slot.digest] = st
            self.evals_path.write_text(json.dumps(self.evals, indent=1))
        return self.evals[slot.digest]

    def run_arm(self, arm: str, uri: str) -> None:
        from adaflash.registry import Registry

        cfg, arm_dir = self.cfg, self.out / "arms" / arm
        done = {r["round"] for r in self.rows if r["arm"] == arm}
        if all(r in done for r in range(cfg.rounds + 1)):
            return
        trainer = registry = None
        if arm != "none":
            from adaflash.trainer.online import OnlineTrainer

            model_name = f"domain-shift-{self.meta['run_tag']}-{arm}"
            tcfg = trainer_config(cfg, arm, arm_dir, uri, model_name)
            trainer = OnlineTrainer(tcfg, log=lambda line: self.log(f"[{arm}] {line}"))
            registry = Registry(uri, model_name)
        slot = self.champion(registry, arm_dir, self.start) if registry is not None else self.start  # resumed: where it got to
        minutes = max([r["minutes"] for r in self.rows if r["arm"] == arm], default=0.0)
        bar = tqdm(total=cfg.rounds + 1, initial=len(done), desc=f"arm {arm}", unit="round")
        for r in range(cfg.rounds + 1):
            if r in done:
                continue
            t0 = time.perf_counter()
            served, summary = None, None
            if r > 0:
                served = self.serve_round(arm, arm_dir, r, slot, trainer)
                if trainer is not None:
                    summary = self.train_round(trainer, arm_dir, r)
            if registry is not None:
                slot = self.champion(registry, arm_dir, slot)
            ev = self.heldout(slot)
            minutes += (time.perf_counter() - t0) / 60 if r else 0.0  # online time: round 0 only measures the start
            row = {
                "arm": arm,
                "round": r,
                "served_tau": served and served["tau"],
                "served_tokens_per_s": served and served["tokens_per_s"],
                "traffic_policy": served and served["policy"],
                "heldout_tau": ev["tau"],
                "head_mae": ev["head_mae"],
                "head_blocks": ev["head_blocks"],
                "traffic_head_mae": served and served["head_mae"],
                "head_r2": ev.get("head_r2"),
                "traffic_head_r2": served and served.get("head_r2"),
                "start_head_mae": ev.get("start_head_mae"),
                "start_head_r2": ev.get("start_head_r2"),
                "minutes": round(minutes, 3),
                "rows_trained": summary["train"] if summary else 0,
                "drafter_version": slot.version,
                "fingerprint": slot.digest,  # the results' name for the weights digest
                "promoted": summary and summary["promote"],
                "trainer_tau_before": summary and summary["tau_before"],
                "trainer_tau_after": summary and summary["tau_after"],
                "trainer_head_mae": summary and summary["head_mae_after"],
                "loss_last": summary and summary["loss_last"],
            }
            with open(self.rows_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            self.rows.append(row)
            bar.update(1)
            self.log(
                f"[{arm}] round {r}: held-out tau {ev['tau']:.3f}"
                + (f", traffic tau {served['tau']:.3f}" if served else "")
                + (f", head MAE {ev['head_mae']:.3f}" if ev["head_mae"] is not None else "")
                + (f", trained on {summary['train']} rows ({'promoted' if summary['promote'] else 'rejected'})" if summary else "")
                + f", v{slot.version}, {minutes:.1f} min"
            )
        bar.close()

    def serve_round(self, arm: str, arm_dir: Path, r: int, slot: Slot, trainer) -> dict:
        """Serve round r's traffic and write it as one buffer shard (skipped if the trainer already has it)."""
        from adaflash.buffer import ShardWriter

        served_path = arm_dir / f"served-round{r}.json"
        if trainer is not None and trainer.state["round"] >= r:
            return json.loads(served_path.read_text())  # trained before a restart; its traffic is consumed
        buf, writer_id = arm_dir / "buffer", f"{arm}-round{r}"
        for stale in buf.glob(f"{writer_id}-*.parquet"):  # a cut-short earlier attempt, never consumed
            stale.unlink()
        cs = self.cfg.serve
        # fixed: whole blocks, with the head's prediction recorded (its error on live traffic it has not trained on)
        policy = HeadPolicy(slot.head) if cs.policy == "head" and slot.head is not None else ProbePolicy()
        states, st = serve(
            self.target, slot, policy, self.traffic[r - 1], self.cfg.traffic.max_new_tokens, cs, f"r{r}", f"{arm} traffic r{r}"
        )
        writer = ShardWriter(buf, writer_id, rows_per_shard=10**9, max_age_s=None)
        writer.extend(Engine.trajectory(s, writer_id) for s in states)
        st["shard"] = writer.close()
        served_path.write_text(json.dumps(st))
        return st

    @staticmethod
    def train_round(trainer, arm_dir: Path, r: int) -> dict:
        if trainer.state["round"] < r:
            trainer.run(1)
        for line in (arm_dir / "ckpt" / "rounds.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec["round"] == r:
                return rec
        raise RuntimeError(f"trainer finished round {r} but {arm_dir / 'ckpt' / 'rounds.jsonl'} has no line for it")

    def champion(self, registry, arm_dir: Path, slot: Slot) -> Slot:
        """The registry's champion as this arm's serving drafter (what a server's hot-swap would load)."""
        version = registry.champion()
        if version is None or version == slot.version:
            return slot
        path = registry.download(version, arm_dir / "versions")
        return load_slot(path, self.target, self.cfg.serve.drafter_dtype, version)


# ----------------------------------------------------------------------------- report


def _fmt(v, spec=".3f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def write_report(rows: list[dict], cfg: ExperimentConfig, meta: dict, out: Path, log=print) -> dict:
    arms = [a for a in ARMS if any(r["arm"] == a for r in rows)]  # also those of an earlier run into OUT
    rows = sorted(rows, key=lambda r: (arms.index(r["arm"]), r["round"]))
    final = {a: max((r for r in rows if r["arm"] == a), key=lambda r: r["round"]) for a in arms}
    start = next((r["heldout_tau"] for r in rows if r["round"] == 0), None)
    gate = {
        "start_tau": start,
        "final_tau": {a: f["heldout_tau"] for a, f in final.items()},
        "final_round": {a: f["round"] for a, f in final.items()},
        "min_gain": cfg.min_gain,
    }
    opd, osd = final.get("opd"), final.get("osd")
    gate["gain_met"] = bool(opd and start and opd["round"] == cfg.rounds and opd["heldout_tau"] >= cfg.min_gain * start)
    gate["opd_ge_osd"] = bool(opd and osd and opd["heldout_tau"] >= osd["heldout_tau"]) if osd else None
    gate["met"] = gate["gain_met"] and gate["opd_ge_osd"] is not False
    result = {"meta": meta, "rows": rows, "gate": gate}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    plots = plot_rounds(rows, arms, cfg.min_gain, start, out)
    lines = [
        f"# Domain shift: a no-code drafter serving code traffic ({cfg.rounds} online rounds)",
        "",
        f"Start drafter `{cfg.drafter}`, traffic {cfg.traffic.domains} (train split, {cfg.traffic.prompts_per_round} "
        f"prompts x {cfg.traffic.max_new_tokens} tokens per round, policy {cfg.serve.policy}), held-out "
        f"{cfg.heldout.prompts} {cfg.heldout.domain} eval prompts x {cfg.heldout.max_new_tokens} tokens, whole blocks verified.",
        "tau = tokens committed per target forward (engine, greedy). Head MAE = |predicted - (accepted+1)/K| on held-out "
        "blocks; traffic head MAE: the same for the head that served round r's traffic (round r-1's), before it trained on it.",
        "Head R^2 = 1 - MSE / variance of the labels: the share of the blocks' acceptance variance the head explains. "
        "Start head: the starting drafter's head, never updated, on the same held-out blocks of the round's drafter.",
        "",
        "| arm | round | held-out tau | traffic tau | head MAE | head R^2 | start head MAE | start head R^2 "
        "| traffic head MAE | traffic head R^2 | rows trained | promoted | version | minutes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        promoted = "-" if r["promoted"] is None else ("yes" if r["promoted"] else "no")
        lines.append(
            f"| {r['arm']} | {r['round']} | {_fmt(r['heldout_tau'])} | {_fmt(r['served_tau'])} | "
            f"{_fmt(r['head_mae'])} | {_fmt(r.get('head_r2'))} | {_fmt(r.get('start_head_mae'))} | "
            f"{_fmt(r.get('start_head_r2'))} | {_fmt(r.get('traffic_head_mae'))} | "
            f"{_fmt(r.get('traffic_head_r2'))} | {r['rows_trained']} | {promoted} | {r['drafter_version']} | {r['minutes']:.1f} |"
        )
    verdict = (
        f"Gate: OPD held-out tau {_fmt(gate['final_tau'].get('opd'))} vs {cfg.min_gain} x start {_fmt(start)} "
        f"= {_fmt(start and cfg.min_gain * start)}: {'met' if gate['gain_met'] else 'NOT met'}; OPD >= OSD: "
        + ({True: "met", False: "NOT met", None: "n/a (no osd arm)"}[gate["opd_ge_osd"]])
    )
    head_lines = [head_verdict(a, [r for r in rows if r["arm"] == a]) for a in arms if a != "none"]
    lines += ["", verdict, ""] + [x for x in head_lines if x] + [""] + [f"![{p.stem}]({p.name})" for p in plots]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    log(verdict)
    for x in head_lines:
        if x:
            log(x)
    return result


def head_verdict(arm: str, rows: list[dict]) -> str | None:
    """One line on the arm's length head: held-out MAE at the start and the last round, and the starting
    head's MAE on that last round's blocks (what not updating the head would have cost)."""
    pts = [r for r in rows if r.get("head_mae") is not None]
    if len(pts) < 2:
        return None
    first, last = pts[0], pts[-1]
    ref = "" if last.get("start_head_mae") is None else f" (the start head on the same blocks: {_fmt(last['start_head_mae'])})"
    return (
        f"Head ({arm}): held-out MAE {_fmt(first['head_mae'])} at round {first['round']} -> {_fmt(last['head_mae'])} "
        f"at round {last['round']}{ref}; R^2 {_fmt(first.get('head_r2'))} -> {_fmt(last.get('head_r2'))}"
    )


def plot_rounds(rows: list[dict], arms: list[str], min_gain: float, start: float | None, out: Path) -> list[Path]:
    from adaflash.pipelines.plots import _pyplot

    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    paths = []
    for name, key, ylabel, title in (
        (
            "tau_per_round",
            "heldout_tau",
            "tau (tokens per target forward)",
            "Held-out tau per online round (solid) and traffic tau (dashed)",
        ),
        (
            "head_error_per_round",
            "head_mae",
            "length-head MAE",
            "Length-head MAE: held-out (solid), next round's traffic (dashed),\nstart head never updated, same held-out blocks (dotted)",
        ),
        (
            "head_r2_per_round",
            "head_r2",
            "length-head R^2 (1 - MSE / label variance)",
            "Length-head R^2: held-out (solid), next round's traffic (dashed),\nstart head never updated, same held-out blocks (dotted)",
        ),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4))
        for i, arm in enumerate(arms):
            pts = [(r["round"], r.get(key)) for r in rows if r["arm"] == arm and r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", color=f"C{i}", label=arm)
            dashed = {"heldout_tau": "served_tau", "head_mae": "traffic_head_mae", "head_r2": "traffic_head_r2"}[key]
            # traffic of round r is served by round r-1's drafter and head: plot it against r-1
            shift = 1 if key.startswith("head") else 0
            served = [(r["round"] - shift, r[dashed]) for r in rows if r["arm"] == arm and r.get(dashed) is not None]
            if served:
                ax.plot(*zip(*served), ls="--", color=f"C{i}", alpha=0.6)
            ref = [
                (r["round"], r.get(f"start_{key}"))
                for r in rows
                if r["arm"] == arm and r["round"] > 0 and key.startswith("head") and r.get(f"start_{key}") is not None
            ]
            if ref:  # the starting head, never updated, on the same held-out blocks
                ax.plot(*zip(*ref), ls=":", marker="x", color=f"C{i}", alpha=0.6)
        if key == "heldout_tau" and start:
            ax.axhline(min_gain * start, color="gray", ls=":", label=f"{min_gain} x start")
        if not ax.lines:
            ax.text(0.5, 0.5, "no length head in any arm", ha="center", va="center", transform=ax.transAxes)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("online round")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
        paths.append(out / f"{name}.png")
    return paths
