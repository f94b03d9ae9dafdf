"""Trajectory buffer: real Parquet shards in tmp_path, no mocks."""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from adaflash.buffer import (
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    TRAJECTORY_SCHEMA,
    Round,
    ShardReader,
    ShardWriter,
    Trajectory,
    from_arrow,
    to_arrow,
)

REPO = Path(__file__).resolve().parents[1]


def make_traj(i: int, writer: str = "w0", n_rounds: int = 2) -> Trajectory:
    rounds = [
        Round(
            anchor=10 + 4 * k,
            draft=[i, k, 7, 8],
            target=[i, k, 9],
            accepted=2,
            verify_len=3,
            pred=0.25 * k,
            t_ns=1_000 + k,
        )
        for k in range(n_rounds)
    ]
    return Trajectory(
        request_id=f"req-{writer}-{i}",
        writer_id=writer,
        drafter_version="v3",
        prompt_ids=[1, 2, 3, i],
        output_ids=[4, 5, i],
        rounds=rounds,
        domain="math" if i % 2 else None,
        created_ns=123_456_789 + i,
    )


def shard_files(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.endswith(".parquet") and n[0] not in "._")


def all_rows(batches) -> list[str]:
    return [t.request_id for b in batches for t in b.trajectories()]


# -- schema and conversion -----------------------------------------------------------------


def test_schema_has_version_and_types():
    assert TRAJECTORY_SCHEMA.metadata[SCHEMA_VERSION_KEY] == SCHEMA_VERSION.encode()
    rounds = TRAJECTORY_SCHEMA.field("rounds").type.value_type
    assert rounds.field("anchor").type == pa.int32()
    assert rounds.field("accepted").type == pa.int16()
    assert rounds.field("pred").type == pa.float32()
    assert TRAJECTORY_SCHEMA.field("domain").nullable
    assert not TRAJECTORY_SCHEMA.field("request_id").nullable


def test_round_trip_several_rounds(tmp_path):
    trajs = [make_traj(i, n_rounds=3) for i in range(3)]
    trajs.append(Trajectory("req-nan", "w0", "v3", [1], [], rounds=[Round(0, [5], [5], 1, 1, t_ns=9)]))
    table = to_arrow(trajs)
    assert table.schema.equals(TRAJECTORY_SCHEMA, check_metadata=True)
    assert from_arrow(table)[:3] == trajs[:3]

    with ShardWriter(tmp_path, "w0", rows_per_shard=100) as w:
        for t in trajs:
            w.append(t)
    (batch,) = ShardReader(tmp_path).poll()
    back = batch.trajectories()
    assert back[:3] == trajs[:3]
    assert back[0].rounds[2].pred == 0.5 and back[0].rounds[2].draft == [0, 2, 7, 8]
    assert back[1].domain == "math" and back[0].domain is None
    assert math.isnan(back[3].rounds[0].pred) and back[3].output_ids == []


def test_invalid_rows_rejected_at_append(tmp_path):
    w = ShardWriter(tmp_path, "w0")
    with pytest.raises(ValueError):
        w.append(Trajectory("r", "w0", "v", [1], [2], rounds=[Round(0, [1], [1], 70_000, 1)]))
    with pytest.raises(ValueError):
        w.append(Trajectory(None, "w0", "v", [1], [2]))  # type: ignore[arg-type]
    assert w.buffered_rows == 0
    with pytest.raises(ValueError):
        ShardWriter(tmp_path, "_hidden")


# -- writer --------------------------------------------------------------------------------


def test_rotation_by_rows_per_shard(tmp_path):
    w = ShardWriter(tmp_path, "w0", rows_per_shard=4)
    flushed = [w.append(make_traj(i)) for i in range(10)]
    assert [f for f in flushed if f] == ["w0-00000001.parquet", "w0-00000002.parquet"]
    assert w.buffered_rows == 2
    assert w.close() == "w0-00000003.parquet"
    assert shard_files(tmp_path) == [f"w0-0000000{k}.parquet" for k in (1, 2, 3)]
    assert [pq.read_metadata(tmp_path / n).num_rows for n in shard_files(tmp_path)] == [4, 4, 2]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    with pytest.raises(RuntimeError):
        w.append(make_traj(0))


