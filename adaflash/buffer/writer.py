"""ShardWriter: serving nodes publish trajectories as immutable Parquet shards."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa

from adaflash.buffer.files import SEQ_DIR, WRITER_ID_RE, write_parquet_atomic, write_text_atomic
from adaflash.buffer.schema import TRAJECTORY_SCHEMA, Trajectory

logger = logging.getLogger(__name__)


class ShardWriter:
    """Buffers trajectories in memory and publishes them as Parquet shards, atomically.

    A shard is flushed when ``rows_per_shard`` rows are buffered, when the oldest buffered row is
    older than ``max_age_s`` at the next ``append`` (or at ``flush_if_due()``, which a server can
    call from a timer), and on ``flush()`` / ``close()``.  Thread-safe.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        writer_id: str,
        rows_per_shard: int = 128,
        max_age_s: float | None = 60.0,
    ) -> None:
        if not isinstance(writer_id, str) or not WRITER_ID_RE.fullmatch(writer_id):
            raise ValueError(f"writer_id must match {WRITER_ID_RE.pattern} (no leading '.'/'_', no '/'): {writer_id!r}")
        if rows_per_shard < 1:
            raise ValueError("rows_per_shard must be >= 1")
        self.root = Path(root)
        self.writer_id = writer_id
        self.rows_per_shard = int(rows_per_shard)
        self.max_age_s = max_age_s
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / SEQ_DIR).mkdir(exist_ok=True)
        self._seq_path = self.root / SEQ_DIR / f"{writer_id}.seq"
        self._shard_re = re.compile(re.escape(writer_id) + r"-(\d{8,})\.parquet")
        self._tmp_re = re.compile(r"\." + re.escape(writer_id) + r"-\d{8,}\.parquet\.tmp")
        self._lock = threading.RLock()
        self._batches: list[pa.RecordBatch] = []
        self._rows = 0
        self._oldest: float | None = None  # time.monotonic() of the oldest buffered row
        self._closed = False
        self.shards_written: list[str] = []
        self._remove_stale_tmp()
        self._seq = self._last_seq()

    # -- start-up --------------------------------------------------------------------------

    def _remove_stale_tmp(self) -> None:
        for name in os.listdir(self.root):
            if self._tmp_re.fullmatch(name):
                logger.warning("removing stale temp shard %s of writer %s", name, self.writer_id)
                try:
                    os.unlink(self.root / name)
                except FileNotFoundError:
                    pass
        seq_tmp = self._seq_path.with_name(f".{self._seq_path.name}.tmp")
        if seq_tmp.exists():
            seq_tmp.unlink()

    def _last_seq(self) -> int:
        last = 0
        for name in os.listdir(self.root):
            m = self._shard_re.fullmatch(name)
            if m:
                last = max(last, int(m.group(1)))
        try:
            last = max(last, int(self._seq_path.read_text().strip() or 0))
        except FileNotFoundError:
            pass
        except ValueError:
            logger.warning("unreadable sequence file %s; using shard names only", self._seq_path)
        return last

    @property
    def next_seq(self) -> int:
        return self._seq + 1

    @property
    def buffered_rows(self) -> int:
        return self._rows

    # -- appending -------------------------------------------------------------------------

    def append(self, traj: Trajectory) -> str | None:
        """Buffer one trajectory (validated now); returns the shard name if this call flushed."""
        batch = pa.RecordBatch.from_pylist([traj.to_dict()], schema=TRAJECTORY_SCHEMA)
        with self._lock:
            if self._closed:
                raise RuntimeError("ShardWriter is closed")
            if self._oldest is None:
                self._oldest = time.monotonic()
            self._batches.append(batch)
            self._rows += batch.num_rows
            if self._rows >= self.rows_per_shard or self._is_stale():
                return self._flush_locked()
            return None

    def extend(self, trajs: Iterable[Trajectory]) -> list[str]:
        return [name for t in trajs if (name := self.append(t)) is not None]

    def _is_stale(self) -> bool:
        return self.max_age_s is not None and self._oldest is not None and time.monotonic() - self._oldest >= self.max_age_s

    def flush_if_due(self) -> str | None:
        """Flush if the oldest buffered row is older than ``max_age_s``."""
        with self._lock:
            if self._rows and self._is_stale():
                return self._flush_locked()
            return None

    def flush(self) -> str | None:
        """Publish the buffered rows as one shard; returns its name (None if nothing buffered)."""
        with self._lock:
            return self._flush_locked()

    def _flush_locked(self) -> str | None:
        if not self._rows:
            return None
        table = pa.Table.from_batches(self._batches, schema=TRAJECTORY_SCHEMA).combine_chunks()
        seq = self._seq + 1
        # Reserve the number durably first, so it is never reused even if this shard is later
        # consumed and deleted before the writer restarts.
        write_text_atomic(self._seq_path, f"{seq}\n")
        self._seq = seq
        name = f"{self.writer_id}-{seq:08d}.parquet"
        write_parquet_atomic(table, self.root / name)  # on error the buffer is kept
        self._batches = []
        self._rows = 0
        self._oldest = None
        self.shards_written.append(name)
        return name

    def close(self) -> str | None:
        with self._lock:
            if self._closed:
                return None
            name = self._flush_locked()
            self._closed = True
            return name

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
