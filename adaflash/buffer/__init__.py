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

The schema is documented in :mod:`adaflash.buffer.schema`.

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