def test_flush_by_age_on_next_append(tmp_path):
    w = ShardWriter(tmp_path, "w0", rows_per_shard=1000, max_age_s=0.05)
    assert w.append(make_traj(0)) is None
    time.sleep(0.08)
    assert w.append(make_traj(1)) == "w0-00000001.parquet"
    assert pq.read_metadata(tmp_path / "w0-00000001.parquet").num_rows == 2


def test_seq_continues_after_restart_even_if_shards_deleted(tmp_path):
    w = ShardWriter(tmp_path, "w0", rows_per_shard=1)
    w.append(make_traj(0))
    w.append(make_traj(1))
    w.close()
    w2 = ShardWriter(tmp_path, "w0", rows_per_shard=1)
    assert w2.append(make_traj(2)) == "w0-00000003.parquet"
    w2.close()  # one live writer per writer_id (the journal's lock refuses a second)
    # Another writer's numbering is independent.
    assert ShardWriter(tmp_path, "w1").next_seq == 1
    # Consume + delete everything: a restarted writer still never reuses a consumed name.
    r = ShardReader(tmp_path)
    r.commit(r.poll())
    r.retain("delete")
    assert shard_files(tmp_path) == []
    w3 = ShardWriter(tmp_path, "w0", rows_per_shard=1)
    assert w3.append(make_traj(3)) == "w0-00000004.parquet"
    assert all_rows(ShardReader(tmp_path).poll()) == ["req-w0-3"]


