"""The trainer's round memory: each finished round's trajectories, kept for the next few rounds.

Online traffic arrives a few dozen requests at a time. Training only on the newest round overfits it
and judging the gate on its held-out fifth (a handful of requests) is noise, so a round can also
  - replay the training trajectories of the previous `train.replay_rounds` rounds, and
  - gate on the held-out trajectories of the previous `gate.heldout_rounds` rounds as well as its own.
Which trajectories are held out is the same request_id hash everywhere, so a held-out request is never
trained on in any round.

`memory/round{N}.parquet` (TRAJECTORY_SCHEMA) is written atomically at the round's durable point,
before state.json. A file of a round later than state.json's is the leftover of a killed round; it is
never read (round r reads rounds r-n .. r-1) and is overwritten when that round is redone, so replay
never double-counts a shard. Consumed buffer shards may be deleted by retention: this copy is the
trainer's own.
"""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from adaflash.buffer import TRAJECTORY_SCHEMA, Trajectory, from_arrow, write_parquet_atomic


class RoundMemory:
    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, r: int) -> Path:
        return self.root / f"round{r}.parquet"

    def save(self, r: int, tables: list[pa.Table]) -> None:
        """Keep round r's trajectories (the tables of its shards)."""
        self.root.mkdir(parents=True, exist_ok=True)
        write_parquet_atomic(pa.concat_tables([t.select(TRAJECTORY_SCHEMA.names) for t in tables]), self.path(r))

    def load(self, r: int, n: int) -> dict[int, list[Trajectory]]:
        """{round: its trajectories} for the rounds r-n .. r-1 that are still kept, oldest first."""
        return {
            j: from_arrow(pq.read_table(self.path(j), schema=TRAJECTORY_SCHEMA)) for j in range(max(1, r - n), r) if self.path(j).exists()
        }

    def prune(self, r: int, n: int) -> None:
        """Drop rounds that round r + 1 will no longer read (older than r + 1 - n)."""
        for p in self.root.glob("round*.parquet"):
            m = re.fullmatch(r"round(\d+)\.parquet", p.name)
            if m and int(m.group(1)) < r + 1 - n:
                p.unlink()
