"""`adaflash experiment replay`: distillation losses compared offline on recorded traffic, over seeds.

The online domain-shift run (`online_experiment`) answers "does the drafter recover?" once per arm: one
traffic order, a dozen held-out prompts, half an hour an arm. Two losses within ~0.03 tau of each other
cannot be told apart that way. This replays what serving recorded instead:

  the buffer's trajectories (read only: no ledger, nothing moved) in time order, cut into R rounds;
  for each named loss and each seed, from the same starting drafter:
    for round r = 1..R: `steps_per_update` optimizer steps on round r's trajectories plus those of the
    previous `train.replay_rounds` rounds (the gate's held-out fifth excluded, as the trainer does),
    through the online trainer's own data path (`trainer.data`) and training step (`adaflash.recipe`);
    then held-out tau.

Held-out tau here is teacher-forced: the target's own greedy answers to eval prompts (generated once,
cached in OUT/eval_answers.json), every `stride`-th answer position an anchor, tau = 1 + mean accepted
length of the drafts as served (the block argmax over the drafter's draft vocabulary when it has one,
whatever vocabulary a loss trains on) against the target's next tokens. For greedy decoding that is the
acceptance verification gives (the served text IS the target's greedy text), measured on several times
more prompts than the online run serves. The seed sets the batch order and anchor sampling.

Differences from the online trainer: the drafter only (no length head) on a single process (DeepSpeed
ZeRO 0, its gradients clipped as the trainer clips a parameter group), and no promotion gate (every round
is kept). Recorded anchors come from the drafter that served the traffic, not the one being trained.
Resumable: each finished (loss, seed) is a line of OUT/runs.jsonl and is not redone.
Outputs: results.json, report.md, tau_per_round.png.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from adaflash.trainer.config import OnlineLossSection, TrainSection
from tqdm import tqdm

from adaflash.config import ConfigError, from_dict, to_dict
from adaflash.recipe import block_logits, clip_per_group, deepspeed_config, train_step


@dataclass
class EvalSection:
    domain: str = "humaneval"  # its eval split (disjoint from the train split traffic is drawn from)
    skip: int = 12  # the first `skip` usable prompts are the online run's held-out set: kept out of this one
    prompts: int = 70
    max_new_tokens: int = 96
    max_prompt_tokens: int = 320
    stride: int = 2  # every stride-th answer position anchors a block

    def __post_init__(self):
        if self.skip < 0:
            raise ValueError(f"eval.skip must be >= 0, got {self.skip}")
        for k in ("prompts", "max_new_tokens", "max_prompt_tokens", "stride"):
            if getattr(self, k) < 1:
                raise ValueError(f"eval.{k} must be >= 1, got {getattr(self, k)}")


@dataclass
class ReplayConfig:
    target: str = "smollm2"
    dtype: str = "float32"
    drafter: str = "runs/drafter-smollm2-nocode-head"  # the starting drafter of every (loss, seed)
    prompt_sets: str = "runs/pretrain-smollm2/prompts"  # eval.parquet (built if missing)
    buffer: str = "runs/domain-shift/arms/none/buffer"  # recorded traffic: Parquet shards of a trajectory buffer
    rounds: int = 6  # the trajectories in time order, cut into this many update rounds
    losses: dict = field(default_factory=lambda: {"osd": {"kind": "osd"}, "opd": {"kind": "opd"}})  # name -> loss keys
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    heldout_frac: float = 0.2  # the trainer's gate split (by request id): never trained on, here as online
    train: TrainSection = field(default_factory=TrainSection)  # the drafter's keys (lr, steps, replay_rounds, ...)
    eval: EvalSection = field(default_factory=EvalSection)

    def __post_init__(self):
        if not self.losses:
            raise ValueError("losses must name at least one loss, e.g. {osd: {kind: osd}, opd: {kind: opd}}")
        self.loss_sections = {name: from_dict(OnlineLossSection, keys, f"losses.{name}") for name, keys in self.losses.items()}
        for name, lc in self.loss_sections.items():
            if lc.kind not in ("opd", "osd"):
                raise ValueError(f"losses.{name}.kind must be 'opd' or 'osd' (a distillation loss), got {lc.kind!r}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be a non-empty list of distinct integers, got {self.seeds}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.train.seed or self.train.head_refit_epochs:
            raise ValueError(
                "train.seed and train.head_refit_epochs are not used by the replay (it trains the drafter "
                "only, once per entry of `seeds`): remove them and list the seeds under `seeds`"
            )
        if not 0.0 <= self.heldout_frac < 1.0:
            raise ValueError(f"heldout_frac must be in [0, 1), got {self.heldout_frac}")


def read_rounds(buffer: Path, rounds: int, log=print) -> list[list]:
    """The buffer's trajectories in time order, cut into `rounds` equal parts. Read only: a shard that
    cannot be read or has a foreign schema is skipped with a warning, never moved (the buffer may be live)."""
    import pyarrow.parquet as pq

    from adaflash.buffer import from_arrow, schema_problem
    from adaflash.buffer.files import is_hidden

    files = sorted(p for p in Path(buffer).glob("*.parquet") if not is_hidden(p.name))
    trajs = []
    for p in files:
        try:
            table = pq.read_table(p)
            problem = schema_problem(table.schema)
        except Exception as e:  # torn or not Parquet
            problem = f"unreadable ({type(e).__name__}: {e})"
        if problem:
            log(f"[replay] skipping {p.name}: {problem}")
            continue
        trajs += from_arrow(table)
    if len(trajs) < rounds:
        raise ConfigError(
            f"{buffer} holds {len(trajs)} readable trajectories, fewer than rounds={rounds}; point `buffer` "
            "at the buffer of a run that served traffic (e.g. an `adaflash experiment domain-shift` arm)"
        )
    trajs.sort(key=lambda t: t.created_ns)
    return [trajs[i * len(trajs) // rounds : (i + 1) * len(trajs) // rounds] for i in range(rounds)]


def eval_answers(cfg: ReplayConfig, target, out: Path) -> list[dict]:
    """The target's greedy answers to the eval prompts (plain decoding through the engine), cached as JSON."""
    from adaflash.pipelines.prompts import build_prompt_sets, read_prompts

    from adaflash.engine import Engine
    from adaflash.policies import ARPolicy
    from adaflash.request import Request

    path, ec = out / "eval_answers.json", cfg.eval
    key = {"target": target.identity, "eval": to_dict(ec), "prompt_sets": str(cfg.prompt_sets)}
    if path.exists():
        cached = json.loads(path.read_text())
        if cached["key"] == key:
            return cached["answers"]
    sets = Path(cfg.prompt_sets)
    if not (sets / "eval.parquet").exists():
        build_prompt_sets(sets)
    recs = read_prompts(sets / "eval.parquet", [ec.domain])
    prompts = [(r.prompt_id, target.encode_chat(r.messages)) for r in recs]
    prompts = [p for p in prompts if len(p[1]) <= ec.max_prompt_tokens][ec.skip : ec.skip + ec.prompts]
    if not prompts:
        raise ConfigError(f"no {ec.domain!r} eval prompts within {ec.max_prompt_tokens} tokens after skipping {ec.skip}")
    engine = Engine(target.model, None, ARPolicy(), target.eos_ids, max_batch=8, token_budget=ec.max_prompt_tokens * 8)
    for pid, ids in prompts:
        engine.submit(Request(pid, ids, ec.max_new_tokens, domain=ec.domain))
    bar, finished = tqdm(total=len(prompts), desc="eval answers (target, greedy)", unit="req", leave=False), []
    while not engine.idle:
        finished += engine.step()
        bar.update(len(finished) - bar.n)
    bar.close()
    answers = [{"id": s.req.request_id, "prompt_ids": list(s.req.prompt_ids), "output_ids": list(s.out)} for s in finished]
    path.write_text(json.dumps({"key": key, "answers": answers}))
    return answers


