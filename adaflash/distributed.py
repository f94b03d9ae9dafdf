"""Process-group helpers shared by the DeepSpeed trainers (offline pretraining and the online trainer)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

STALE_BUILD_S = 300  # a JIT build's lock file older than this has no live builder (a build takes ~1 minute)


def init_distributed() -> None:
    """Single-process DeepSpeed on CPU (gloo) unless a launcher already set the rank variables.
    A single process rendezvouses through a file, not a TCP port another process could grab first."""
    init_method = None
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        init_method = "file://" + os.path.join(tempfile.mkdtemp(prefix="adaflash-dist-"), "store")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        clear_stale_build_locks()
    import deepspeed

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if init_method is None:
        deepspeed.init_distributed(dist_backend=backend)
    else:
        deepspeed.init_distributed(dist_backend=backend, init_method=init_method, rank=0, world_size=1)


def clear_stale_build_locks(root: str | None = None, max_age_s: float = STALE_BUILD_S) -> list[Path]:
    """Wait for torch JIT-build lock files (`<extensions dir>/<op>/lock`) to go, or remove them once older than
    `max_age_s`: DeepSpeed builds its CPU comm op on a process's first start behind a lock file that only the
    builder removes, so a trainer killed mid-build would leave every later start waiting on it forever (torch
    waits with no limit). A younger lock is a build in progress (another rank's): waited for. -> the paths removed."""
    if root is None:
        from torch.utils.cpp_extension import _get_build_directory  # the directory DeepSpeed's op builds use

        root = str(Path(_get_build_directory("deepspeed_shm_comm", False)).parent)  # (DeepSpeed makes it anyway)
    removed = []
    for lock in Path(root).glob("*/lock"):
        try:
            while time.time() - lock.stat().st_mtime <= max_age_s:
                time.sleep(0.5)
            lock.unlink()
            removed.append(lock)
        except OSError:  # gone: its build finished
            continue
    return removed


def from_rank0(obj):
    """Rank 0's value of `obj` on every rank (a decision one rank took alone, such as a time-limit
    stop, would leave the others waiting in the next collective)."""
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
