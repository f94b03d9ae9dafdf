"""Prometheus metrics of a serving node, in their own registry (not the process-global one).

Totals and gauges are read from the runner, engine and hot-swapper at scrape time by a custom
collector, so the engine thread only bumps plain integers; latencies are histograms observed when
a request finishes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)


class _Collector:
    def __init__(self, state):
        self.state = state  # app.ServerState: runner, swapper, ready

    def collect(self):
        st = self.state
        yield GaugeMetricFamily("adaflash_ready", "1 once the models are loaded and the engine runs", value=int(st.ready))
        runner = st.runner
        if runner is None:
            return
        c, engine = runner.counters, runner.engine
        req = CounterMetricFamily("adaflash_requests", "finished requests by finish reason", labels=["finish_reason"])
        for reason in ("stop", "length", "cancelled", "error"):
            req.add_metric([reason], c.requests[reason])
        yield req
        for name, doc, value in [
            ("adaflash_prompt_tokens", "prompt tokens of admitted requests", c.prompt_tokens),
            ("adaflash_generated_tokens", "output tokens committed", c.generated_tokens),
            ("adaflash_engine_steps", "engine steps", c.steps),
            ("adaflash_verify_rounds", "verification rounds (one per running request per step)", c.rounds),
            (
                "adaflash_drafted_rounds",
                "verification rounds that verified a draft or a lookup token (the rest decoded plainly)",
                c.drafted_rounds,
            ),
            ("adaflash_verify_tokens", "tokens the target verified (anchor included)", c.verify_tokens),
            ("adaflash_trajectory_rows", "finished requests appended to the trajectory buffer", c.rows_written),
            ("adaflash_trajectory_shards", "trajectory shards published", len(runner.writer.shards_written) if runner.writer else 0),
            ("adaflash_trajectory_errors", "trajectories that could not be recorded", c.trajectory_errors),
            (
                "adaflash_trajectory_rows_inexact",
                "rows a stock engine could not cut into exact rounds, written without them (the trainer skips them)",
                engine.stats.get("rows_inexact", 0),
            ),
            (
                "adaflash_schedule_updates",
                "times vLLM's draft length per batch size was re-chosen from live acceptance (policy cost)",
                engine.stats.get("schedule_updates", 0),
            ),
            ("adaflash_engine_step_errors", "engine steps that raised (their requests failed)", c.step_errors),
            ("adaflash_drafter_swaps", "drafter swaps that went live in the engine", engine.stats["swaps"]),
        ] + self._swapper_counters():
            yield CounterMetricFamily(name, doc, value=value)
        recent = runner.recent()
        for name, doc, value in [
            ("adaflash_tokens_per_second", f"output tokens per second over the last {runner.WINDOW_S:.0f} s", recent["tokens_per_s"]),
            ("adaflash_tau", f"tokens committed per verification round over the last {runner.WINDOW_S:.0f} s (NaN: none)", recent["tau"]),
            (
                "adaflash_verify_tokens_per_step",
                f"verified tokens per engine step over the last {runner.WINDOW_S:.0f} s",
                recent["verify_tokens_per_step"],
            ),
            (
                "adaflash_drafted_round_share",
                f"share of verification rounds that verified a draft over the last {runner.WINDOW_S:.0f} s (NaN: none)",
                recent["drafted_share"],
            ),
            ("adaflash_queue_depth", "requests waiting for a batch slot", runner.queue_depth),
            ("adaflash_running_requests", "requests in the running batch", runner.running),
        ]:
            yield GaugeMetricFamily(name, doc, value=float("nan") if value is None else value)
        for name, kind, doc, value in engine.policy.state():
            yield (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(f"adaflash_policy_{name}", doc, value=value)
        guard = st.guard
        if guard is not None:
            tau = GaugeMetricFamily("adaflash_live_tau", "mean tau of recent finished requests, per drafter version", labels=["version"])
            n = GaugeMetricFamily("adaflash_live_tau_requests", "requests behind adaflash_live_tau", labels=["version"])
            for version, (mean, count) in sorted(guard.live().items()):
                tau.add_metric([version], mean)
                n.add_metric([version], count)
            yield tau
            yield n
            yield CounterMetricFamily("adaflash_rollbacks", "versions this node rolled back on live tau", value=guard.rollbacks)
        yield InfoMetricFamily(
            "adaflash_drafter", "drafter serving new requests", value={"version": str(engine.version), "policy": engine.policy.name}
        )

    def _swapper_counters(self) -> list:
        sw = self.state.swapper
        return [
            ("adaflash_registry_swaps", "registry versions swapped in", getattr(sw, "swaps", 0)),
            ("adaflash_registry_refused_versions", "registry versions refused (wrong target, bad weights)", getattr(sw, "refused", 0)),
            ("adaflash_registry_poll_errors", "registry polls that failed", getattr(sw, "poll_errors", 0)),
        ]


class ServerMetrics:
    def __init__(self, state):
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "adaflash_time_to_first_token_seconds", "submit to first token", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.latency = Histogram(
            "adaflash_request_latency_seconds", "submit to finish of completed requests", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.registry.register(_Collector(state))

    def observe(self, reason: str, stats: dict) -> None:
        """Runner callback (engine thread) for every finished request."""
        if reason in ("stop", "length") and stats.get("ttft_s") is not None:
            self.ttft.observe(stats["ttft_s"])
            self.latency.observe(stats["latency_s"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
