"""Offline pretraining of the initial drafter (DFlash recipe, REFERENCE.md section 2).

Stages, each resumable (`adaflash pretrain --config configs/pretrain_smollm2.yaml [--stage S]`):
  prompts     build the per-domain train/eval prompt sets (Parquet, deterministic split)
  magpie      with a `magpie:` section: the target writes new user turns where it runs (the GPU),
              filtered and added to those sets as magpie_* prompts (pipelines/magpie.py)
  regenerate  the target answers the training prompts; answers + target features as shards
  train       DeepSpeed training: random anchors, block mask, position-decayed cross-entropy;
              checkpoints every `save_every` steps and resumes from the latest one
  export      writes the drafter directory (bf16 safetensors + config.json with target identity)
  eval        tau per domain on the eval split with the exported drafter (greedy, fp32 target)
  gate        with a `gate:` section: the export against the committed drafter in one eval run; it
              replaces that drafter only when its tau is higher on every domain (pipelines/gate.py)

The drafter starts from random weights, from the target's last layers, or from an existing drafter
(`drafter.init`: a drafter directory such as the committed one, or `registry:<version|alias>`):
continual pretraining, which keeps that drafter's architecture and draft vocabulary
(pipelines/drafter_start.py).
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import torch
from adaflash.pipelines.drafter_start import START, DrafterSection, init_copy, start_drafter
from adaflash.pipelines.evaluate import EvalSection
from adaflash.pipelines.gate import GateSection
from adaflash.pipelines.magpie import MagpieSection
from tqdm import tqdm

from adaflash.config import to_dict
from adaflash.distributed import from_rank0, init_distributed
from adaflash.recipe import VOCABS, LossSection, StepSection, deepspeed_config, train_step
from adaflash.target import Target, load_target

STAGES = ("prompts", "magpie", "regenerate", "train", "export", "eval", "gate")


@dataclass
class TargetSection:
    source: str = "smollm2"  # "smollm2" (packaged GGUF), a .gguf file, or a local HF directory
    dtype: str = "float32"  # float32 keeps greedy speculative output identical to plain decoding
    device: str = "auto"  # regenerate/train/export: the GPU where there is one; eval runs on the CPU (CPU timings)


@dataclass
class RegenSection:
    domains: list[str] = field(default_factory=lambda: ["gsm8k", "code", "humaneval"])
    batch_size: int = 32
    max_new_tokens: int = 256
    dtype: str = "bfloat16"  # generation throughput; answers stay the target's own
    limit_per_domain: int | None = None
    samples: int = 0  # extra answers per prompt sampled at `temperature` (besides the greedy one)
    temperature: float = 0.8
    seed: int = 0
    store_features: bool = True  # False: token ids only, train.features must be "target" (GPU)
    time_limit_min: float | None = None  # stop after the batch that crosses this; rerun to continue
    max_batch_tokens: int | None = None  # cap on batch x longest prompt (prefill memory); None = batch_size only

    def __post_init__(self):
        if self.samples < 0 or (self.samples and self.temperature <= 0):
            raise ValueError("regen.samples must be >= 0, and sampled answers need temperature > 0")


@dataclass
class TrainSection(StepSection):
    anchors_per_seq: int = 24  # random anchors in each response
    lr: float = 6e-4
    autocast_bf16: bool = True
    max_steps: int = 3000
    warmup_frac: float = 0.04
    gamma: float = 7.0  # position weight exp(-(k-1)/gamma)
    save_every: int = 200
    log_every: int = 20  # steps between accuracy metrics (an argmax over the vocabulary)
    time_limit_min: float | None = None  # checkpoint and stop after this long (resume later)
    domains: list[str] | None = None  # train only on answers of these domains (None = all regenerated)
    features: str = "stored"  # "stored": read the regenerated features; "target": recompute them each step (GPU)
    vocab: str = "draft"  # LM-head rows trained with drafter.draft_vocab: "draft" (labels outside it masked) or "full"

    def __post_init__(self):
        super().__post_init__()
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.features not in ("stored", "target"):
            raise ValueError(f"train.features must be 'stored' or 'target', got {self.features!r}")
        if self.vocab not in VOCABS:
            raise ValueError(f"train.vocab must be one of {VOCABS}, got {self.vocab!r}")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError(f"warmup_frac must be in [0, 1), got {self.warmup_frac}")


@dataclass
class PretrainConfig:
    run_dir: str = "runs/pretrain"
    drafter_out: str = "models/drafter-smollm2"
    answers_dir: str | None = None  # regenerated answers (default run_dir/answers); share one set between runs
    target: TargetSection = field(default_factory=TargetSection)
    regen: RegenSection = field(default_factory=RegenSection)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    gate: GateSection | None = None  # the gate stage's section (pipelines/gate.py); none: no gate stage
    magpie: MagpieSection | None = None  # the magpie stage's section (pipelines/magpie.py); none: no magpie stage

    def __post_init__(self):
        if not self.regen.store_features and self.train.features == "stored":
            raise ValueError("regen.store_features is false, so train.features must be 'target' (features recomputed)")


# --------------------------------------------------------------------------- data


def answers_path(cfg: "PretrainConfig") -> Path:
    return Path(cfg.answers_dir) if cfg.answers_dir else Path(cfg.run_dir) / "answers"


class AnswerSet:
    """The regenerated shards: token ids in memory, features (if `features`) read lazily from safetensors."""

    def __init__(self, answers_dir: Path, domains: list[str] | None = None, features: bool = True):
        from safetensors import safe_open

        self.rows: list[dict] = []
        self._files = {}
        for f in sorted(answers_dir.glob("answers-*.parquet")):
            feat_path = f.with_name(f.name.replace(".parquet", ".features.safetensors"))
            if features:
                if not feat_path.exists():
                    raise FileNotFoundError(
                        f"{feat_path} is missing: these answers were regenerated without features "
                        "(regen.store_features: false); set train.features: target"
                    )
                self._files[f.name] = safe_open(str(feat_path), framework="pt")
            for r in pq.read_table(f).to_pylist():
                r["shard"] = f.name
                if domains is not None and r["domain"] not in domains:
                    continue
                if len(r["response_ids"]) >= 2:  # need an anchor with at least one label
                    self.rows.append(r)
        if not self.rows:
            raise FileNotFoundError(
                f"no regenerated answers{f' of domains {domains}' if domains else ''} in {answers_dir}: run the 'regenerate' stage first"
            )

    def __len__(self) -> int:
        return len(self.rows)

    def example(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """-> (tokens [L], features [L-1, n*H] or None when not read, prompt length)."""
        r = self.rows[i]
        tokens = torch.tensor(r["prompt_ids"] + r["response_ids"])
        feats = None
        if self._files:
            n = len(tokens) - 1
            feats = self._files[r["shard"]].get_slice("features")[r["feat_offset"] : r["feat_offset"] + n]
        return tokens, feats, len(r["prompt_ids"])


def sample_batch(data: AnswerSet, indices: list[int], anchors_per_seq: int, rng: random.Random) -> dict:
    """Right-padded batch with random anchors in each response (anchor a: block [x_a, MASK...]).
    "feats" is None when the answer set reads no features (the target recomputes them)."""
    ex = [data.example(i) for i in indices]
    t = max(len(tok) for tok, _, _ in ex)
    tokens = torch.zeros(len(ex), t, dtype=torch.long)
    feats = None if ex[0][1] is None else torch.zeros(len(ex), t, ex[0][1].shape[1], dtype=ex[0][1].dtype)
    anchors = torch.full((len(ex), anchors_per_seq), -1, dtype=torch.long)
    lengths = torch.zeros(len(ex), dtype=torch.long)
    for b, (tok, f, p) in enumerate(ex):
        tokens[b, : len(tok)] = tok
        if feats is not None:
            feats[b, : f.shape[0]] = f
        lengths[b] = len(tok)
        choices = list(range(p, len(tok) - 1))  # anchors in the response, each with >= 1 label
        picked = sorted(rng.sample(choices, min(anchors_per_seq, len(choices))))
        anchors[b, : len(picked)] = torch.tensor(picked)
    return {"tokens": tokens, "feats": feats, "anchors": anchors, "lengths": lengths}


@torch.no_grad()
def target_features(target: Target, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Right-padded tokens [B, T] -> the target-layer features [B, T, n*H] that regeneration would have
    stored (one full forward instead of token by token: equal up to rounding)."""
    b, t = tokens.shape
    valid = torch.arange(t, device=tokens.device)[None, :] < lengths[:, None]  # [B, T]
    _, feats = target.model(tokens, target.model.new_cache(b, t), valid=valid, logits_last_only=True)
    return feats


