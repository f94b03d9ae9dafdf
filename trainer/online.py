"""Online trainer: tails the trajectory buffer, distils the frozen target into the drafter (OPD or the
OSD baseline) plus the length head through DeepSpeed, gates each update on held-out tau and publishes
every round's drafter to the MLflow model registry.

One update round (`update_round`; the method doing each step in brackets):
  1. wait until >= `buffer.min_new_rounds` verification rounds sit in uncommitted shards; take the
     oldest shards up to that count (same rule after a restart, so a retried round sees the same data) [_take_round]
  2. select: split trajectories train / held-out by request_id hash, add the previous rounds' ones kept in
     the round memory (`train.replay_rounds`, `gate.heldout_rounds`) [_select]
  3. train: one target forward per trajectory; held-out tau before; `steps_per_update` DeepSpeed steps on
     the recorded anchors (adaflash.recipe.train_step); held-out tau after (loss.kind "head": the drafter is
     frozen and only the length head trains on the acceptance labels) [_train]
  4. gate: promote when tau after >= tau before - tolerance (and enough held-out blocks) [_gate]
  5. persist: export drafter + head, DeepSpeed checkpoint (kept weights only), the round's trajectories
     into the round memory, state.json with the round's shards and what is left to publish, THEN
     `reader.commit(shards, tag=round)` [_persist]
  6. publish: register the version, move the champion alias or tag it rejected, close the MLflow run [_publish]
  7. retention (`retention`): delete or compact the consumed shards of rounds it no longer keeps [_retain]

Exactly-once: weights that include a shard become durable (checkpoint + state.json) before the ledger
records the shard, and a restart resumes from exactly those weights. A kill before step 5 leaves the
shards uncommitted and the checkpoint without them: they are retrained once. A kill between state.json
and the ledger commit is completed on restart from state.json (no retraining); a kill during publish is
finished on restart, looking the version up by its MLflow run first so it is registered once.
Retention touches committed shards only (the round memory holds its own copy of what it replays), and
records a removal in the ledger before the file goes: a kill part-way is finished at the next start.

Before each round the trainer follows the registry: if `champion` was moved by someone else (a rollback
in the MLflow UI), it loads that version and trains from it (`drafter.follow_champion`).

Files in `checkpoint.dir`: init/ (starting drafter + head), round{N}/ and champion-v{N}/ (DeepSpeed tags), state.json,
memory/round{N}.parquet (trajectories kept for replay and the gate, trainer/memory.py),
rounds.jsonl (one line per finished round: shards, version, gate), steps.jsonl (one line per step).
Multi-process under the deepspeed launcher: rank 0 owns the ledger, state, MLflow and the registry and
broadcasts each round's shard names; every rank trains its own slice of each step's sequences.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from adaflash.trainer.config import OnlineConfig
from adaflash.trainer.data import (
    Sequence,
    capture_output,
    eval_items,
    heldout_tau,
    is_heldout,
    make_batch,
    supervise,
    to_sequences,
    train_items,
)
from adaflash.trainer.memory import RoundMemory
from torch import Tensor, nn

from adaflash.buffer import TRAJECTORY_SCHEMA, ShardReader, from_arrow
from adaflash.buffer.files import write_text_atomic
from adaflash.config import to_dict
from adaflash.distributed import from_rank0, init_distributed
from adaflash.drafter import Drafter, load_drafter, load_drafter_and_head
from adaflash.length_head import LengthHead, LengthHeadConfig, fit_length_head, load_length_head, save_length_head
from adaflash.recipe import clip_per_group, deepspeed_config, train_step, train_vocab, vocab_head
from adaflash.spec import accepted_length
from adaflash.target import load_target


@dataclass
class RoundData:
    """What one update round trains and judges on (`OnlineTrainer._select`)."""

    round: int
    shards: list[str]
    tables: list  # the shards' Arrow tables (into the round memory once the round is durable)
    train: list[Sequence]  # the round's training trajectories + the replayed ones of earlier rounds
    held: list[Sequence]  # the held-out ones the gate judges on (this round's + kept ones)
    info: dict  # rows, train / held-out counts (new ones apart), verification rounds
    window: dict  # shards, time range and drafter versions of the data


class OnlineModel(nn.Module):
    """What the DeepSpeed engine trains: the drafter and its length head (two parameter groups)."""

    def __init__(self, drafter: Drafter, head: LengthHead, vocab_mode: str = "draft"):
        super().__init__()
        self.drafter, self.head, self.vocab_mode = drafter, head, vocab_mode

    @property
    def vocab(self) -> Tensor | None:
        """The full-vocabulary ids [Vd] of forward's logit columns (loss.vocab, `recipe.train_vocab`), None = all V."""
        return train_vocab(self.drafter, self.vocab_mode)

    def blocks(self, batch: dict) -> tuple[Tensor, Tensor]:
        """-> (draft states [B, NB, K-1, H], final-norm states of all K block positions [B*NB, K, H],
        incl. the anchor: what the length head reads when serving)."""
        b, nb = batch["anchors"].shape
        with capture_output(self.drafter.norm) as seen:
            h = self.drafter(batch["feats"], batch["tokens"], batch["anchors"], batch["lengths"])
        return h, seen[-1].view(b * nb, self.drafter.block_size, -1)

    def forward(self, batch: dict) -> tuple[Tensor, Tensor]:
        """-> (draft logits [B, NB, K-1, V] or [B, NB, K-1, Vd] over `vocab`, head prediction [B, NB]).
        The head's input is detached: its loss never reaches the drafter."""
        h, block = self.blocks(batch)
        return vocab_head(self.drafter, self.vocab)(h), self.head(block.float()).view(batch["anchors"].shape)


