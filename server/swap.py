"""The serving side of the registry: a poller that hot-swaps the engine's drafter when `champion` moves."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from adaflash.drafter import drafter_dtype_of, load_drafter_and_head
from adaflash.registry import Registry, RegistryUnavailable, _transient

log = logging.getLogger("adaflash.registry")


class HotSwapper:
    """Daemon thread: polls `champion`; on change downloads, loads and checks the version, then
    `engine.swap(drafter, head, version)`. Refused versions are remembered and not retried.
    on_event(dict) is called with {"event": "swap" | "refused" | "poll_error", "version", "detail"}."""

    def __init__(
        self,
        registry: Registry,
        engine,
        target,
        cache_dir: str | Path,
        interval_s: float = 5.0,
        on_event: Callable[[dict], None] | None = None,
        max_backoff_s: float = 60.0,
    ):
        self.registry, self.engine, self.target = registry, engine, target
        self.cache_dir, self.interval_s, self.max_backoff_s = Path(cache_dir), interval_s, max_backoff_s
        self.on_event = on_event
        self.version = str(engine.version)  # the version serving (staged in the engine)
        self.swaps = self.refused = self.poll_errors = 0
        self.refused_versions: dict[str, str] = {}  # version -> reason
        self._errors_in_row = 0
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="adaflash-hotswap", daemon=True)

    def start(self) -> "HotSwapper":
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        self._halt.set()
        self._thread.join(timeout)

    def metrics(self) -> dict:
        return {"swaps": self.swaps, "refused": self.refused, "poll_errors": self.poll_errors, "version": self.version}

    def _emit(self, event: str, version: str | None, detail: str = "") -> None:
        if self.on_event is not None:
            try:
                self.on_event({"event": event, "version": version, "detail": detail})
            except Exception:
                log.exception("hot-swap on_event callback failed")

    def _loop(self) -> None:
        delay = 0.0
        while not self._halt.wait(delay):
            delay = self.poll()

    def poll(self) -> float:
        """One poll; -> seconds until the next (longer while the registry is down)."""
        try:
            version = self.registry.champion()
        except Exception as e:
            return self._poll_error(e)
        self._errors_in_row = 0
        if version is None or version == self.version or version in self.refused_versions:
            return self.interval_s
        try:
            path = self.registry.download(version, self.cache_dir)
            drafter, head = self._load(path)
            self.engine.swap(drafter, head, version)
        except Exception as e:
            if isinstance(e, RegistryUnavailable) or _transient(e):
                return self._poll_error(e)
            return self._refuse(version, e)
        log.info("hot-swap: version %s -> %s (live from the next engine step)", self.version, version)
        self.version = version
        self.swaps += 1
        self._emit("swap", version)
        return self.interval_s

    def _poll_error(self, e: Exception) -> float:
        self.poll_errors += 1
        self._errors_in_row += 1
        delay = min(self.max_backoff_s, self.interval_s * 2**self._errors_in_row)
        log.warning(
            "hot-swap: registry poll failed (%s: %s); version %s keeps serving, next poll in %.1f s",
            type(e).__name__,
            e,
            self.version,
            delay,
        )
        self._emit("poll_error", None, str(e))
        return delay

    def _refuse(self, version: str, e: Exception) -> float:
        self.refused += 1
        reason = f"{type(e).__name__}: {e}"
        self.refused_versions[version] = reason
        log.error("hot-swap: refused version %s (%s); version %s keeps serving", version, reason, self.version)
        self._emit("refused", version, reason)
        return self.interval_s

    def _load(self, path: Path):
        current = self.engine.drafter
        dtype = drafter_dtype_of(current) if current is not None else None  # the form of the one serving
        return load_drafter_and_head(path, self.target, dtype)
