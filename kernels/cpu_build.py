"""Build a C++ CPU kernel of this package once per machine and cache it (the twin of every kernel's `load`).

Compiled with torch's cpp_extension and the system's g++ (``-O3 -march=native -ffp-contract=off``: the
compiler fuses no multiply-add, so an operation gives the same bits in a vector or alone; ``-fopenmp``,
without which at::parallel_for runs on one thread) into
~/.cache/adaflash/kernels/<name>-<hash of source, torch version and CPU flags> (or $ADAFLASH_KERNEL_CACHE).
Where the build fails (no compiler) the caller gets None and a warning that says what to install.

A build holds an flock on <build dir>/.build.lock, which the OS drops when the process dies: torch's own
baton (<build dir>/lock, a file that only its creator removes) is left behind by a process killed mid-build
(a server stopped while it compiles), and every later load would wait on it forever. Under the flock no
live build of ours owns that file, so it is removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import threading
import time
import warnings
from pathlib import Path

import torch
from platformdirs import user_cache_dir

CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp"]  # -fopenmp: at::parallel_for runs threads
_lock = threading.Lock()
_built: dict[str, object] = {}
log = logging.getLogger("adaflash.kernels")


def _build_dir(name: str, source: Path, cflags: list[str] = CFLAGS) -> Path:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what the sources include
    included = re.findall(r'^#include "(\w+\.cpp)"', source.read_text(), flags=re.M)  # kernels built into this one
    sources = source.read_bytes() + b"".join((source.parent / f).read_bytes() for f in included) + headers
    parts = sources + torch.__version__.encode() + flags.encode() + " ".join(cflags).encode()
    key = hashlib.sha256(parts).hexdigest()[:16]
    base = os.environ.get("ADAFLASH_KERNEL_CACHE") or Path(user_cache_dir("adaflash")) / "kernels"
    root = Path(base) / f"{name}-{key}"
    root.mkdir(parents=True, exist_ok=True)
    return root


def signature() -> str:
    """A short hash of every kernel source and the build flags: cached step costs measured with other
    kernels (adaflash/cost.py) are stale."""
    digest = hashlib.sha256(" ".join(CFLAGS).encode())
    for src in sorted([*Path(__file__).parent.glob("*.cpp"), *Path(__file__).parent.glob("*.h")]):
        digest.update(src.read_bytes())
    return digest.hexdigest()[:12]


def build(name: str, source: Path, fallback: str, arch: str | None = None):
    """The compiled extension `name` from `source`, or None with a warning naming `fallback` (what the
    caller does instead); built once per process, cached across processes. Once built it is a dict
    lookup: kernels are looked up on every norm, rotary and attention call of a step. `arch`: built for
    that -march instead of this CPU's (as `name`_`arch`), so a test runs the code an older CPU gets."""
    cflags = CFLAGS if arch is None else [*CFLAGS, f"-march={arch}"]  # the last -march wins
    name = name if arch is None else f"{name}_{arch.replace('-', '_')}"
    if name in _built:
        return _built[name]
    with _lock:
        if name not in _built:
            try:
                from torch.utils.cpp_extension import load as cpp_load

                root = _build_dir(name, source, cflags)
                fresh = not (root / f"adaflash_{name}.so").exists()  # a first start on this machine (or new sources) waits for g++
                if fresh:
                    log.info("compiling the C++ CPU kernel %s with g++ (once per machine and source: kept in %s)", name, root)
                t0 = time.perf_counter()
                with open(root / ".build.lock", "w") as held:
                    fcntl.flock(held, fcntl.LOCK_EX)  # one build per directory across processes; dropped if we die
                    (root / "lock").unlink(missing_ok=True)  # torch's baton, stale: its builder is gone
                    _built[name] = cpp_load(
                        name=f"adaflash_{name}",
                        sources=[str(source)],
                        extra_cflags=cflags,
                        extra_ldflags=["-fopenmp"],
                        build_directory=str(root),
                        verbose=False,
                    )
                if fresh:
                    log.info("compiled %s in %.0f s", name, time.perf_counter() - t0)
            except Exception as e:  # no compiler, no ninja, a failed build
                warnings.warn(
                    f"CPU kernel {name} not built ({type(e).__name__}: {str(e)[:300]}); {fallback} "
                    "(install a C++ compiler, e.g. apt install g++, to build it)",
                    stacklevel=3,
                )
                _built[name] = None
        return _built[name]