@torch.no_grad()
def refit_head(model: OnlineModel, seqs, k_blk: int, t, seed: int) -> dict | None:
    """Refit the length head on the drafter it ships with (`train.head_refit_epochs` of
    `length_head.fit_length_head`): during the steps the head chased a drafter that kept changing;
    here it fits the final drafter's block states at every full recorded block of `seqs`, labelled
    with that drafter's own acceptance (drafter frozen). -> the fit's held-out metrics, or None.
    Deterministic in `seed`: every rank computes the same blocks and fit, so the heads stay identical."""
    if not t.head_refit_epochs or not seqs:
        return None
    states, accepted = [], []
    model.eval()
    items = eval_items(seqs, k_blk, t.anchors_per_seq)
    for i in range(0, len(items), t.eval_seqs):
        batch = make_batch(items[i : i + t.eval_seqs], k_blk)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=t.autocast_bf16):
            h, block = model.blocks(batch)  # [B, NB, K-1, H], [B*NB, K, H]
            draft = model.drafter.draft_ids(h)  # [B, NB, K-1], as served (from the draft vocabulary)
        full = batch["full"].flatten()  # [B*NB]
        states.append(block.float()[full])
        accepted.append(accepted_length(draft, batch["tgt_next"]).flatten()[full])
    if sum(len(a) for a in accepted) < 2:
        return None
    with torch.enable_grad():
        return fit_length_head(
            model.head, torch.cat(states), torch.cat(accepted), k_blk, lr=t.head_lr, epochs=t.head_refit_epochs, seed=seed
        )


def ds_config(cfg: OnlineConfig) -> dict:
    """The online trainer's DeepSpeed config. ZeRO 0: clipped per parameter group by the trainer
    (`clip_per_group`); ZeRO > 0: DeepSpeed's global norm."""
    zero = cfg.deepspeed.zero_stage
    return deepspeed_config(cfg.train, zero, clip=bool(zero), extra=cfg.deepspeed.extra)


def gate(before: dict, after: dict, tolerance: float, min_blocks: int) -> tuple[bool, str]:
    """Promotion decision from held-out tau before/after the update -> (promote, reason)."""
    if after["blocks"] < min_blocks:
        return False, f"only {after['blocks']} full held-out blocks (< gate.min_heldout_blocks={min_blocks})"
    need = before["tau"] - tolerance
    if after["tau"] >= need:
        return True, f"held-out tau {before['tau']:.3f} -> {after['tau']:.3f} >= {need:.3f} (tau before - gate.tolerance)"
    return False, f"held-out tau {before['tau']:.3f} -> {after['tau']:.3f} < {need:.3f} (tau before - gate.tolerance)"


