"""Typed configuration of the online trainer (`adaflash train --config configs/online_*.yaml`).

One dataclass per concern; `adaflash.config.load_config(path, OnlineConfig)` loads the YAML and
each `__post_init__` rejects bad values with a message saying what to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from adaflash.recipe import LossSection, StepSection


@dataclass
class TargetSection:
    source: str = "smollm2"  # "smollm2" (packaged GGUF), a .gguf file, or a local HF directory
    dtype: str = "float32"  # the frozen teacher; float32 matches what greedy serving verifies with


@dataclass
class DrafterSection:
    init_dir: str = "models/drafter-smollm2"  # start here when the registry has no champion yet
    from_registry: bool = True  # start from the registry's champion when there is one
    follow_champion: bool = True  # a champion moved outside the trainer (UI rollback) is what the next round trains
    save_dtype: str = "bfloat16"  # dtype of the weights registered each round (float32 for exact copies)

    def __post_init__(self):
        if self.save_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"save_dtype must be 'bfloat16' or 'float32', got {self.save_dtype!r}")


@dataclass
class BufferSection:
    dir: str = "runs/buffer"  # the trajectory buffer serving nodes write (adaflash.buffer.ShardWriter)
    min_new_rounds: int = 512  # verification rounds needed to form one update round
    first_min_new_rounds: int | None = None  # round 1 needs only this many; doubling each round up to min_new_rounds
    heldout_frac: float = 0.1  # trajectories held out for the gate (by request_id hash, never trained on)
    poll_interval_s: float = 5.0  # seconds between buffer polls while waiting for data

    def __post_init__(self):
        if self.min_new_rounds < 1:
            raise ValueError(f"min_new_rounds must be >= 1, got {self.min_new_rounds}")
        if self.first_min_new_rounds is not None and not 1 <= self.first_min_new_rounds <= self.min_new_rounds:
            raise ValueError(
                f"first_min_new_rounds must be in [1, min_new_rounds={self.min_new_rounds}] or null, got {self.first_min_new_rounds}"
            )
        if not 0.0 <= self.heldout_frac < 1.0:
            raise ValueError(f"heldout_frac must be in [0, 1), got {self.heldout_frac}")
        if self.poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {self.poll_interval_s}")


RETENTION_POLICIES = ("keep", "delete", "compact")


@dataclass
class RetentionSection:
    """What happens to buffer shards once a round has trained on them and the ledger committed them. The round
    memory keeps its own copy of the trajectories it replays (trainer/memory.py), so nothing the trainer
    reads needs a consumed shard; these keep some for inspection or `adaflash experiment replay`."""

    policy: str = "keep"  # "keep": consumed shards stay forever; "delete": removed; "compact": concatenated into
    #                       an archive in <buffer>/_compacted/ each time (fewer files; the rows are kept)
    keep_rounds: int = 0  # the newest N rounds' shards stay in the buffer (0 = removed as soon as committed)
    max_bytes: int | None = None  # and consumed shards left in the buffer stay under this size (oldest go first)

    def __post_init__(self):
        if self.policy not in RETENTION_POLICIES:
            raise ValueError(f"policy must be one of {RETENTION_POLICIES}, got {self.policy!r}")
        if self.keep_rounds < 0:
            raise ValueError(f"keep_rounds must be >= 0 (0 = remove a round's shards once committed), got {self.keep_rounds}")
        if self.max_bytes is not None and self.max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or null (no cap), got {self.max_bytes}")
        if self.policy == "keep" and (self.keep_rounds or self.max_bytes is not None):
            raise ValueError(
                "keep_rounds and max_bytes limit what policy 'delete' or 'compact' removes; "
                "with policy 'keep' nothing is removed: set the policy or drop them"
            )


@dataclass
class OnlineLossSection(LossSection):
    """The online trainer distils (opd, osd) or trains the length head alone (head); no pretraining ce."""

    KINDS = ("opd", "osd", "head")


@dataclass
class TrainSection(StepSection):
    """The online recipe's keys; seqs_per_step counts trajectories, anchors_per_seq their recorded (on-policy)
    blocks sampled per step; lr is the drafter's (fine-tuning a pretrained drafter); grad_clip applies per
    group (drafter, head) with ZeRO 0, to the global norm under ZeRO > 0."""

    steps_per_update: int = 50  # optimizer steps per update round
    first_steps: int | None = None  # round 1 takes only this many steps; doubling each round up to steps_per_update
    head_lr: float = 2e-4  # length-head learning rate (its own parameter group)
    eval_seqs: int = 8  # trajectories per forward when computing supervision and held-out tau
    replay_rounds: int = 0  # also train on the training trajectories of this many previous rounds
    head_refit_epochs: int = 0  # after the steps, refit the length head on the final drafter (drafter frozen); 0 = off

    def __post_init__(self):
        super().__post_init__()
        for name in ("steps_per_update", "eval_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.first_steps is not None and not 1 <= self.first_steps <= self.steps_per_update:
            raise ValueError(f"first_steps must be in [1, steps_per_update={self.steps_per_update}] or null, got {self.first_steps}")
        if self.head_refit_epochs < 0:
            raise ValueError(f"head_refit_epochs must be >= 0 (0 = off), got {self.head_refit_epochs}")
        if self.replay_rounds < 0:
            raise ValueError(f"replay_rounds must be >= 0 (0 = the new round only), got {self.replay_rounds}")
        if self.head_lr <= 0:
            raise ValueError(f"head_lr must be > 0, got {self.head_lr}")


@dataclass
class DeepSpeedSection:
    zero_stage: int = 0  # 0 on one process; 1-2 shard optimizer state (and gradients) across ranks
    extra: dict = field(default_factory=dict)  # merged into the generated DeepSpeed config as is

    def __post_init__(self):
        if self.zero_stage not in (0, 1, 2):
            raise ValueError(
                f"zero_stage must be 0, 1 or 2, got {self.zero_stage} (stage 3 partitions the weights "
                "themselves, which a drafter of this size does not need and the round export does not gather)"
            )


@dataclass
class CheckpointSection:
    dir: str = "runs/online/checkpoints"  # DeepSpeed checkpoints + state.json + exported round drafters
    keep: int = 2  # DeepSpeed checkpoint tags kept besides the live one

    def __post_init__(self):
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1, got {self.keep}")


@dataclass
class MlflowSection:
    tracking_uri: str = "http://127.0.0.1:5000"
    experiment: str = "adaflash-online"  # one MLflow run per update round lands here
    model_name: str = "adaflash-drafter"  # registered model: every round's drafter is a version


@dataclass
class GateSection:
    tolerance: float = 0.0  # promote when held-out tau after >= tau before - tolerance
    min_heldout_blocks: int = 16  # fewer full held-out blocks than this: no verdict, the version is rejected
    on_reject: str = "rollback"  # "rollback": next round starts from the pre-round weights; "continue": keep them
    heldout_rounds: int = 0  # also judge on the held-out trajectories of this many previous rounds

    def __post_init__(self):
        if self.heldout_rounds < 0:
            raise ValueError(f"heldout_rounds must be >= 0 (0 = the new round's held-out only), got {self.heldout_rounds}")
        if self.on_reject not in ("rollback", "continue"):
            raise ValueError(f"on_reject must be 'rollback' or 'continue', got {self.on_reject!r}")
        if self.min_heldout_blocks < 1:
            raise ValueError(f"min_heldout_blocks must be >= 1, got {self.min_heldout_blocks}")


@dataclass
class OnlineConfig:
    target: TargetSection = field(default_factory=TargetSection)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    buffer: BufferSection = field(default_factory=BufferSection)
    loss: OnlineLossSection = field(default_factory=OnlineLossSection)
    train: TrainSection = field(default_factory=TrainSection)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    mlflow: MlflowSection = field(default_factory=MlflowSection)
    gate: GateSection = field(default_factory=GateSection)
    retention: RetentionSection = field(default_factory=RetentionSection)
    max_rounds: int = 0  # update rounds to run before exiting; 0 = forever

    def round_size(self, r: int) -> tuple[int, int]:
        """(verification rounds to wait for, optimizer steps) of update round r (1-based): the first rounds
        are small so that a newly started loop registers a version within minutes; each round doubles them
        up to buffer.min_new_rounds / train.steps_per_update."""

        def ramp(first: int | None, full: int) -> int:
            return full if first is None else min(full, first * 2 ** min(max(r - 1, 0), 30))

        return ramp(self.buffer.first_min_new_rounds, self.buffer.min_new_rounds), ramp(self.train.first_steps, self.train.steps_per_update)

    def __post_init__(self):
        if self.max_rounds < 0:
            raise ValueError(f"max_rounds must be >= 0 (0 = forever), got {self.max_rounds}")
        if self.train.head_refit_epochs and self.deepspeed.zero_stage:
            raise ValueError(
                "train.head_refit_epochs needs deepspeed.zero_stage 0: ZeRO keeps its own master copy of "
                "the head, which a refit outside the optimizer does not update; set one of them to 0"
            )
