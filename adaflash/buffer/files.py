"""Atomic file writes and naming rules shared by the buffer's writer and reader."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

WRITER_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
SEQ_DIR = "_writers"


def is_hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def fsync_dir(path: Path) -> None:
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
    fsync_dir(final.parent)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