# --------------------------------------------------------------------------- training


def warmup_cosine(tc: TrainSection) -> dict:
    """DeepSpeed's learning-rate schedule for pretraining: linear warmup, cosine down to 5%."""
    return {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": tc.max_steps,
            "warmup_num_steps": max(1, int(tc.warmup_frac * tc.max_steps)),
            "warmup_min_ratio": 0.0,
            "cos_min_ratio": 0.05,
        },
    }


def save_checkpoint(engine, ckpt: Path, step: int, rank: int = 0) -> None:
    """DeepSpeed state (optimizer, scheduler, for resuming; every rank takes part) plus the weights as
    safetensors (for export; written by rank 0)."""
    from safetensors.torch import save_file

    tag = f"step{step}"
    engine.save_checkpoint(str(ckpt), tag=tag)
    if rank != 0:
        return
    state = {k: v.detach().contiguous() for k, v in engine.module.state_dict().items()}
    save_file(state, str(ckpt / tag / "drafter.safetensors"))


def rank_batch(order: list[int], idx: int, per_rank: int, rank: int, world: int) -> list[int]:
    """Sequences of step `idx` for this rank: the step's global batch (per_rank x world consecutive
    entries of the epoch order) split by rank, so every rank trains on different sequences."""
    start = (idx * world + rank) * per_rank
    return order[start : start + per_rank]


