"""ShardReader: the trainer consumes shards exactly once (ledger), quarantines bad ones, applies retention."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from adaflash.buffer.files import fsync_dir, is_hidden, write_parquet_atomic, write_text_atomic
from adaflash.buffer.schema import TRAJECTORY_SCHEMA, Trajectory, from_arrow, schema_problem

logger = logging.getLogger(__name__)

_COMPACTED_FROM_KEY = b"adaflash.compacted_from"


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
        self._consumed: dict[str, int] = {}  # shard name -> rows, in ledger (consumption) order
        self._tags: dict[str, Any] = {}  # shard name -> the tag it was committed with
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
            self._tags[rec["shard"]] = rec.get("tag")
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
            if is_hidden(entry.name) or not entry.name.endswith(".parquet"):
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
            table = pq.read_table(path, schema=TRAJECTORY_SCHEMA, page_checksum_verification=True)
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
        fsync_dir(self.root)
        text = f"shard: {name}\nsource: {src}\ntime_ns: {time.time_ns()}\nreason: {reason}\n"
        write_text_atomic(dest.with_name(dest.name + ".reason.txt"), text)
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
                elif (self.root / name).is_file() and not is_hidden(name):
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

    def consumed_present(self) -> list[tuple[str, Any, int]]:
        """Consumed shards still in the buffer as (name, commit tag, bytes), oldest commit first."""
        with self._lock:
            present = set(self._consumed_present())
            return [(n, self._tags.get(n), (self.root / n).stat().st_size) for n in self._consumed if n in present]

    def retain(self, policy: str = "delete", names: Iterable[str] | None = None) -> dict[str, Any]:
        """Apply retention to consumed shards only (those in ``names``, or all); pending shards are
        never touched.

        ``"delete"``: remove consumed shards.  ``"compact"``: concatenate them into one Parquet
        archive in ``archive_dir`` (atomic; its sources are recorded in its metadata and in the
        ledger, which marks the archive consumed) and then remove them.  ``"keep"``: nothing.
        A crash part-way is safe: the ledger records a removal before the file goes, a removed
        shard is consumed either way, and the next ``retain`` finishes what is left.
        """
        if policy not in ("delete", "compact", "keep"):
            raise ValueError(f"unknown retention policy {policy!r}")
        with self._lock:
            self._recover_compactions()
            if policy == "keep":
                return {"policy": policy, "removed": [], "archive": None}
            wanted = None if names is None else set(names)
            names = [n for n in self._consumed_present() if wanted is None or n in wanted]
            if not names:
                return {"policy": policy, "removed": [], "archive": None}
            archive = None
            if policy == "compact":
                archive, names = self._compact(names)
            else:
                self._append_ledger([{"op": "delete", "shard": n, "t_ns": time.time_ns()} for n in names])
            for n in names:
                self._remove_consumed(n)
            fsync_dir(self.root)
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
            if is_hidden(name) or not name.endswith(".parquet") or name in self._compacted:
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
                [{"op": "compact", "file": name, "sources": sources, "rows": rows, "t_ns": time.time_ns(), "recovered": True}]
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
                quarantined = sum(1 for n in os.listdir(self.quarantine_dir) if not is_hidden(n) and not n.endswith(".reason.txt"))
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
