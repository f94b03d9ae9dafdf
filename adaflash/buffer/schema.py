"""Arrow schema of the trajectory buffer: one row per finished request.

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

``Round`` is also what the engine records while serving: its two in-memory fields, ``hidden`` and
``source``, are not columns; the buffer holds drafter rounds only (``Engine.trajectory``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import pyarrow as pa

SCHEMA_VERSION = "1"
SCHEMA_VERSION_KEY = b"adaflash.schema_version"

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
    """One speculative verification round of a request: what the engine records and the buffer stores."""

    anchor: int  # position of the block's first token in prompt + output
    draft: list[int]  # drafts verified this round (a tree round: its walk's path, the accepted nodes + the best child after them)
    target: list[int]  # the target's greedy token at each of those positions
    accepted: int
    verify_len: int  # tokens verified incl. the anchor
    pred: float = math.nan  # length-head prediction (nan without a head)
    t_ns: int = field(default_factory=time.time_ns)  # wall-clock time of the verification
    # not stored:
    hidden: Any = field(default=None, repr=False, compare=False)  # [K, H] drafter block states, kept when collecting head data
    source: str = "drafter"  # or "lookup": the drafts came from prompt lookup, not the drafter

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
            "rounds": [(r if isinstance(r, Round) else Round(**r)).to_dict() for r in (self.rounds or [])],
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
        return f"incompatible schema version {version.decode(errors='replace')!r} (this reader understands {SCHEMA_VERSION!r})"
    if not schema.equals(TRAJECTORY_SCHEMA, check_metadata=False):
        return f"incompatible schema (version {SCHEMA_VERSION} but fields differ): {schema}"
    return None
