"""ShardWriter: serving nodes publish trajectories as immutable Parquet shards."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa

from adaflash.buffer.files import SEQ_DIR, WRITER_ID_RE, fsync_dir, write_parquet_atomic, write_text_atomic
from adaflash.buffer.schema import TRAJECTORY_SCHEMA, Trajectory

logger = logging.getLogger(__name__)

JOURNAL_DIR = "_journal"
SEQ_KEY = b"adaflash.shard_seq"  # journal segment metadata: the shard number its rows will be published as


class ShardWriter:
    """Buffers trajectories in memory and publishes them as Parquet shards, atomically.

    A shard is flushed when ``rows_per_shard`` rows are buffered, when the oldest buffered row is
    older than ``max_age_s`` at the next ``append`` (or at ``flush_if_due()``, which a server can
    call from a timer), and on ``flush()`` / ``close()``.  Thread-safe.

    With ``journal`` (the default) every appended row is also written to ``_journal/{writer_id}.arrows``
    (an Arrow IPC stream, fsynced before ``append`` returns), so a row appended before the process dies
    (kill -9, power loss) is not lost: the next writer started on the same buffer publishes a dead
    writer's journal as the shard it was meant to become. A live writer holds an exclusive ``flock`` on
    its journal; a journal whose lock can be taken belongs to a dead writer.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        writer_id: str,
        rows_per_shard: int = 128,
        max_age_s: float | None = 60.0,
        journal: bool = True,
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
        self._tmp_re = re.compile(r"\." + re.escape(writer_id) + r"-\d{8,}\.parquet\.tmp")
        self._lock = threading.RLock()
        self._batches: list[pa.RecordBatch] = []
        self._rows = 0
        self._oldest: float | None = None  # time.monotonic() of the oldest buffered row
        self._closed = False
        self.shards_written: list[str] = []
        self._remove_stale_tmp()
        self._seq = self._last_seq()
        self._journal = None  # (file, IPC stream writer or None) while this writer holds its journal
        self._segment_seq: int | None = None  # the reserved number of the shard the buffered rows become
        if journal:
            self._recover_journals()
            self._open_journal()

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

    def _last_seq(self, writer_id: str | None = None) -> int:
        writer_id = writer_id or self.writer_id
        shard_re = re.compile(re.escape(writer_id) + r"-(\d{8,})\.parquet")
        last = 0
        for name in os.listdir(self.root):
            m = shard_re.fullmatch(name)
            if m:
                last = max(last, int(m.group(1)))
        seq_path = self.root / SEQ_DIR / f"{writer_id}.seq"
        try:
            last = max(last, int(seq_path.read_text().strip() or 0))
        except FileNotFoundError:
            pass
        except ValueError:
            logger.warning("unreadable sequence file %s; using shard names only", seq_path)
        return last

    # -- the journal -----------------------------------------------------------------------

    def _open_journal(self) -> None:
        jdir = self.root / JOURNAL_DIR
        jdir.mkdir(exist_ok=True)
        f = open(jdir / f"{self.writer_id}.arrows", "ab")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise RuntimeError(f"another live ShardWriter uses writer_id {self.writer_id!r} on {self.root}: give each writer its own id")
        if f.tell():  # our own journal, left by an earlier process with this writer_id: publish it first
            self._publish_journal(self.writer_id, jdir / f"{self.writer_id}.arrows")
            f.truncate(0)
        self._journal = (f, None)

    def _journal_row(self, batch: pa.RecordBatch) -> None:
        """Append one row to the journal and make it durable before `append` returns."""
        f, stream = self._journal
        if stream is None:  # a new segment: its shard number is reserved now, so recovery can tell if it was published
            self._segment_seq = self._reserve_seq()
            meta = {**(TRAJECTORY_SCHEMA.metadata or {}), SEQ_KEY: str(self._segment_seq).encode()}
            stream = pa.ipc.new_stream(f, TRAJECTORY_SCHEMA.with_metadata(meta))
            self._journal = (f, stream)
        stream.write_batch(batch)
        f.flush()
        os.fsync(f.fileno())

    def _reset_journal(self) -> None:
        """The buffered rows are in a durable shard: start an empty segment."""
        if self._journal is None:
            return
        f, stream = self._journal
        if stream is not None:
            stream.close()  # now, not at garbage collection (its end marker would land in the next segment)
        f.truncate(0)
        f.flush()
        os.fsync(f.fileno())
        self._journal = (f, None)

    def _recover_journals(self) -> None:
        """Publish the journals of dead writers (their lock is free) as the shards they were meant to be."""
        jdir = self.root / JOURNAL_DIR
        if not jdir.is_dir():
            return
        for path in sorted(jdir.glob("*.arrows")):
            wid = path.name[: -len(".arrows")]
            if wid == self.writer_id or not WRITER_ID_RE.fullmatch(wid):
                continue
            with open(path, "ab") as f:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its writer is alive
                try:
                    if os.fstat(f.fileno()).st_ino != os.stat(path).st_ino:
                        continue  # another writer recovered and removed it meanwhile
                except FileNotFoundError:
                    continue
                self._publish_journal(wid, path)
                path.unlink()
                fsync_dir(jdir)

    def _publish_journal(self, writer_id: str, path: Path) -> None:
        """The readable rows of a journal -> the shard its segment reserved (unless that shard was
        already published, or consumed: the default reader ledger says so). A torn last row, written
        while the process died, was never acknowledged and is dropped."""
        batches, seq = [], None
        try:
            with pa.ipc.open_stream(pa.memory_map(str(path))) as reader:
                seq = int((reader.schema.metadata or {}).get(SEQ_KEY, b"0"))
                while True:
                    try:
                        batches.append(reader.read_next_batch())
                    except StopIteration:
                        break
        except (pa.ArrowInvalid, OSError, ValueError) as e:
            if not batches:
                if path.stat().st_size:
                    logger.warning("journal %s unreadable (%s): nothing recovered", path, e)
                return
        if not batches or not seq:
            return
        name = f"{writer_id}-{seq:08d}.parquet"
        if (self.root / name).exists() or _consumed(self.root, name):
            return
        table = pa.Table.from_batches(batches, schema=TRAJECTORY_SCHEMA).combine_chunks()
        write_parquet_atomic(table, self.root / name)
        self.shards_written.append(name)
        logger.warning("recovered %d trajectory rows of writer %s from its journal as %s", table.num_rows, writer_id, name)

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
            if self._journal is not None:
                self._journal_row(batch)
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
        seq = self._segment_seq if self._segment_seq is not None else self._reserve_seq()
        name = f"{self.writer_id}-{seq:08d}.parquet"
        write_parquet_atomic(table, self.root / name)  # on error the buffer is kept
        self._reset_journal()
        self._segment_seq = None
        self._batches = []
        self._rows = 0
        self._oldest = None
        self.shards_written.append(name)
        return name

    def _reserve_seq(self) -> int:
        """The next shard number, reserved durably first, so it is never reused even if its shard is
        later consumed and deleted before the writer restarts."""
        seq = self._seq + 1
        write_text_atomic(self._seq_path, f"{seq}\n")
        self._seq = seq
        return seq

    def close(self) -> str | None:
        with self._lock:
            if self._closed:
                return None
            name = self._flush_locked()
            self._closed = True
            if self._journal is not None:
                path = self._journal[0].name
                self._journal[0].close()  # releases the lock
                self._journal = None
                Path(path).unlink(missing_ok=True)
            return name

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _consumed(root: Path, name: str) -> bool:
    """Whether the default reader ledger of `root` records `name` as consumed."""
    try:
        with open(root / "_ledger.jsonl", "rb") as f:
            return any(json.loads(line).get("shard") == name for line in f if name.encode() in line)
    except (FileNotFoundError, ValueError):
        return False
