"""Trajectory buffer: Parquet shards from serving nodes to the online trainer.

Serving nodes record every speculative verification round of a request and, when the request
finishes, append one :class:`Trajectory` to a :class:`ShardWriter`.  The writer buffers rows in
memory and publishes them as immutable Parquet shards.  The online trainer consumes shards with a
:class:`ShardReader`, which keeps a durable ledger so every shard is consumed exactly once.

Layout of a buffer directory ``root``::

    root/
      {writer_id}-{seq:08d}.parquet     published shards (immutable once visible)
      .{writer_id}-{seq:08d}.parquet.tmp in-flight shard (hidden, ignored by readers)
      _writers/{writer_id}.seq          last sequence number reserved by that writer
      _ledger.jsonl                     reader ledger (default location)
      _quarantine/                      torn / empty / foreign shards + ``<name>.reason.txt``
      _compacted/                       archives written by ``retain("compact")``

Names starting with ``.`` or ``_`` are never treated as shards (``pyarrow.dataset`` skips them
too), so everything that is not a finished shard is hidden.

Schema (``TRAJECTORY_SCHEMA``, version ``SCHEMA_VERSION`` stored in the schema metadata under
``adaflash.schema_version``), one row per finished request:

=================  ==========================  ================================================
column             type                        meaning
=================  ==========================  ================================================
request_id         string                      unique id of the request
writer_id          string                      serving node / writer that recorded it
domain             string (nullable)           optional task domain (math, code, chat, ...)
drafter_version    string                      drafter weights version used while serving
prompt_ids         list<int32>                 prompt token ids
output_ids         list<int32>                 generated token ids (committed output)
created_ns         int64                       wall-clock time (ns since epoch) of the record
rounds             list<struct<...>>           one entry per verification round:
  anchor           int32                       position in prompt+output of the block's first
                                               token
  draft            list<int32>                 drafted tokens of the block
  target           list<int32>                 target's tokens at those positions
  accepted         int16                       number of accepted draft tokens
  verify_len       int16                       number of positions verified
  pred             float32                     length-head prediction, NaN if none
  t_ns             int64                       wall-clock time (ns) of the verification
=================  ==========================  ================================================

Everything except ``domain`` is non-nullable (lists may be empty).

Guarantees and limits:

* Publishing is atomic: a shard is written to ``.{name}.tmp`` in the same directory, fsynced,
  then ``os.replace``-d into place (and the directory fsynced).  A crash leaves at most a hidden
  temp file, which the next ``ShardWriter`` with the same ``writer_id`` removes.
* Sequence numbers are never reused: each flush first reserves its number in
  ``_writers/{writer_id}.seq`` (fsynced), so a restart continues after the highest of that file
  and the shards present, even when consumed shards have been deleted or moved away.
* Rows still buffered in memory are lost if the serving process dies (bounded by
  ``rows_per_shard`` and ``max_age_s``).
* One live ``ShardWriter`` per ``writer_id`` and one consuming ``ShardReader`` per ledger.
* The ledger makes *consumption* exactly-once; to make training side effects exactly-once, commit
  right after the trainer's state that includes those rows is durable (``commit(..., tag=...)``
  records e.g. the checkpoint step alongside).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

__all__ = [
    "SCHEMA_VERSION",
    "SCHEMA_VERSION_KEY",
    "ROUND_TYPE",
    "TRAJECTORY_SCHEMA",
    "Round",
    "Trajectory",
    "to_arrow",
    "from_arrow",
    "schema_problem",
    "ShardWriter",
    "ShardBatch",
    "ShardReader",
]

SCHEMA_VERSION = "1"
SCHEMA_VERSION_KEY = b"adaflash.schema_version"
_COMPACTED_FROM_KEY = b"adaflash.compacted_from"

_INT16_MIN, _INT16_MAX = -(2**15), 2**15 - 1
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _ids() -> pa.DataType:
    return pa.list_(pa.field("element", pa.int32(), nullable=False))


ROUND_TYPE = pa.struct(
    [
        pa.field("anchor", pa.int32(), nullable=False),
        pa.field("draft", _ids(), nullable=False),
        pa.field("target", _ids(), nullable=False),
        pa.field("accepted", pa.int16(), nullable=False),
        pa.field("verify_len", pa.int16(), nullable=False),
        pa.field("pred", pa.float32(), nullable=False),
        pa.field("t_ns", pa.int64(), nullable=False),
    ]
)

TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("writer_id", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=True),
        pa.field("drafter_version", pa.string(), nullable=False),
        pa.field("prompt_ids", _ids(), nullable=False),
        pa.field("output_ids", _ids(), nullable=False),
        pa.field("created_ns", pa.int64(), nullable=False),
        pa.field("rounds", pa.list_(pa.field("element", ROUND_TYPE, nullable=False)), nullable=False),
    ],
    metadata={SCHEMA_VERSION_KEY: SCHEMA_VERSION.encode()},
)


# ----------------------------------------------------------------------------------------------
# Records
# ----------------------------------------------------------------------------------------------


def _int_list(values: Any, what: str) -> list[int]:
    if values is None:
        raise ValueError(f"{what} must be a sequence of ints, got None")
    if hasattr(values, "tolist"):  # numpy arrays, torch tensors
        values = values.tolist()
    out = [int(v) for v in values]
    for v in out:
        if not _INT32_MIN <= v <= _INT32_MAX:
            raise ValueError(f"{what}: token id {v} does not fit int32")
    return out


def _int_range(value: Any, lo: int, hi: int, what: str) -> int:
    if value is None:
        raise ValueError(f"{what} must not be None")
    v = int(value)
    if not lo <= v <= hi:
        raise ValueError(f"{what}={v} out of range [{lo}, {hi}]")
    return v


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a str, got {type(value).__name__}")
    return value


@dataclass
class Round:
    """One speculative verification round of a request."""

    anchor: int
    draft: list[int]
    target: list[int]
    accepted: int
    verify_len: int
    pred: float = math.nan
    t_ns: int = field(default_factory=time.time_ns)

    def to_dict(self) -> dict[str, Any]:
        pred = math.nan if self.pred is None else float(self.pred)
        return {
            "anchor": _int_range(self.anchor, _INT32_MIN, _INT32_MAX, "anchor"),
            "draft": _int_list(self.draft, "draft"),
            "target": _int_list(self.target, "target"),
            "accepted": _int_range(self.accepted, _INT16_MIN, _INT16_MAX, "accepted"),
            "verify_len": _int_range(self.verify_len, _INT16_MIN, _INT16_MAX, "verify_len"),
            "pred": pred,
            "t_ns": _int_range(self.t_ns, -(2**63), 2**63 - 1, "t_ns"),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Round":
        pred = d["pred"]
        return cls(
            anchor=d["anchor"],
            draft=list(d["draft"]),
            target=list(d["target"]),
            accepted=d["accepted"],
            verify_len=d["verify_len"],
            pred=math.nan if pred is None else float(pred),
            t_ns=d["t_ns"],
        )


@dataclass
class Trajectory:
    """One finished request with all of its verification rounds (one row of the schema)."""

    request_id: str
    writer_id: str
    drafter_version: str
    prompt_ids: list[int]
    output_ids: list[int]
    rounds: list[Round] = field(default_factory=list)
    domain: str | None = None
    created_ns: int = field(default_factory=time.time_ns)

    def to_dict(self) -> dict[str, Any]:
        """Validated row dict in the column order of ``TRAJECTORY_SCHEMA``; raises ``ValueError``."""
        if self.domain is not None:
            _text(self.domain, "domain")
        return {
            "request_id": _text(self.request_id, "request_id"),
            "writer_id": _text(self.writer_id, "writer_id"),
            "domain": self.domain,
            "drafter_version": _text(self.drafter_version, "drafter_version"),
            "prompt_ids": _int_list(self.prompt_ids, "prompt_ids"),
            "output_ids": _int_list(self.output_ids, "output_ids"),
            "created_ns": _int_range(self.created_ns, -(2**63), 2**63 - 1, "created_ns"),
            "rounds": [
                (r if isinstance(r, Round) else Round(**r)).to_dict() for r in (self.rounds or [])
            ],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trajectory":
        return cls(
            request_id=d["request_id"],
            writer_id=d["writer_id"],
            drafter_version=d["drafter_version"],
            prompt_ids=list(d["prompt_ids"]),
            output_ids=list(d["output_ids"]),
            rounds=[Round.from_dict(r) for r in d["rounds"]],
            domain=d["domain"],
            created_ns=d["created_ns"],
        )


def to_arrow(trajectories: Iterable[Trajectory]) -> pa.Table:
    """Convert trajectories to a table with exactly ``TRAJECTORY_SCHEMA``."""
    rows = [t.to_dict() for t in trajectories]
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)


def from_arrow(table: pa.Table | pa.RecordBatch) -> list[Trajectory]:
    """Convert a table (or batch) with ``TRAJECTORY_SCHEMA`` back to trajectories."""
    return [Trajectory.from_dict(d) for d in table.to_pylist()]


def schema_problem(schema: pa.Schema) -> str | None:
    """Why ``schema`` (e.g. of a Parquet file) cannot be read as trajectories; None if it can."""
    meta = schema.metadata or {}
    version = meta.get(SCHEMA_VERSION_KEY)
    if version is None:
        return "foreign schema: no adaflash.schema_version in the schema metadata"
    if version.decode(errors="replace") != SCHEMA_VERSION:
        return (
            f"incompatible schema version {version.decode(errors='replace')!r} "
            f"(this reader understands {SCHEMA_VERSION!r})"
        )
    if not schema.equals(TRAJECTORY_SCHEMA, check_metadata=False):
        return f"incompatible schema (version {SCHEMA_VERSION} but fields differ): {schema}"
    return None


# ----------------------------------------------------------------------------------------------
# File helpers
# ----------------------------------------------------------------------------------------------

_WRITER_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SEQ_DIR = "_writers"


def _is_hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def write_parquet_atomic(table: pa.Table, final: Path) -> None:
    """Write ``table`` to ``final`` via ``.{name}.tmp`` + fsync + ``os.replace``."""
    tmp = final.with_name(f".{final.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            pq.write_table(table, f, compression="zstd", write_page_checksum=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(final.parent)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# ----------------------------------------------------------------------------------------------
# Writer
# ----------------------------------------------------------------------------------------------


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
        if not isinstance(writer_id, str) or not _WRITER_ID_RE.fullmatch(writer_id):
            raise ValueError(
                f"writer_id must match {_WRITER_ID_RE.pattern} (no leading '.'/'_', no '/'): "
                f"{writer_id!r}"
            )
        if rows_per_shard < 1:
            raise ValueError("rows_per_shard must be >= 1")
        self.root = Path(root)
        self.writer_id = writer_id
        self.rows_per_shard = int(rows_per_shard)
        self.max_age_s = max_age_s
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / _SEQ_DIR).mkdir(exist_ok=True)
        self._seq_path = self.root / _SEQ_DIR / f"{writer_id}.seq"
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
        return (
            self.max_age_s is not None
            and self._oldest is not None
            and time.monotonic() - self._oldest >= self.max_age_s
        )

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
        _write_text_atomic(self._seq_path, f"{seq}\n")
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


# ----------------------------------------------------------------------------------------------
# Reader
# ----------------------------------------------------------------------------------------------


@dataclass
class ShardBatch:
    """One consumed-to-be shard: its name, path and contents."""

    name: str
    path: Path
    table: pa.Table

    @property
    def num_rows(self) -> int:
        return self.table.num_rows

    def trajectories(self) -> list[Trajectory]:
        return from_arrow(self.table)


class ShardReader:
    """Consumes shards of a buffer directory exactly once, with a durable JSON-lines ledger.

    ``poll()`` returns shards not yet committed, sorted by name.  Within one reader a shard handed
    out by ``poll()`` is not returned again until ``rollback()``; a new reader (e.g. after a
    crash) returns every uncommitted shard again.  ``commit()`` appends to the ledger and fsyncs.
    Only one consuming reader per ledger.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        ledger_path: str | os.PathLike | None = None,
        quarantine_dir: str | os.PathLike | None = None,
        archive_dir: str | os.PathLike | None = None,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.ledger_path = Path(ledger_path) if ledger_path else self.root / "_ledger.jsonl"
        self.quarantine_dir = Path(quarantine_dir) if quarantine_dir else self.root / "_quarantine"
        self.archive_dir = Path(archive_dir) if archive_dir else self.root / "_compacted"
        self._lock = threading.RLock()
        self._consumed: dict[str, int] = {}  # shard name -> rows
        self._removed: set[str] = set()  # consumed shards deleted or compacted away
        self._compacted: dict[str, int] = {}  # archive file name -> rows
        self._inflight: dict[str, int] = {}  # polled, not committed: name -> rows
        self._load_ledger()

    # -- ledger ----------------------------------------------------------------------------

    def _load_ledger(self) -> None:
        try:
            data = self.ledger_path.read_bytes()
        except FileNotFoundError:
            return
        lines = data.split(b"\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                # A crash while appending leaves at most a torn last line; that commit never
                # happened, so its shards are simply returned again.
                level = logging.WARNING if i == len(lines) - 1 else logging.ERROR
                logger.log(level, "ignoring unreadable ledger line %d of %s", i + 1, self.ledger_path)
                continue
            self._apply(rec)

    def _apply(self, rec: dict[str, Any]) -> None:
        op = rec.get("op")
        if op == "consume":
            self._consumed[rec["shard"]] = int(rec.get("rows", 0))
        elif op == "delete":
            self._removed.add(rec["shard"])
        elif op == "compact":
            self._compacted[rec["file"]] = int(rec.get("rows", 0))
            self._removed.update(rec.get("sources", []))

    def _append_ledger(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        self.ledger_path.parent.mkdir(parents=True, exist_ok=True)
        payload = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode()
        fd = os.open(self.ledger_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size:
                # Start on a fresh line if the last append was torn by a crash.
                with open(self.ledger_path, "rb") as f:
                    f.seek(size - 1)
                    if f.read(1) != b"\n":
                        payload = b"\n" + payload
            os.write(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        for r in records:
            self._apply(r)

    # -- polling ---------------------------------------------------------------------------

    def _visible_shards(self) -> list[str]:
        names = []
        for entry in os.scandir(self.root):
            if _is_hidden(entry.name) or not entry.name.endswith(".parquet"):
                continue
            if entry.is_file(follow_symlinks=False):
                names.append(entry.name)
        return sorted(names)

    def pending(self) -> list[str]:
        """Names of visible shards not yet committed (including ones polled by this reader)."""
        with self._lock:
            return [n for n in self._visible_shards() if n not in self._consumed]

    def poll(self, max_shards: int | None = None) -> list[ShardBatch]:
        """Read and return uncommitted shards not already handed out by this reader, by name.

        Torn, empty or foreign shards are moved to the quarantine folder (never fatal).
        """
        out: list[ShardBatch] = []
        with self._lock:
            for name in self._visible_shards():
                if max_shards is not None and len(out) >= max_shards:
                    break
                if name in self._consumed or name in self._inflight:
                    continue
                batch = self._read_shard(name)
                if batch is not None:
                    self._inflight[name] = batch.num_rows
                    out.append(batch)
        return out

    def _read_shard(self, name: str) -> ShardBatch | None:
        path = self.root / name
        try:
            if path.stat().st_size == 0:
                self._quarantine(name, "empty file (0 bytes)")
                return None
            file_schema = pq.read_schema(path)
        except FileNotFoundError:
            return None  # removed concurrently
        except Exception as e:  # torn footer, random bytes, not Parquet at all
            self._quarantine(name, f"torn or unreadable Parquet footer: {type(e).__name__}: {e}")
            return None
        problem = schema_problem(file_schema)
        if problem is not None:
            self._quarantine(name, problem)
            return None
        try:
            table = pq.read_table(
                path, schema=TRAJECTORY_SCHEMA, page_checksum_verification=True
            )
        except FileNotFoundError:
            return None
        except Exception as e:  # corrupt data pages
            self._quarantine(name, f"torn or corrupt data: {type(e).__name__}: {e}")
            return None
        if table.num_rows == 0:
            self._quarantine(name, "empty shard (0 rows)")
            return None
        return ShardBatch(name=name, path=path, table=table)

    def _quarantine(self, name: str, reason: str) -> None:
        self.quarantine_dir.mkdir(parents=True, exist_ok=True)
        dest = self.quarantine_dir / name
        k = 1
        while dest.exists():
            dest = self.quarantine_dir / f"{name}.{k}"
            k += 1
        src = self.root / name
        try:
            os.replace(src, dest)
        except FileNotFoundError:
            return
        except OSError:  # different filesystem
            shutil.move(str(src), str(dest))
        _fsync_dir(self.root)
        text = f"shard: {name}\nsource: {src}\ntime_ns: {time.time_ns()}\nreason: {reason}\n"
        _write_text_atomic(dest.with_name(dest.name + ".reason.txt"), text)
        logger.warning("quarantined shard %s -> %s: %s", name, dest, reason)

    def rollback(self, shard_names: Iterable[str | ShardBatch] | None = None) -> None:
        """Forget that shards were polled (all if None) so the next ``poll`` returns them again."""
        with self._lock:
            if shard_names is None:
                self._inflight.clear()
            else:
                for n in shard_names:
                    self._inflight.pop(n.name if isinstance(n, ShardBatch) else n, None)

    # -- committing ------------------------------------------------------------------------

    def commit(self, shard_names: Iterable[str | ShardBatch], tag: Any = None) -> None:
        """Durably record shards as consumed (idempotent).  ``tag`` is stored in the ledger."""
        with self._lock:
            records = []
            seen: set[str] = set()
            for item in shard_names:
                name = item.name if isinstance(item, ShardBatch) else str(item)
                if name in self._consumed or name in seen:
                    continue
                if name in self._inflight:
                    rows = self._inflight[name]
                elif (self.root / name).is_file() and not _is_hidden(name):
                    rows = pq.ParquetFile(self.root / name).metadata.num_rows
                else:
                    raise KeyError(f"unknown shard {name!r}: not polled and not in {self.root}")
                seen.add(name)
                rec = {"op": "consume", "shard": name, "rows": rows, "t_ns": time.time_ns()}
                if tag is not None:
                    rec["tag"] = tag
                records.append(rec)
            self._append_ledger(records)
            for r in records:
                self._inflight.pop(r["shard"], None)

    def is_consumed(self, name: str) -> bool:
        return name in self._consumed

    # -- retention -------------------------------------------------------------------------

    def _consumed_present(self) -> list[str]:
        return [n for n in self._visible_shards() if n in self._consumed]

    def retain(self, policy: str = "delete") -> dict[str, Any]:
        """Apply retention to consumed shards only; pending shards are never touched.

        ``"delete"``: remove consumed shards.  ``"compact"``: concatenate them into one Parquet
        archive in ``archive_dir`` (atomic; its sources are recorded in its metadata and in the
        ledger, which marks the archive consumed) and then remove them.  ``"keep"``: nothing.
        """
        if policy not in ("delete", "compact", "keep"):
            raise ValueError(f"unknown retention policy {policy!r}")
        with self._lock:
            self._recover_compactions()
            if policy == "keep":
                return {"policy": policy, "removed": [], "archive": None}
            names = self._consumed_present()
            if not names:
                return {"policy": policy, "removed": [], "archive": None}
            archive = None
            if policy == "compact":
                archive, names = self._compact(names)
            else:
                self._append_ledger(
                    [{"op": "delete", "shard": n, "t_ns": time.time_ns()} for n in names]
                )
            for n in names:
                self._remove_consumed(n)
            _fsync_dir(self.root)
            return {"policy": policy, "removed": names, "archive": archive}

    def _remove_consumed(self, name: str) -> None:
        assert name in self._consumed, name  # never delete an unconsumed shard
        try:
            os.unlink(self.root / name)
        except FileNotFoundError:
            pass

    def _compact(self, names: list[str]) -> tuple[str | None, list[str]]:
        tables, used = [], []
        for n in names:
            try:
                t = pq.read_table(self.root / n, schema=TRAJECTORY_SCHEMA)
            except Exception as e:  # consumed already; should not happen for a polled shard
                logger.warning("cannot read consumed shard %s for compaction: %s", n, e)
                continue
            tables.append(t)
            used.append(n)
        if not used:
            return None, []
        table = pa.concat_tables(tables)
        digest = hashlib.sha1("\n".join(used).encode()).hexdigest()[:12]
        arch_name = f"compact-{time.time_ns():020d}-{digest}.parquet"
        meta = dict(TRAJECTORY_SCHEMA.metadata)
        meta[_COMPACTED_FROM_KEY] = json.dumps(used).encode()
        self.archive_dir.mkdir(parents=True, exist_ok=True)
        write_parquet_atomic(table.replace_schema_metadata(meta), self.archive_dir / arch_name)
        self._append_ledger(
            [
                {
                    "op": "compact",
                    "file": arch_name,
                    "sources": used,
                    "rows": table.num_rows,
                    "t_ns": time.time_ns(),
                }
            ]
        )
        return arch_name, used

    def _recover_compactions(self) -> None:
        """Finish a compaction interrupted between writing the archive and the ledger record."""
        if not self.archive_dir.is_dir():
            return
        for name in sorted(os.listdir(self.archive_dir)):
            if _is_hidden(name) or not name.endswith(".parquet") or name in self._compacted:
                continue
            try:
                pf = pq.ParquetFile(self.archive_dir / name)
                sources = json.loads(pf.schema_arrow.metadata[_COMPACTED_FROM_KEY])
                rows = pf.metadata.num_rows
            except Exception as e:
                logger.warning("ignoring unrecognised file %s in %s: %s", name, self.archive_dir, e)
                continue
            sources = [s for s in sources if s in self._consumed]
            logger.warning("recovering interrupted compaction %s (%d sources)", name, len(sources))
            self._append_ledger(
                [{"op": "compact", "file": name, "sources": sources, "rows": rows,
                  "t_ns": time.time_ns(), "recovered": True}]
            )
            for s in sources:
                self._remove_consumed(s)

    # -- stats -----------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counts of shards and rows by state (pending rows come from Parquet footers)."""
        with self._lock:
            pending = pending_rows = unreadable = 0
            consumed_present = consumed_present_rows = 0
            for n in self._visible_shards():
                if n in self._consumed:
                    consumed_present += 1
                    consumed_present_rows += self._consumed[n]
                    continue
                pending += 1
                try:
                    pending_rows += pq.ParquetFile(self.root / n).metadata.num_rows
                except Exception:
                    unreadable += 1
            quarantined = 0
            if self.quarantine_dir.is_dir():
                quarantined = sum(
                    1
                    for n in os.listdir(self.quarantine_dir)
                    if not _is_hidden(n) and not n.endswith(".reason.txt")
                )
            return {
                "pending_shards": pending,
                "pending_rows": pending_rows,
                "pending_unreadable": unreadable,
                "inflight_shards": len(self._inflight),
                "consumed_shards": len(self._consumed),
                "consumed_rows": sum(self._consumed.values()),
                "consumed_present_shards": consumed_present,
                "consumed_present_rows": consumed_present_rows,
                "quarantined_shards": quarantined,
                "compacted_files": len(self._compacted),
                "compacted_rows": sum(self._compacted.values()),
            }