def test_two_threads_exact_row_count(tmp_path):
    w = ShardWriter(tmp_path, "w0", rows_per_shard=37)
    n = 300

    def work(tag):
        for i in range(n):
            w.append(make_traj(i, writer=tag, n_rounds=1))

    threads = [threading.Thread(target=work, args=(f"t{k}",)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    ids = all_rows(ShardReader(tmp_path).poll())
    assert len(ids) == 2 * n and len(set(ids)) == 2 * n
    sizes = [pq.read_metadata(tmp_path / s).num_rows for s in shard_files(tmp_path)]
    assert sum(sizes) == 2 * n and all(s == 37 for s in sizes[:-1])


# -- reader: exactly once ------------------------------------------------------------------


def test_exactly_once_across_reader_crash(tmp_path):
    w = ShardWriter(tmp_path, "w0", rows_per_shard=2)
    for i in range(6):
        w.append(make_traj(i))
    r1 = ShardReader(tmp_path)
    got = r1.poll()
    assert [b.name for b in got] == [f"w0-0000000{k}.parquet" for k in (1, 2, 3)]
    assert r1.poll() == []  # already handed out by this reader
    del r1  # "crash" between poll and commit

    r2 = ShardReader(tmp_path)
    again = r2.poll()
    assert [b.name for b in again] == [b.name for b in got]
    assert all_rows(again) == all_rows(got)
    r2.commit(again[:2])
    r2.commit(again[:1])  # idempotent

    r3 = ShardReader(tmp_path)
    assert [b.name for b in r3.poll()] == ["w0-00000003.parquet"]
    r3.commit(["w0-00000003.parquet"], tag={"step": 7})
    assert ShardReader(tmp_path).poll() == []
    st = ShardReader(tmp_path).stats()
    assert st["consumed_shards"] == 3 and st["consumed_rows"] == 6 and st["pending_shards"] == 0

    w.append(make_traj(6))
    w.flush()
    r4 = ShardReader(tmp_path)
    assert [b.name for b in r4.poll()] == ["w0-00000004.parquet"]
    with pytest.raises(KeyError):
        r4.commit(["nope-00000001.parquet"])


def test_torn_ledger_line_is_ignored(tmp_path):
    w = ShardWriter(tmp_path, "w0", rows_per_shard=1)
    w.append(make_traj(0))
    w.append(make_traj(1))
    r = ShardReader(tmp_path)
    r.commit(r.poll()[:1])
    with open(tmp_path / "_ledger.jsonl", "ab") as f:
        f.write(b'{"op": "consume", "shard": "w0-000')  # crash mid-append
    r2 = ShardReader(tmp_path)
    assert [b.name for b in r2.poll()] == ["w0-00000002.parquet"]
    r2.commit(["w0-00000002.parquet"])
    assert ShardReader(tmp_path).poll() == []


def test_poll_order_is_by_name_and_max_shards(tmp_path):
    for wid in ("b", "a"):
        w = ShardWriter(tmp_path, wid, rows_per_shard=1)
        w.append(make_traj(0, writer=wid))
        w.append(make_traj(1, writer=wid))
    r = ShardReader(tmp_path)
    first = r.poll(max_shards=3)
    assert [b.name for b in first] == ["a-00000001.parquet", "a-00000002.parquet", "b-00000001.parquet"]
    assert [b.name for b in r.poll()] == ["b-00000002.parquet"]
    r.rollback(first[:1])
    assert [b.name for b in r.poll()] == ["a-00000001.parquet"]


# -- quarantine ----------------------------------------------------------------------------


def _reason(root: Path, name: str) -> str:
    return (root / "_quarantine" / f"{name}.reason.txt").read_text()


def test_torn_shards_quarantined_and_reading_continues(tmp_path, caplog):
    w = ShardWriter(tmp_path, "w0", rows_per_shard=2)
    for i in range(6):
        w.append(make_traj(i))
    # Truncate shard 2 halfway, corrupt the middle of shard 3 (footer intact), add random bytes.
    p2 = tmp_path / "w0-00000002.parquet"
    data = p2.read_bytes()
    p2.write_bytes(data[: len(data) // 2])
    p3 = tmp_path / "w0-00000003.parquet"
    data = bytearray(p3.read_bytes())
    mid = 4 + (len(data) - 4) // 4
    data[mid : mid + 64] = os.urandom(64)
    p3.write_bytes(bytes(data))
    (tmp_path / "junk-00000001.parquet").write_bytes(os.urandom(3000))

    with caplog.at_level(logging.WARNING, logger="adaflash.buffer"):
        got = ShardReader(tmp_path).poll()
    assert [b.name for b in got] == ["w0-00000001.parquet"]
    assert all_rows(got) == ["req-w0-0", "req-w0-1"]
    for name in ("w0-00000002.parquet", "w0-00000003.parquet", "junk-00000001.parquet"):
        assert (tmp_path / "_quarantine" / name).exists()
        assert not (tmp_path / name).exists()
        assert "torn" in _reason(tmp_path, name)
        assert name in caplog.text
    assert ShardReader(tmp_path).stats()["quarantined_shards"] == 3


def test_foreign_schema_quarantined(tmp_path):
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "foreign-00000001.parquet")
    bad_version = to_arrow([make_traj(0)]).replace_schema_metadata({SCHEMA_VERSION_KEY: b"999"})
    pq.write_table(bad_version, tmp_path / "future-00000001.parquet")
    renamed = (
        to_arrow([make_traj(0)])
        .rename_columns([c if c != "domain" else "topic" for c in TRAJECTORY_SCHEMA.names])
        .replace_schema_metadata(TRAJECTORY_SCHEMA.metadata)
    )
    pq.write_table(renamed, tmp_path / "renamed-00000001.parquet")
    w = ShardWriter(tmp_path, "w0")
    w.append(make_traj(1))
    w.flush()
    assert [b.name for b in ShardReader(tmp_path).poll()] == ["w0-00000001.parquet"]
    assert "foreign schema" in _reason(tmp_path, "foreign-00000001.parquet")
    assert "version '999'" in _reason(tmp_path, "future-00000001.parquet")
    assert "fields differ" in _reason(tmp_path, "renamed-00000001.parquet")


def test_empty_shards_quarantined(tmp_path):
    pq.write_table(TRAJECTORY_SCHEMA.empty_table(), tmp_path / "e-00000001.parquet")
    (tmp_path / "e-00000002.parquet").write_bytes(b"")
    assert ShardReader(tmp_path).poll() == []
    assert "empty shard (0 rows)" in _reason(tmp_path, "e-00000001.parquet")
    assert "0 bytes" in _reason(tmp_path, "e-00000002.parquet")
    assert shard_files(tmp_path) == []


def test_hidden_files_ignored(tmp_path):
    w = ShardWriter(tmp_path, "w0")
    w.append(make_traj(0))
    w.flush()
    (tmp_path / ".w9-00000001.parquet.tmp").write_bytes(b"half a shard")
    (tmp_path / "_notes.parquet").write_bytes(b"x")
    (tmp_path / ".hidden.parquet").write_bytes(b"x")
    r = ShardReader(tmp_path)
    assert [b.name for b in r.poll()] == ["w0-00000001.parquet"]
    assert not (tmp_path / "_quarantine").exists()
    assert (tmp_path / ".w9-00000001.parquet.tmp").exists()
    # A writer removes only its own stale temp files.
    (tmp_path / ".w0-00000002.parquet.tmp").write_bytes(b"stale")
    w.close()  # one live writer per writer_id
    ShardWriter(tmp_path, "w0")
    assert not (tmp_path / ".w0-00000002.parquet.tmp").exists()
    assert (tmp_path / ".w9-00000001.parquet.tmp").exists()


# -- retention -----------------------------------------------------------------------------


def test_retention_delete_never_touches_pending(tmp_path):
    w = ShardWriter(tmp_path, "w0", rows_per_shard=1)
    for i in range(4):
        w.append(make_traj(i))
    r = ShardReader(tmp_path)
    batches = r.poll()
    before = {n: (tmp_path / n).read_bytes() for n in shard_files(tmp_path)}
    assert r.retain("delete")["removed"] == []  # polled but not committed: untouched
    assert r.retain("compact")["archive"] is None
    r.commit(batches[:2])
    out = r.retain("delete")
    assert out["removed"] == ["w0-00000001.parquet", "w0-00000002.parquet"]
    assert shard_files(tmp_path) == ["w0-00000003.parquet", "w0-00000004.parquet"]
    for n in shard_files(tmp_path):
        assert (tmp_path / n).read_bytes() == before[n]
    st = ShardReader(tmp_path).stats()
    assert st["pending_shards"] == 2 and st["pending_rows"] == 2
    assert st["consumed_shards"] == 2 and st["consumed_present_shards"] == 0
    assert [b.name for b in ShardReader(tmp_path).poll()] == shard_files(tmp_path)


def test_retention_of_named_shards_and_their_commit_tags_survive_a_restart(tmp_path):
    """What the trainer's retention needs: each consumed shard's round tag and size from the ledger
    (also in a new reader), and retain(names=...) removing only those consumed shards."""
    w = ShardWriter(tmp_path, "w0", rows_per_shard=1)
    for i in range(4):
        w.append(make_traj(i))
    r = ShardReader(tmp_path)
    b = r.poll()
    r.commit(b[:1], tag=1)
    r.commit(b[1:3], tag=2)
    names = [x.name for x in b]
    sizes = [(tmp_path / n).stat().st_size for n in names]
    r2 = ShardReader(tmp_path)  # after a restart
    assert r2.consumed_present() == [(names[0], 1, sizes[0]), (names[1], 2, sizes[1]), (names[2], 2, sizes[2])]
    out = r2.retain("delete", names=[names[0], names[3]])  # names[3] is pending: never touched
    assert out["removed"] == [names[0]] and shard_files(tmp_path) == names[1:]
    assert [n for n, _, _ in ShardReader(tmp_path).consumed_present()] == names[1:3]


def test_retention_compact(tmp_path):
    w = ShardWriter(tmp_path, "w0", rows_per_shard=2)
    for i in range(7):
        w.append(make_traj(i))
    w.close()  # shards 1..4 (2, 2, 2, 1 rows)
    r = ShardReader(tmp_path)
    batches = r.poll()
    r.commit(batches[:3])
    pending_before = (tmp_path / "w0-00000004.parquet").read_bytes()
    out = r.retain("compact")
    assert out["removed"] == [b.name for b in batches[:3]]
    archive = tmp_path / "_compacted" / out["archive"]
    table = pq.read_table(archive)
    assert table.num_rows == 6
    assert [t.request_id for t in from_arrow(table)] == [f"req-w0-{i}" for i in range(6)]
    assert shard_files(tmp_path) == ["w0-00000004.parquet"]
    assert (tmp_path / "w0-00000004.parquet").read_bytes() == pending_before
    assert not [n for n in os.listdir(archive.parent) if n.endswith(".tmp")]
    # The archive is never polled; the pending shard still is, exactly once.
    r2 = ShardReader(tmp_path)
    assert [b.name for b in r2.poll()] == ["w0-00000004.parquet"]
    st = r2.stats()
    assert st["compacted_files"] == 1 and st["compacted_rows"] == 6
    assert r2.retain("compact")["archive"] is None  # nothing consumed left


# -- crash safety --------------------------------------------------------------------------

_CHILD = r"""
import sys, numpy as np
from adaflash.buffer import ShardWriter, Trajectory, Round
root = sys.argv[1]
w = ShardWriter(root, "w0", rows_per_shard=10**9, max_age_s=None)
for s in range(3):
    for i in range(5):
        w.append(Trajectory(f"small-{s}-{i}", "w0", "v1", [1, 2, 3], [4, 5], [Round(3, [4], [4], 1, 1)]))
    w.flush()
print("FLUSHED", flush=True)
rng = np.random.default_rng(0)
rounds = [Round(5, list(range(16)), list(range(16)), 3, 16, 0.5) for _ in range(8)]
prompt, out = rng.integers(0, 49152, 3000), rng.integers(0, 49152, 1500)
k = 0
while True:  # keep writing big shards until killed
    for i in range(600):
        w.append(Trajectory(f"big-{k}-{i}", "w0", "v1", prompt, out, rounds))
    k += 1
    w.flush()
"""


def test_kill_9_while_writing(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        env=env,
        cwd=str(REPO),
    )
    try:
        assert proc.stdout.readline().strip() == b"FLUSHED"
        deadline = time.monotonic() + 60
        seen_tmp = False
        while time.monotonic() < deadline and proc.poll() is None:
            if any(n.startswith(".w0-") and n.endswith(".tmp") for n in os.listdir(tmp_path)):
                seen_tmp = True
                break
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert seen_tmp, "never caught the writer mid-shard"
    assert proc.returncode == -signal.SIGKILL

    leftovers = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert leftovers  # killed mid-write: a hidden temp file is left behind
    names = shard_files(tmp_path)
    assert names[:3] == ["w0-00000001.parquet", "w0-00000002.parquet", "w0-00000003.parquet"]

    r = ShardReader(tmp_path)
    batches = r.poll()
    assert [b.name for b in batches] == names  # every published shard is readable
    assert not (tmp_path / "_quarantine").exists()  # no torn shard is visible
    ids = all_rows(batches)
    assert ids[:15] == [f"small-{s}-{i}" for s in range(3) for i in range(5)]
    assert all(b.num_rows == 600 for b in batches[3:])

    w = ShardWriter(tmp_path, "w0", rows_per_shard=1)  # cleans its stale temp file
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    # the shard torn by the kill is published from the writer's journal: its 600 rows are not lost
    (torn,) = r.poll()
    assert torn.name not in names and torn.name > names[-1] and torn.num_rows == 600
    assert len({t.request_id for t in torn.trajectories()} - set(ids)) == 600
    new = w.append(Trajectory("after", "w0", "v1", [1], [2]))
    assert new not in names and new > torn.name
    assert [b.name for b in r.poll()] == [new]


# -- the writer's journal: rows survive kill -9 -----------------------------------------------

_JOURNAL_CHILD = """
import sys, time
sys.path.insert(0, {tests!r})
from adaflash.buffer import ShardWriter
from test_buffer import make_traj
w = ShardWriter({root!r}, "node-dead", rows_per_shard=100, max_age_s=None)
for i in range(5):
    w.append(make_traj(i))
print("appended", flush=True)
time.sleep(600)
"""


def test_rows_appended_before_a_kill_9_are_published_by_the_next_writer(tmp_path):
    import signal
    import subprocess
    import sys

    code = _JOURNAL_CHILD.format(tests=str(Path(__file__).parent), root=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "appended"
        with pytest.raises(RuntimeError, match="another live ShardWriter uses writer_id 'node-dead'"):
            ShardWriter(tmp_path, "node-dead")
        alive = ShardWriter(tmp_path, "node-a")  # the dead writer's journal is locked while it lives
        assert shard_files(tmp_path) == []
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    ShardWriter(tmp_path, "node-b").close()
    assert shard_files(tmp_path) == ["node-dead-00000001.parquet"]
    (batch,) = ShardReader(tmp_path).poll()
    assert [t.request_id for t in batch.trajectories()] == [make_traj(i).request_id for i in range(5)]
    alive.append(make_traj(7))
    assert alive.close() == "node-a-00000001.parquet"
    assert os.listdir(tmp_path / "_journal") == []  # closed writers leave no journal


def test_a_torn_journal_tail_is_dropped_and_published_rows_are_not_published_twice(tmp_path):
    import shutil

    w = ShardWriter(tmp_path, "w0", rows_per_shard=100, max_age_s=None)
    for i in range(3):
        w.append(make_traj(i))
    journal = tmp_path / "_journal" / "w0.arrows"
    shutil.copy(journal, tmp_path / "before-flush.arrows")
    assert w.close() == "w0-00000001.parquet"
    # a crash between publishing the shard and emptying the journal: the shard is not written twice
    shutil.copy(tmp_path / "before-flush.arrows", tmp_path / "_journal" / "w-crashed.arrows")
    (tmp_path / "_writers" / "w-crashed.seq").write_text("1\n")
    shutil.move(tmp_path / "w0-00000001.parquet", tmp_path / "w-crashed-00000001.parquet")
    ShardWriter(tmp_path, "w1").close()
    assert shard_files(tmp_path) == ["w-crashed-00000001.parquet"]
    # ...nor after the trainer consumed and deleted it
    r = ShardReader(tmp_path)
    r.commit(r.poll())
    r.retain("delete")
    shutil.copy(tmp_path / "before-flush.arrows", tmp_path / "_journal" / "w-crashed.arrows")
    ShardWriter(tmp_path, "w2").close()
    assert shard_files(tmp_path) == []
    # a journal whose last row was torn by the crash: the whole rows before it are published
    data = (tmp_path / "before-flush.arrows").read_bytes()
    (tmp_path / "_journal" / "w-torn.arrows").write_bytes(data[:-40])
    ShardWriter(tmp_path, "w3").close()
    (batch,) = ShardReader(tmp_path, ledger_path=tmp_path / "other-ledger.jsonl").poll()
    assert batch.name == "w-torn-00000001.parquet" and 1 <= batch.num_rows < 3