def train(cfg: PretrainConfig, target: Target, run_dir: Path) -> dict:
    import deepspeed

    tc = cfg.train
    data = AnswerSet(answers_path(cfg), cfg.train.domains, features=tc.features == "stored")
    dev = target.model.lm_head.weight.device
    init_distributed()
    if cfg.drafter.continues:  # one rank copies (or downloads) the init drafter into the run; the others wait for it
        from_rank0(init_copy(cfg, run_dir) if torch.distributed.get_rank() == 0 else None)
    torch.manual_seed(tc.seed)
    drafter = start_drafter(cfg, target, run_dir)  # a resumed run overwrites its weights with the checkpoint
    config = deepspeed_config(tc, scheduler=warmup_cosine(tc))
    engine, _, _, _ = deepspeed.initialize(model=drafter, model_parameters=drafter.parameters(), config=config)
    ckpt = run_dir / "checkpoints"
    if (ckpt / "latest").exists():
        engine.load_checkpoint(str(ckpt))
    step = engine.global_steps
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    log_path = run_dir / "train_log.jsonl"
    per_epoch = max(1, len(data) // (tc.seqs_per_step * world))
    t0, started = time.perf_counter(), step
    loss = LossSection(kind="ce", gamma=tc.gamma, vocab=tc.vocab)  # DFlash: the text's own next tokens
    bar = tqdm(total=tc.max_steps, initial=step, desc="train", unit="step", disable=rank != 0)
    while step < tc.max_steps:
        epoch, idx = divmod(step, per_epoch)
        order = list(range(len(data)))
        random.Random(tc.seed * 1_000_003 + epoch).shuffle(order)  # same order after a resume, on every rank
        rng = random.Random(tc.seed * 7919 + step + 1_000_033 * rank)
        batch = sample_batch(data, rank_batch(order, idx, tc.seqs_per_step, rank, world), tc.anchors_per_seq, rng)
        batch = {k: v.to(dev, non_blocking=True) for k, v in batch.items() if v is not None}
        if tc.features == "target":
            batch["feats"] = target_features(target, batch["tokens"], batch["lengths"])
        metrics = train_step(engine, batch, loss, autocast=tc.autocast_bf16, metrics=step % tc.log_every == 0)
        step = engine.global_steps
        rec = {"step": step, "epoch": epoch, "loss": round(metrics.pop("loss"), 4), "lr": engine.get_lr()[0], **metrics}
        if rank == 0:  # rank 0's batch stands for the step in the log
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        bar.update(1)
        if metrics:
            bar.set_postfix(loss=f"{rec['loss']:.3f}", acc1=f"{metrics['acc_pos1']:.2f}", acc_len=f"{metrics['acc_len']:.2f}")
        timed_out = from_rank0(tc.time_limit_min is not None and time.perf_counter() - t0 > 60 * tc.time_limit_min)
        if step % tc.save_every == 0 or step == tc.max_steps or timed_out:
            save_checkpoint(engine, ckpt, step, rank)
        if timed_out:
            print(f"[adaflash] time limit reached at step {step}; rerun the same command to resume")
            break
    bar.close()
    from adaflash.pipelines.plots import plot_training

    if rank == 0:
        plot_training(log_path, run_dir / "training.png")
    return {
        "steps": step,
        "steps_this_run": step - started,
        "seconds_this_run": round(time.perf_counter() - t0, 1),
        "sequences": len(data),
        "done": step >= tc.max_steps,
    }


def export(cfg: PretrainConfig, target: Target, run_dir: Path) -> Path:
    """Latest DeepSpeed checkpoint -> drafter directory (bf16 safetensors + config.json)."""
    ckpt = run_dir / "checkpoints"
    if not (ckpt / "latest").exists():
        raise FileNotFoundError(f"no checkpoint in {ckpt}: run the 'train' stage first")
    tag = (ckpt / "latest").read_text().strip()
    from safetensors.torch import load_file

    state = load_file(str(ckpt / tag / "drafter.safetensors"))
    drafter = start_drafter(cfg, target, run_dir)  # the shape and draft vocabulary the weights were trained in
    drafter.load_state_dict(state)
    log = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    extra = {
        "training": {
            "recipe": "dflash-offline",
            "checkpoint": tag,
            "steps": log[-1]["step"] if log else 0,
            "config": to_dict(cfg.train),
            "sequences": len(AnswerSet(answers_path(cfg), cfg.train.domains, features=False)),
            "init": json.loads((run_dir / "init" / START).read_text()) if cfg.drafter.continues else cfg.drafter.init,
        }
    }
    return drafter.save(Path(cfg.drafter_out), extra=extra)


def stage_device(name: str) -> str:
    """The configured device; "auto" on a GPU host is this process's GPU (LOCAL_RANK under a launcher)."""
    if name == "auto" and torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return name


def run_stages(cfg: PretrainConfig, stages: list[str]) -> dict:
    """Run the named stages in pipeline order; each stage resumes where it stopped."""
    from adaflash.pipelines.evaluate import run_eval
    from adaflash.pipelines.prompts import available_domains, build_prompt_sets, read_prompts

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and set(stages) != {"train"}:
        raise ValueError(
            "under a multi-process launcher (WORLD_SIZE > 1) run only `--stage train`; run the other "
            "stages as one process before and after it"
        )
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)  # a run that reuses another's answers_dir starts at `train`
    prompts_dir = run_dir / "prompts"
    timings, summary = {}, {}
    loaded: tuple[str, Target] | None = None  # the last stage's target: the next stage of its dtype reuses it
    for stage in [s for s in STAGES if s in stages]:
        t0 = time.perf_counter()
        print(f"[adaflash] stage {stage}", flush=True)
        if stage == "prompts":
            build_prompt_sets(prompts_dir, available_domains())  # the optional and target-written domains too
        elif stage in ("magpie", "regenerate", "train", "export"):
            # the frozen target weights the drafter shares: bf16 for sampling and autocast training
            bf16 = "bfloat16" if cfg.train.autocast_bf16 else "float32"
            dtype = {"magpie": cfg.regen.dtype, "regenerate": cfg.regen.dtype, "train": bf16}.get(stage, "float32")
            if loaded is None or loaded[0] != dtype:  # magpie, regenerate and train share one load
                loaded = target = None  # the old copy goes before the new one loads
                loaded = (dtype, load_target(cfg.target.source, dtype, device=stage_device(cfg.target.device)))
            target = loaded[1]
            if stage == "magpie":
                if cfg.magpie is None:
                    raise ValueError("the magpie stage needs a `magpie:` section (n: user turns to sample)")
                from adaflash.pipelines.magpie import run_magpie

                summary[stage] = run_magpie(cfg.magpie, target, run_dir / "magpie", prompts_dir)
            elif stage == "regenerate":
                from adaflash.pipelines.regenerate import regenerate

                rc = cfg.regen
                records = read_prompts(prompts_dir / "train.parquet", rc.domains, rc.limit_per_domain)
                summary[stage] = regenerate(
                    target,
                    records,
                    answers_path(cfg),
                    rc.batch_size,
                    rc.max_new_tokens,
                    rc.samples,
                    rc.temperature,
                    rc.store_features,
                    rc.seed,
                    rc.time_limit_min,
                    rc.max_batch_tokens,
                )
            elif stage == "train":
                summary[stage] = train(cfg, target, run_dir)
            else:
                summary[stage] = str(export(cfg, target, run_dir))
        elif stage == "eval":
            report = run_eval(cfg.eval, cfg.drafter_out, prompts_dir, cfg.drafter_out, cfg.target.source, cfg.target.dtype)
            summary[stage] = {
                d: {name: {"tau": round(v["tau"], 2), "speedup": round(v["speedup"], 2)} for name, v in r["variants"].items()}
                for d, r in report["domains"].items()
            }
        elif stage == "gate":
            if cfg.gate is None:
                raise ValueError("the gate stage needs a `gate:` section (gate.current: the drafter to beat and replace)")
            from adaflash.pipelines.gate import run_gate

            result = run_gate(cfg.gate, cfg.eval, cfg.drafter_out, prompts_dir, run_dir, cfg.target.source, cfg.target.dtype)
            summary[stage] = {"replaced": result["installed"], "decision": result["decision"], "table": str(run_dir / "gate.md")}
        timings[stage] = round(time.perf_counter() - t0, 1)
    if int(os.environ.get("RANK", "0")) != 0:
        return {"seconds": timings, **summary}
    with open(run_dir / "stages.jsonl", "a") as f:
        f.write(json.dumps({"stages": timings, "summary": summary, "time": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    return {"seconds": timings, **summary}