def retired_shards(consumed: list[tuple[str, object, int]], r: int, keep_rounds: int, max_bytes: int | None) -> list[str]:
    """Consumed shards retention removes after round r: (name, round tag, bytes), oldest first -> names.
    A shard of round j goes once j <= r - keep_rounds (untagged ones at once); then the oldest of the
    rest go while the consumed shards left exceed max_bytes."""
    old = [n for n, tag, _ in consumed if not isinstance(tag, int) or tag <= r - keep_rounds]
    rest = [(n, size) for n, tag, size in consumed if n not in old]
    left = sum(size for _, size in rest)
    for n, size in rest:
        if max_bytes is None or left <= max_bytes:
            break
        old.append(n)
        left -= size
    return old


def _metric_key(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_./ -]", "_", name)


class OnlineTrainer:
    def __init__(self, cfg: OnlineConfig, log=print):
        import deepspeed
        import torch.distributed as dist

        self.cfg, self.log = cfg, log
        self.ckpt = Path(cfg.checkpoint.dir)
        self.state_path = self.ckpt / "state.json"
        self.memory = RoundMemory(self.ckpt / "memory")
        self.memory_rounds = max(cfg.train.replay_rounds, cfg.gate.heldout_rounds)  # rounds the memory keeps
        init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.target = load_target(cfg.target.source, cfg.target.dtype)
        self.registry = self.client = self.reader = None
        if self.rank == 0:
            from mlflow.tracking import MlflowClient

            from adaflash.registry import Registry

            self.client = MlflowClient(cfg.mlflow.tracking_uri)
            self.registry = Registry(cfg.mlflow.tracking_uri, cfg.mlflow.model_name)
            self.ckpt.mkdir(parents=True, exist_ok=True)
            if not self.state_path.exists():
                self._prepare_start()
        self._barrier()
        fresh = not self.state_path.exists()
        drafter = load_drafter(self.ckpt / "init", self.target.model, self.target.identity, torch.float32)
        head = load_length_head(self.ckpt / "init", drafter.config.hidden_size)
        if head.config.block_size != drafter.block_size:
            raise ValueError(
                f"the length head in {self.ckpt / 'init'} reads blocks of {head.config.block_size} positions "
                f"(fit-head --draft-len) but the online trainer trains heads on the drafter's whole "
                f"{drafter.block_size}-blocks: start from a whole-block head (adaflash fit-head without --draft-len)"
            )
        frozen = cfg.loss.kind == "head"  # only the length head learns; the drafter is served as it is
        model = OnlineModel(drafter.requires_grad_(not frozen), head.requires_grad_(True), cfg.loss.vocab)
        groups = [] if frozen else [{"params": list(drafter.parameters()), "lr": cfg.train.lr}]
        groups.append({"params": list(head.parameters()), "lr": cfg.train.head_lr, "weight_decay": 0.0})
        self.groups = ["head"] if frozen else ["drafter", "head"]  # names of the optimizer's parameter groups
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config(cfg))
        self.k_blk = drafter.block_size
        if fresh:  # round 0 = the starting weights, so every round has a checkpoint to resume or roll back to
            self.engine.save_checkpoint(str(self.ckpt), tag="round0")
            if self.rank == 0:
                start = json.loads((self.ckpt / "init" / "start.json").read_text())
                self.state = {**start, "round": 0, "weights_tag": "round0", "pending": None, "inflight_run": None}
                self._save_state()
        self._barrier()
        self.state = json.loads(self.state_path.read_text())
        if not fresh:
            self._load_weights(self.state["weights_tag"])
        if self.rank == 0:
            self.reader = ShardReader(cfg.buffer.dir)
            self._recover()
            self._retain()
        self._waiting: list = []  # polled shards not yet in a round (rank 0)
        self._refused: set[str] = set()  # champions moved in from outside that do not fit
        self._reported = -1  # verification rounds waiting at the last "waiting for data" line

    # ------------------------------------------------------------------ start / recovery

    def _prepare_start(self) -> None:
        """First start: the champion from the registry (or drafter.init_dir) becomes init/ (fp32, with a head)."""
        cfg, version, src = self.cfg, None, Path(self.cfg.drafter.init_dir)
        if cfg.drafter.from_registry:
            version = self.registry.champion()
            if version is not None:
                src = Path(self.registry.download(version, self.ckpt / "download"))
        drafter, head = load_drafter_and_head(src, self.target, torch.float32)
        if head is None:
            torch.manual_seed(cfg.train.seed)
            head = LengthHead(LengthHeadConfig(hidden_size=drafter.config.hidden_size, block_size=drafter.block_size))
        init = self.ckpt / "init"
        drafter.save(init, dtype=torch.float32, extra={"online": {"started_from": version or str(src)}})
        save_length_head(head, init)
        (init / "start.json").write_text(json.dumps({"base_version": version, "champion": version, "start": version or str(src)}))
        self.log(f"[train] starting from {'registry champion v' + version if version else src}")

    def _recover(self) -> None:
        """Finish what a killed trainer left: ledger commit + publish of a durable round, or mark its
        unfinished MLflow run killed (that round's shards are still uncommitted and get retrained)."""
        pending = self.state["pending"]
        if pending is not None:
            self.log(f"[train] recovering round {pending['round']}: committing its shards and publishing")
            self.reader.commit(pending["shards"], tag=pending["round"])
            self._publish()
        elif self.state["inflight_run"]:
            self._kill_inflight("trainer killed mid-round; the round is retrained in a new run")

    def _kill_inflight(self, note: str) -> None:
        """Mark the MLflow run of the round in training KILLED (its shards stay uncommitted: retrained later)."""
        run = self.state["inflight_run"]
        self.client.set_tag(run, "note", note)
        self.client.set_terminated(run, "KILLED")
        self.state["inflight_run"] = None
        self._save_state()

    def _retain(self) -> None:
        """Apply `retention` to the consumed shards of the rounds up to the last committed one (rank 0)."""
        rc = self.cfg.retention
        if rc.policy == "keep":
            return
        names = retired_shards(self.reader.consumed_present(), self.state["round"], rc.keep_rounds, rc.max_bytes)
        if names:
            out = self.reader.retain(rc.policy, names)
            self.log(
                f"[train] retention: {rc.policy} {len(out['removed'])} consumed shard(s)"
                + (f" into {out['archive']}" if out["archive"] else "")
            )

    def _load_weights(self, tag: str) -> None:
        path, _ = self.engine.load_checkpoint(str(self.ckpt), tag=tag)
        if path is None:
            raise FileNotFoundError(
                f"DeepSpeed checkpoint {self.ckpt / tag} named in {self.state_path} is missing: "
                f"restore it, or move {self.ckpt} away to start over from the registry's champion"
            )

    def _save_state(self) -> None:
        """state.json, written atomically (rank 0)."""
        write_text_atomic(self.state_path, json.dumps(self.state, indent=1, sort_keys=True))

    def _barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    # ------------------------------------------------------------------ loop

    def run(self, max_rounds: int | None = None) -> int:
        """Update rounds until `max_rounds` (config's when None; 0 = forever). -> rounds done."""
        max_rounds = self.cfg.max_rounds if max_rounds is None else max_rounds
        done = 0
        try:
            while max_rounds == 0 or done < max_rounds:
                names = from_rank0(self._take_round() if self.rank == 0 else None)
                if names is None:
                    time.sleep(self.cfg.buffer.poll_interval_s)
                    continue
                self._follow_champion()
                self.update_round(names)
                done += 1
        except KeyboardInterrupt:  # Ctrl-C, or `adaflash up` stopping: the round in training ends KILLED in MLflow
            if self.rank == 0 and self.state["inflight_run"] and self.state["pending"] is None:  # now, not at the next start
                try:
                    self._kill_inflight("trainer stopped mid-round; the round is retrained at the next start")
                except Exception as e:  # MLflow gone first: the next start marks it (`_recover`)
                    self.log(f"[train] could not mark the round's MLflow run killed ({type(e).__name__}); the next start will")
            raise
        return done

    def _follow_champion(self) -> None:
        """When `champion` moved outside this trainer (a rollback or promotion in the MLflow UI), the next
        round trains from that version, so new versions descend from what serving runs. Optimizer
        moments carry over; a version that does not fit the target is logged and ignored."""
        moved = None
        if self.rank == 0 and self.cfg.drafter.follow_champion:
            version = self.registry.champion()
            if version is not None and version != self.state["champion"] and version not in self._refused:
                moved = (version, str(self.registry.download(version, self.ckpt / "download")))
        moved = from_rank0(moved)
        if moved is None:
            return
        version, path = moved
        try:
            drafter, head = load_drafter_and_head(path, self.target, torch.float32)
        except (ValueError, OSError) as e:
            self._refused.add(version)
            self.log(
                f"[train] champion v{version} was moved outside the trainer but does not fit ({e}); keeping v{self.state['base_version']}"
            )
            return
        self.engine.module.drafter.load_state_dict(drafter.state_dict())  # in place: the optimizer keeps its params
        if head is not None:
            self.engine.module.head.load_state_dict(head.state_dict())
        tag = f"champion-v{version}"
        self.engine.save_checkpoint(str(self.ckpt), tag=tag)
        self._barrier()
        if self.rank == 0:
            self.log(f"[train] champion moved to v{version} outside the trainer (was v{self.state['champion']}): training from it")
            self.state.update(champion=version, base_version=version, weights_tag=tag)
            self._save_state()
            shutil.rmtree(path, ignore_errors=True)
            self._cleanup()
        self.state = from_rank0(self.state)

    def _take_round(self) -> list[str] | None:
        """The oldest polled shards holding >= min_new_rounds verification rounds, or None (keep waiting)."""
        self._waiting += self.reader.poll()
        self._waiting.sort(key=lambda b: (pc.min(b.table["created_ns"]).as_py(), b.name))
        need, have = self.cfg.round_size(self.state["round"] + 1)[0], 0
        for i, b in enumerate(self._waiting):
            have += pc.sum(pc.list_value_length(b.table["rounds"])).as_py() or 0
            if have >= need:
                take, self._waiting = self._waiting[: i + 1], self._waiting[i + 1 :]
                self._tables = {b.name: b.table for b in take}
                return [b.name for b in take]
        if have != self._reported:
            self.log(f"[train] waiting for data: {have}/{need} verification rounds in {len(self._waiting)} shard(s)")
            self._reported = have
        return None

    def _read(self, names: list[str]):
        if self.rank == 0:
            return [self._tables[n] for n in names]
        return [pq.read_table(Path(self.cfg.buffer.dir) / n, schema=TRAJECTORY_SCHEMA) for n in names]

    # ------------------------------------------------------------------ one update round

    def update_round(self, names: list[str]) -> dict:
        """One update round on the shards `names`, the steps of the module docstring in order. -> its summary."""
        t0 = time.perf_counter()
        data = self._select(names)
        run_id = self._begin_run(data.info, data.window) if self.rank == 0 else None
        measured = self._train(data, run_id)
        summary = self._gate(data, measured, time.perf_counter() - t0)
        if self.rank == 0:
            self._log_eval(run_id, data, measured)
        self._persist(data, run_id, summary)
        if self.rank == 0:
            self._publish()
            self._cleanup()
            self.memory.prune(data.round, self.memory_rounds)
            self._retain()
        self._barrier()
        return summary

    def _select(self, names: list[str]) -> RoundData:
        """Step 2: the shards' trajectories split train / held-out by request id, plus the earlier rounds'
        ones the round memory keeps for replay (`train.replay_rounds`) and for the gate (`gate.heldout_rounds`)."""
        cfg, r = self.cfg, self.state["round"] + 1
        tables = self._read(names)
        trajs = [t for tab in tables for t in from_arrow(tab)]
        frac = cfg.buffer.heldout_frac
        seqs = to_sequences(trajs)
        held = [s for s in seqs if is_heldout(s.request_id, frac)]
        train = [s for s in seqs if not is_heldout(s.request_id, frac)]
        new_train, new_held = len(train), len(held)
        for j, past in self.memory.load(r, self.memory_rounds).items():  # read once for both windows
            for s in to_sequences(past):
                h = is_heldout(s.request_id, frac)
                if j >= r - (cfg.gate.heldout_rounds if h else cfg.train.replay_rounds):
                    (held if h else train).append(s)
        created = [t.created_ns for t in trajs]
        window = {
            "shards": names,
            "t_min_ns": min(created),
            "t_max_ns": max(created),
            "drafter_versions": sorted({t.drafter_version for t in trajs}),
        }
        info = {
            "round": r,
            "rows": len(trajs),
            "train": len(train),
            "heldout": len(held),
            "train_new": new_train,
            "heldout_new": new_held,
            "verify_rounds": sum(len(t.rounds) for t in trajs),
        }
        return RoundData(r, names, tables, train, held, info, window)

    def _train(self, data: RoundData, run_id: str | None) -> dict:
        """Step 3: the teacher once, held-out tau before, the optimizer steps, the head refit, held-out tau
        after. -> {before, after, steps, refit}."""
        t, r = self.cfg.train, data.round
        supervise(self.target.model, data.train + data.held, t.eval_seqs, torch.bfloat16 if t.autocast_bf16 else None)
        before = self._eval(data.held)
        steps = [self._step(data.train, r, i, run_id) for i in range(self.cfg.round_size(r)[1])] if data.train else []
        refit = refit_head(self.engine.module, data.train, self.k_blk, t, seed=t.seed + r)
        after = self._eval(data.held)
        return {"before": before, "after": after, "steps": steps, "refit": refit}

    def _gate(self, data: RoundData, measured: dict, seconds: float) -> dict:
        """Step 4: promote or not, and whether the next round keeps these weights. -> the round's summary."""
        g = self.cfg.gate
        before, after, steps = measured["before"], measured["after"], measured["steps"]
        promote, reason = gate(before, after, g.tolerance, g.min_heldout_blocks)
        if not data.train:
            promote, reason = False, "no trainable trajectories in the round"
        return {
            **data.info,
            "seconds": round(seconds, 1),
            "tau_before": before["tau"],
            "tau_after": after["tau"],
            "loss_first": steps[0]["loss"] if steps else None,
            "loss_last": steps[-1]["loss"] if steps else None,
            "head_mae_before": before["head_mae"],
            "head_mae_after": after["head_mae"],
            "head_refit": measured["refit"],
            "promote": promote,
            "reason": reason,
            "kept": promote or g.on_reject == "continue",
        }

    def _persist(self, data: RoundData, run_id: str | None, summary: dict) -> None:
        """Step 5, the exactly-once point: the export, the weights the next round starts from (this round's
        checkpoint, or the pre-round one back), the round memory and state.json with what is left to publish,
        then the ledger commit of the round's shards."""
        r, names = data.round, data.shards
        export = self.ckpt / "exports" / f"round{r}"
        if self.rank == 0:
            self._export(export, r, summary)
        tag = f"round{r}"
        if summary["kept"]:
            self.engine.save_checkpoint(str(self.ckpt), tag=tag)
        else:  # roll back to the pre-round weights (and optimizer state)
            tag = self.state["weights_tag"]
            self._load_weights(tag)
        self._barrier()
        self.state.update(
            round=r,
            weights_tag=tag,
            inflight_run=None,
            pending={
                "round": r,
                "shards": names,
                "run_id": run_id,
                "export": str(export),
                "summary": summary,
                "tags": {
                    "round": str(r),
                    "parent_version": str(self.state["base_version"]),
                    "loss": self.cfg.loss.kind,
                    "data_window": f"{names[0]}..{names[-1]} ({len(names)} shards)",
                    "tau_before": f"{summary['tau_before']:.4f}",
                    "tau_after": f"{summary['tau_after']:.4f}",
                },
            },
        )
        if self.rank == 0:
            self.memory.save(r, data.tables)  # before state.json: a restart never reads a later round's file
            self._save_state()  # durable: these weights include these shards
            self.reader.commit(names, tag=r)

    def _step(self, seqs, r: int, i: int, run_id: str | None) -> dict:
        """One DeepSpeed optimizer step on this rank's slice of the step's sequences."""
        t = self.cfg.train
        batch = make_batch(train_items(seqs, i, self.rank, self.world, t.seqs_per_step, t.anchors_per_seq, t.seed, r), self.k_blk)
        clip = None
        if not self.cfg.deepspeed.zero_stage and t.grad_clip > 0:
            clip = lambda e: {f"grad_norm_{name}": n for name, n in zip(self.groups, clip_per_group(e, t.grad_clip))}  # noqa: E731
        metrics = train_step(
            self.engine,
            batch,
            self.cfg.loss,
            forward=self.engine,
            teacher=self.target.model,
            autocast=t.autocast_bf16,
            clip=clip,
            vocab=self.engine.module.vocab,
        )
        if self.rank == 0:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            try:  # best effort: a blip of the tracking server must not cost the round (steps.jsonl has them)
                self.client.log_batch(run_id, metrics=[Metric(k, v, now, i) for k, v in metrics.items()])
            except Exception as e:
                self.log(f"[train] warning: step {i + 1} metrics not logged to MLflow ({type(e).__name__}: {e})")
            with open(self.ckpt / "steps.jsonl", "a") as f:
                rec = {"round": r, "step": i + 1, "run_id": run_id, **{k: round(v, 5) for k, v in metrics.items()}}
                f.write(json.dumps(rec) + "\n")
        return metrics

    def _eval(self, seqs) -> dict:
        self.engine.eval()
        t = self.cfg.train

        def forward(batch):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=t.autocast_bf16):
                return self.engine(batch)

        return heldout_tau(forward, seqs, self.k_blk, t.anchors_per_seq, t.eval_seqs, self.engine.module.vocab)

    # ------------------------------------------------------------------ MLflow, export, publish (rank 0)

    def _begin_run(self, info: dict, window: dict) -> str:
        cfg = self.cfg
        exp = self.client.get_experiment_by_name(cfg.mlflow.experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.mlflow.experiment)
        run = self.client.create_run(
            exp_id, run_name=f"round-{info['round']}", tags={"adaflash.round": str(info["round"]), "adaflash.loss": cfg.loss.kind}
        )
        rid = run.info.run_id
        self.state["inflight_run"] = rid
        self._save_state()
        from mlflow.entities import Param

        params = {
            **{f"loss.{k}": v for k, v in to_dict(cfg.loss).items()},
            **{f"train.{k}": v for k, v in to_dict(cfg.train).items()},
            "deepspeed.zero_stage": cfg.deepspeed.zero_stage,
            "world_size": self.world,
            "min_new_rounds": cfg.round_size(info["round"])[0],
            "steps": cfg.round_size(info["round"])[1],
            "heldout_frac": cfg.buffer.heldout_frac,
            "parent_version": self.state["base_version"],
            **info,
            "data_window": f"{window['shards'][0]}..{window['shards'][-1]} ({len(window['shards'])} shards)",
            "data_time_range": f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(window['t_min_ns'] / 1e9))}.."
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(window['t_max_ns'] / 1e9))}",
        }
        self.client.log_batch(rid, params=[Param(k, str(v)) for k, v in params.items()])
        self.client.log_dict(rid, window, "data_window.json")
        return rid

    def _log_eval(self, run_id: str, data: RoundData, measured: dict) -> None:
        """The round's held-out measurements as metrics of its MLflow run."""
        from mlflow.entities import Metric

        before, after, steps, train, refit = measured["before"], measured["after"], measured["steps"], data.train, measured["refit"]
        now, vals = int(time.time() * 1000), {}
        for when, ev in (("before", before), ("after", after)):
            vals[f"heldout_tau_{when}"] = ev["tau"]
            vals[f"head_mae_{when}"] = ev["head_mae"]
            for d, v in ev["domains"].items():
                vals[_metric_key(f"heldout_tau_{when}/{d}")] = v["tau"]
        vals["heldout_blocks"] = after["blocks"]
        vals["tokens_trained"] = sum(s["positions"] for s in steps)  # supervised draft positions
        vals["sequence_tokens"] = sum(len(s.tokens) for s in train)
        vals.update({f"head_refit_{k}": v for k, v in (refit or {}).items()})
        self.client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in vals.items() if v == v])

    def _export(self, out: Path, r: int, summary: dict) -> None:
        """The round's drafter + head as a registry-ready directory."""
        m = self.engine.module
        dtype = torch.bfloat16 if self.cfg.drafter.save_dtype == "bfloat16" else torch.float32
        m.drafter.save(out, dtype=dtype, extra={"online": {"round": r, "loss": self.cfg.loss.kind, "summary": summary}})
        save_length_head(m.head, out, metrics={"round": r, "heldout_mae": summary["head_mae_after"]})

    def _version_of_run(self, run_id: str) -> str | None:
        found = self.client.search_model_versions(f"name='{self.cfg.mlflow.model_name}' and run_id='{run_id}'")
        return str(found[0].version) if found else None

    def _publish(self) -> None:
        """Register the pending round's drafter (once), apply the gate, close its run; idempotent."""
        p = self.state["pending"]
        s = p["summary"]
        version = self._version_of_run(p["run_id"])  # registered before a crash: never register twice
        if version is None:
            version = self.registry.register(p["export"], run_id=p["run_id"], tags=p["tags"])
        current = self.registry.champion()
        if s["promote"] and current not in (self.state["champion"], version):  # moved outside the trainer mid-round
            s = {**s, "promote": False, "reason": f"champion moved to v{current} outside the trainer during the round (a rollback wins)"}
        if s["promote"]:
            self.registry.set_champion(version)
            self.registry.tag_version(version, "gate", "promoted")
            self.state["champion"] = version
        else:
            self.registry.tag_version(version, "gate", "rejected")
            self.registry.tag_version(version, "reason", s["reason"])
        if s["kept"]:
            self.state["base_version"] = version
        self.client.set_terminated(p["run_id"], "FINISHED")
        self.state["pending"] = None
        self._save_state()
        self._append_history({"round": p["round"], "shards": p["shards"], "version": version, **s})
        shutil.rmtree(p["export"], ignore_errors=True)  # the registry holds it now
        verdict = f"promoted v{version}" if s["promote"] else f"rejected v{version} ({s['reason']})"
        loss = f"loss {s['loss_first']:.3f} -> {s['loss_last']:.3f}" if s["loss_first"] is not None else "no steps"
        past = f", +{s['train'] - s['train_new']} / +{s['heldout'] - s['heldout_new']} kept from earlier rounds" if "train_new" in s else ""
        self.log(
            f"[train] round {p['round']}: {s['rows']} rows ({s['train']} train / {s['heldout']} held-out{past}, "
            f"{s['verify_rounds']} verify rounds), {loss}, held-out tau {s['tau_before']:.3f} -> {s['tau_after']:.3f}, "
            f"{verdict}, {s['seconds']}s"
        )

    def _append_history(self, rec: dict) -> None:
        path = self.ckpt / "rounds.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        if lines and json.loads(lines[-1])["round"] >= rec["round"]:
            return  # already recorded before a crash
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _cleanup(self) -> None:
        """Keep the live DeepSpeed tag and the `checkpoint.keep` newest others."""
        tags = [p for p in self.ckpt.iterdir() if p.is_dir() and re.fullmatch(r"round\d+|champion-v\d+", p.name)]
        tags.sort(key=lambda p: p.stat().st_mtime)
        old = [p for p in tags if p.name != self.state["weights_tag"]][: -self.cfg.checkpoint.keep]
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
