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
      _journal/{writer_id}.arrows       rows appended since that writer's last shard (Arrow IPC, fsynced)
      _ledger.jsonl                     reader ledger (default location)
      _quarantine/                      torn / empty / foreign shards + ``<name>.reason.txt``
      _compacted/                       archives written by ``retain("compact")``

Names starting with ``.`` or ``_`` are never treated as shards (``pyarrow.dataset`` skips them
too), so everything that is not a finished shard is hidden.

The schema is documented in :mod:`adaflash.buffer.schema`.

Guarantees and limits:

* Publishing is atomic: a shard is written to ``.{name}.tmp`` in the same directory, fsynced,
  then ``os.replace``-d into place (and the directory fsynced).  A crash leaves at most a hidden
  temp file, which the next ``ShardWriter`` with the same ``writer_id`` removes.
* Sequence numbers are never reused: each flush first reserves its number in
  ``_writers/{writer_id}.seq`` (fsynced), so a restart continues after the highest of that file
  and the shards present, even when consumed shards have been deleted or moved away.
* A row is durable when ``append`` returns: the writer journals it (``_journal/{writer_id}.arrows``,
  fsynced) until its shard is published; after a crash (kill -9) the next writer started on the
  buffer, whatever its id, publishes the dead writer's journal as the shard it was meant to become
  (not twice: a shard already published, or consumed per the default ledger, is skipped).
* One live ``ShardWriter`` per ``writer_id`` (a second is refused: the journal's ``flock``) and one
  consuming ``ShardReader`` per ledger.
* The ledger makes *consumption* exactly-once; to make training side effects exactly-once, commit
  right after the trainer's state that includes those rows is durable (``commit(..., tag=...)``
  records e.g. the checkpoint step alongside).
"""

from adaflash.buffer.files import write_parquet_atomic
from adaflash.buffer.reader import ShardBatch, ShardReader
from adaflash.buffer.schema import (
    ROUND_TYPE,
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    TRAJECTORY_SCHEMA,
    Round,
    Trajectory,
    from_arrow,
    schema_problem,
    to_arrow,
)
from adaflash.buffer.writer import ShardWriter

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
    "write_parquet_atomic",
    "ShardWriter",
    "ShardBatch",
    "ShardReader",
]
