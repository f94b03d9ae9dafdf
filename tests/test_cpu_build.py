"""kernels/cpu_build: a build left half-done by a killed process does not hang the next one."""

import threading

from kernels import cpu_build

SOURCE = """#include <pybind11/pybind11.h>
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", [] { return 42; }); }
"""


def test_a_stale_torch_baton_from_a_killed_build_does_not_block_the_next(tmp_path, monkeypatch):
    """torch's cpp_extension waits, forever, while <build dir>/lock exists; a process killed mid-build leaves it
    (a CI run hung on it). build() holds its own flock, so it knows that file is stale and removes it."""
    monkeypatch.setenv("ADAFLASH_KERNEL_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "probe_cpu.cpp"
    source.write_text(SOURCE)
    (cpu_build._build_dir("stale_probe", source) / "lock").write_text("")  # what a killed builder leaves
    out = {}
    worker = threading.Thread(target=lambda: out.update(ext=cpu_build.build("stale_probe", source, "none")), daemon=True)
    try:
        worker.start()
        worker.join(timeout=120)  # the probe builds in ~6 s
        assert not worker.is_alive(), "build() waited on a stale lock file"
        assert out["ext"] is not None and out["ext"].answer() == 42
        assert not (cpu_build._build_dir("stale_probe", source) / "lock").exists()
    finally:
        cpu_build._built.pop("stale_probe", None)


def test_deepspeeds_stale_jit_lock_is_cleared_before_a_start(tmp_path):
    """A lock file left by a trainer killed while DeepSpeed JIT-built its CPU comm op is removed before the next
    start (torch would wait on it forever); a young one, a build in progress, is waited for until it goes."""
    import os
    import threading
    import time

    from adaflash.distributed import STALE_BUILD_S, clear_stale_build_locks

    old, live = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "other_op" / "lock"
    for lock in (old, live):
        lock.parent.mkdir()
        lock.write_text("")
    os.utime(old, (time.time() - STALE_BUILD_S - 60,) * 2)
    finish = threading.Timer(1.0, live.unlink)  # the live build ends a second later
    finish.start()
    t0 = time.perf_counter()
    assert clear_stale_build_locks(str(tmp_path)) == [old]
    assert time.perf_counter() - t0 >= 0.9 and not old.exists() and not live.exists()
