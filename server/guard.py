"""Live acceptance per drafter version, and the automatic rollback of a promoted version that does worse.

The trainer's gate judges a version on held-out rounds; this judges it on live traffic. Every finished
request adds its tau (tokens per verification round) to the version that served it. Once the version
promoted last and the one it replaced each have `window` requests (the predecessor's from before the
swap), a one-sided Welch test on per-request tau decides: when the new version is worse by at least
`min_drop` (relative) and by `z` standard errors (z = 3: about one chance in 700 for equal versions),
the `champion` alias moves back to the predecessor, both versions get a tag saying why, and the
hot-swapper swaps back on its next poll. A single unlucky request cannot do it; a version is judged
once. Live tau per version is exported to Prometheus and tagged on the version in MLflow.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque

log = logging.getLogger("adaflash.server")


def worse(new: list[float], old: list[float], z: float, min_drop: float) -> tuple[bool, float]:
    """One-sided Welch test that `new` has a lower mean than `old`; -> (clearly worse, z statistic)."""
    mn, mo = sum(new) / len(new), sum(old) / len(old)
    var = lambda xs, m: sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1)  # noqa: E731
    se = math.sqrt(var(new, mn) / len(new) + var(old, mo) / len(old))
    stat = (mo - mn) / se if se > 0 else (math.inf if mo > mn else 0.0)
    return stat >= z and mn <= (1 - min_drop) * mo, stat


class LiveGuard:
    """Per-version live tau (engine thread: `observe`) and the rollback check (its own thread)."""

    def __init__(self, registry, version: str, window: int, z: float, min_drop: float, node: str, interval_s: float):
        self.registry, self.window, self.z, self.min_drop, self.node = registry, window, z, min_drop, node
        self.interval_s = interval_s
        self.current = str(version)
        self.pred: dict[str, str] = {}  # promoted version -> the version it replaced
        self.judged: set[str] = set()  # versions already judged (or restored by a rollback)
        self.samples: dict[str, deque] = {}  # version -> recent per-request tau
        self.rollbacks = 0
        self._tagged: dict[str, int] = {}  # version -> sample count last reported to MLflow
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="adaflash-guard", daemon=True)

    def start(self) -> "LiveGuard":
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        self._halt.set()
        self._thread.join(timeout)

    def observe(self, reason: str, stats: dict) -> None:
        """Runner callback for every finished request: its tau counts for the version that served it."""
        if reason in ("stop", "length") and stats.get("tau") is not None and stats.get("drafter_version") is not None:
            with self._lock:
                self.samples.setdefault(str(stats["drafter_version"]), deque(maxlen=4 * self.window)).append(float(stats["tau"]))

    def on_event(self, event: dict) -> None:
        """Hot-swapper callback: a swap makes the new version the one to judge against its predecessor."""
        if event.get("event") == "swap":
            with self._lock:
                new, old = str(event["version"]), self.current
                if new != old and new not in self.judged:
                    self.pred[new] = old
                self.current = new

    def live(self) -> dict[str, tuple[float, int]]:
        """version -> (mean live tau, requests) over the recent window."""
        with self._lock:
            return {v: (sum(xs) / len(xs), len(xs)) for v, xs in self.samples.items() if xs}

    def _loop(self) -> None:
        while not self._halt.wait(self.interval_s):
            try:
                self.check()
                self._report()
            except Exception as e:  # the registry may be down: keep serving, try again next interval
                log.warning("live guard: %s: %s", type(e).__name__, e)

    def check(self) -> dict | None:
        """Judge the current version once both windows are full; roll back if it is clearly worse."""
        with self._lock:
            new = self.current
            old = self.pred.get(new)
            if old is None or new in self.judged:
                return None
            a, b = list(self.samples.get(new, ())), list(self.samples.get(old, ()))
            if len(a) < self.window or len(b) < self.window:
                return None
            a, b = a[-self.window :], b[-self.window :]
            self.judged.add(new)
        bad, stat = worse(a, b, self.z, self.min_drop)
        ma, mb = sum(a) / len(a), sum(b) / len(b)
        if not bad:
            log.info("live guard: version %s live tau %.3f vs %.3f for %s (z=%.2f): kept", new, ma, mb, old, stat)
            return None
        reason = (
            f"live tau {ma:.3f} over {len(a)} requests vs {mb:.3f} for v{old} (z={stat:.1f} >= {self.z}, "
            f"drop {1 - ma / mb:.0%} >= {self.min_drop:.0%}); champion moved back to v{old} by {self.node} "
            f"at {time.strftime('%Y-%m-%d %H:%M:%S')}"
        )
        self.registry.set_champion(old)
        self.registry.tag_version(new, "rolled_back", reason)
        self.registry.tag_version(old, "restored", f"champion again after v{new} was rolled back: {reason}")
        with self._lock:
            self.judged.add(old)  # swapping back to it is a restore, not a promotion to judge
            self.rollbacks += 1
        log.warning("live guard: rolled back version %s: %s", new, reason)
        return {"version": new, "restored": old, "reason": reason}

    def _report(self) -> None:
        """Tag each version's live tau in MLflow when it has new samples (readable in the UI)."""
        for version, (mean, n) in self.live().items():
            if self._tagged.get(version) != n:
                self.registry.tag_version(version, f"live_tau.{self.node}", f"{mean:.3f} over the last {n} requests")
                self._tagged[version] = n