def eval_sequences(answers: list[dict], domain: str, k_blk: int, stride: int) -> list:
    """Answers -> trainer Sequences whose anchors are every `stride`-th answer position with a full block."""
    from adaflash.trainer.data import Sequence

    seqs = []
    for a in answers:
        tokens = torch.tensor(a["prompt_ids"] + a["output_ids"], dtype=torch.long)  # [L]
        anchors = torch.arange(len(a["prompt_ids"]), len(tokens) - k_blk + 1, stride)  # block a..a+K-1 inside
        if len(anchors):
            seqs.append(Sequence(a["id"], domain, tokens, anchors))
    return seqs


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().numpy().tobytes())
    return h.hexdigest()[:16]


class Replay:
    """Every (loss, seed) of the config replayed from the start drafter; finished pairs are read back, not redone."""

    def __init__(self, cfg: ReplayConfig, out: Path, log=None):
        from adaflash.target import load_target

        self.cfg, self.out = cfg, Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = log or (lambda line: tqdm.write(line))
        self.target = load_target(cfg.target, cfg.dtype)
        self.runs_path = self.out / "runs.jsonl"
        self.runs = [json.loads(x) for x in self.runs_path.read_text().splitlines()] if self.runs_path.exists() else []
        self.rounds, self.eval = [], []
        self.k_blk = self._drafter().block_size

    def _prepare(self) -> None:
        """The training rounds and the eval answers, with the target's supervision (only when there is work)."""
        from adaflash.trainer.data import is_heldout, supervise, to_sequences

        cfg = self.cfg
        self.rounds = [
            [s for s in to_sequences(part) if not is_heldout(s.request_id, cfg.heldout_frac)]
            for part in read_rounds(Path(cfg.buffer), cfg.rounds, self.log)
        ]
        self.eval = eval_sequences(eval_answers(cfg, self.target, self.out), cfg.eval.domain, self.k_blk, cfg.eval.stride)
        t = cfg.train
        for part in self.rounds + [self.eval]:  # the teacher, once: every (loss, seed) reads the same rows
            supervise(self.target.model, part, t.eval_seqs)
        self.log(
            f"[replay] {sum(map(len, self.rounds))} training trajectories in {cfg.rounds} rounds "
            f"({[len(r) for r in self.rounds]}), {len(self.eval)} eval answers, "
            f"{sum(len(s.anchors) for s in self.eval)} eval blocks"
        )

    def _drafter(self):
        from adaflash.drafter import load_drafter

        return load_drafter(self.cfg.drafter, self.target.model, self.target.identity, torch.float32)

    def run(self) -> dict:
        cfg = self.cfg
        done = {(r["loss"], r["seed"]) for r in self.runs}
        # seed by seed: every finished seed is a complete paired comparison of the losses
        todo = [(name, seed) for seed in cfg.seeds for name in cfg.loss_sections if (name, seed) not in done]
        if todo:
            self._prepare()
        start = None
        for name, seed in todo:
            rec = self.run_one(name, seed, start)
            start = rec["tau"][0]  # the same starting drafter every time
            with open(self.runs_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            self.runs.append(rec)
        return write_report(self.runs, cfg, self.out, self.log)

    def heldout_tau(self, drafter) -> float:
        """The trainer's held-out tau (trainer.data.heldout_tau) of the drafts as served: over the drafter's
        draft vocabulary when it has one."""
        from adaflash.trainer.data import heldout_tau

        drafter.eval()
        t = self.cfg.train

        def forward(batch):  # -> draft logits [B, NB, K-1, V] or [B, NB, K-1, Vd], no head: zeros [B, NB]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=t.autocast_bf16):
                return block_logits(drafter, batch, drafter.vocab), torch.zeros(batch["anchors"].shape)

        return heldout_tau(forward, self.eval, self.k_blk, t.anchors_per_seq, t.eval_seqs, drafter.vocab)["tau"]

    def run_one(self, name: str, seed: int, start_tau: float | None) -> dict:
        import deepspeed
        from adaflash.trainer.data import make_batch, train_items

        from adaflash.distributed import init_distributed

        cfg, t, lc = self.cfg, self.cfg.train, self.cfg.loss_sections[name]
        torch.manual_seed(seed)
        drafter = self._drafter().requires_grad_(True)
        init_distributed()
        engine, _, _, _ = deepspeed.initialize(model=drafter, model_parameters=drafter.parameters(), config=deepspeed_config(t, clip=False))
        clip = (lambda e: {"grad_norm": clip_per_group(e, t.grad_clip)[0]}) if t.grad_clip > 0 else None
        taus = [start_tau if start_tau is not None else self.heldout_tau(drafter)]
        losses, t0 = [], time.perf_counter()
        bar = tqdm(total=cfg.rounds * t.steps_per_update, desc=f"{name} seed {seed}", unit="step", leave=False)
        for r in range(1, cfg.rounds + 1):
            seqs = [s for part in self.rounds[max(0, r - 1 - t.replay_rounds) : r] for s in part]
            round_losses = []
            for i in range(t.steps_per_update):
                batch = make_batch(train_items(seqs, i, 0, 1, t.seqs_per_step, t.anchors_per_seq, seed, r), self.k_blk)
                step = train_step(engine, batch, lc, teacher=self.target.model, autocast=t.autocast_bf16, clip=clip)
                round_losses.append(step["loss"])
                bar.update(1)
            losses.append(statistics.fmean(round_losses))
            taus.append(self.heldout_tau(drafter))
            bar.set_postfix(tau=f"{taus[-1]:.3f}")
        bar.close()
        rec = {
            "loss": name,
            "seed": seed,
            "loss_config": to_dict(lc),
            "tau": taus,
            "train_loss": losses,
            "weights": weights_digest(drafter),
            "minutes": round((time.perf_counter() - t0) / 60, 2),
        }
        self.log(f"[replay] {name} seed {seed}: tau " + " ".join(f"{x:.3f}" for x in taus) + f" ({rec['minutes']:.1f} min)")
        return rec


def _mean_sd(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.3f}" + (f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else "")


def write_report(runs: list[dict], cfg: ReplayConfig, out: Path, log=print) -> dict:
    """Per loss: mean ± sd of tau per round over seeds; each loss against the first one, seed by seed."""
    names = [n for n in cfg.loss_sections if any(r["loss"] == n for r in runs)]
    by = {n: {r["seed"]: r for r in runs if r["loss"] == n} for n in names}
    start = runs[0]["tau"][0] if runs else math.nan
    summary = {n: {"seeds": sorted(by[n]), "mean": [statistics.fmean(x) for x in zip(*(r["tau"] for r in by[n].values()))]} for n in names}
    lines = [
        f"# Loss replay: {len(names)} losses x {len({r['seed'] for r in runs})} seeds on recorded traffic ({cfg.rounds} rounds)",
        "",
        f"Start drafter `{cfg.drafter}`, traffic `{cfg.buffer}`, {cfg.train.steps_per_update} steps per round "
        f"(lr {cfg.train.lr}, {cfg.train.seqs_per_step} trajectories x {cfg.train.anchors_per_seq} recorded blocks per step, "
        f"replay {cfg.train.replay_rounds} rounds). Held-out: teacher-forced tau on the target's greedy answers to "
        f"{cfg.eval.prompts} {cfg.eval.domain} eval prompts (after the first {cfg.eval.skip}), one block anchored every "
        f"{cfg.eval.stride} answer positions. Start tau {start:.3f}. Cells: mean ± sd over seeds.",
        "",
        "| loss | seeds | " + " | ".join(f"round {r}" for r in range(1, cfg.rounds + 1)) + " | final / start |",
        "|---|---|" + "---|" * (cfg.rounds + 1),
    ]
    for n in names:
        rs = list(by[n].values())
        cells = [_mean_sd([r["tau"][k] for r in rs]) for k in range(1, cfg.rounds + 1)]
        lines.append(f"| {n} | {len(rs)} | " + " | ".join(cells) + f" | {summary[n]['mean'][-1] / start:.3f}x |")
    verdicts = []
    for n in names[1:]:
        ref = names[0]
        seeds = sorted(set(by[n]) & set(by[ref]))
        if not seeds:
            continue
        diffs = [by[n][s]["tau"][-1] - by[ref][s]["tau"][-1] for s in seeds]
        allr = [by[n][s]["tau"][k] - by[ref][s]["tau"][k] for s in seeds for k in range(1, cfg.rounds + 1)]
        summary[n]["vs_" + ref] = {
            "final_diff": diffs,
            "final_mean": statistics.fmean(diffs),
            "wins_final": sum(d > 0 for d in diffs),
            "wins_all_rounds": sum(d > 0 for d in allr),
            "ties_all_rounds": sum(d == 0 for d in allr),
            "rounds_compared": len(allr),
        }
        v = summary[n]["vs_" + ref]
        verdicts.append(
            f"{n} - {ref}, final round, same seed: {v['final_mean']:+.3f} mean ("
            + ", ".join(f"{d:+.3f}" for d in diffs)
            + f"); {n} ahead in {v['wins_final']} of {len(seeds)} seeds "
            f"at the end and in {v['wins_all_rounds']} of {len(allr)} (seed, round) pairs "
            f"({v['ties_all_rounds']} ties)"
        )
    plot = plot_replay(runs, names, cfg.rounds, out)
    lines += [""] + verdicts + ["", f"![{plot.stem}]({plot.name})"]
    result = {"config": to_dict(cfg), "start_tau": start, "runs": runs, "summary": summary, "verdicts": verdicts}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "report.md").write_text("\n".join(lines) + "\n")
    for x in verdicts:
        log(x)
    return result


def plot_replay(runs: list[dict], names: list[str], rounds: int, out: Path) -> Path:
    """Mean tau per round per loss, with the spread over seeds (min..max) shaded."""
    from adaflash.pipelines.plots import _pyplot
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    xs = list(range(rounds + 1))
    for i, n in enumerate(names):
        curves = [r["tau"] for r in runs if r["loss"] == n]
        cols = list(zip(*curves))
        ax.plot(xs, [statistics.fmean(c) for c in cols], marker="o", color=f"C{i}", label=f"{n} (mean of {len(curves)} seeds)")
        if len(curves) > 1:
            ax.fill_between(xs, [min(c) for c in cols], [max(c) for c in cols], color=f"C{i}", alpha=0.15)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("update round (replayed traffic)")
    ax.set_ylabel("held-out tau (teacher-forced)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Losses replayed on recorded traffic: mean tau, min..max over seeds")
    fig.tight_layout()
    path = out / "tau_per_round.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
