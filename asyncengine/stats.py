"""Engine metrics with prometheus_client, under vLLM's names with an `asyncengine:` prefix.

Each engine owns its registry, so several engines in one process (tests, benchmarks) never clash. The
registry's samples carry no model label (in-process readers ask for them by name alone); /metrics
exposes them through `exposition`, which labels each with the served `model_name`, as vLLM's are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    from asyncengine.output_processor import RequestState
    from asyncengine.scheduler import SchedulerOutput

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class _Labelled:
    """A collector: `registry`'s metrics with constant labels added to every sample."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry = registry
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**self.labels, **s.labels}) for s in family.samples]
            yield out


def exposition(registry: CollectorRegistry, model_name: str) -> bytes:
    """Prometheus' text format of `registry`, every sample labelled `model_name="..."` (vLLM's label)."""
    view = CollectorRegistry(auto_describe=False)
    view.register(_Labelled(registry, {"model_name": model_name}))
    return generate_latest(view)


class StatsSnapshot(NamedTuple):
    """The engine's counters and gauges at one moment (EngineStats.snapshot), for periodic log lines."""

    time: float  # time.monotonic()
    prompt_tokens: float  # totals since start
    generation_tokens: float
    running: int  # sequences now
    waiting: int
    kv_usage: float  # 0-1


class EngineStats:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("asyncengine:num_requests_running", "Sequences in the running set", registry=r)
        self.waiting = Gauge(
            "asyncengine:num_requests_waiting", "Sequences waiting to be scheduled", registry=r
        )
        self.kv_usage = Gauge(
            "asyncengine:kv_cache_usage_perc", "Share of KV blocks in use (0-1)", registry=r
        )
        self.kv_free_blocks = Gauge("asyncengine:kv_cache_free_blocks", "Free KV-cache blocks", registry=r)
        self.prompt_tokens = Counter("asyncengine:prompt_tokens", "Prefill tokens received", registry=r)
        self.generation_tokens = Counter("asyncengine:generation_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter("asyncengine:num_preemptions", "Preemptions by recompute", registry=r)
        self.request_success = Counter(
            "asyncengine:request_success", "Finished requests", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "asyncengine:time_to_first_token_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "asyncengine:inter_token_latency_seconds",
            "Time between tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "asyncengine:e2e_request_latency_seconds", "Request latency", buckets=LATENCY_BUCKETS, registry=r
        )
        self.steps = Counter("asyncengine:engine_steps", "Steps sent to the workers", registry=r)
        self.step_bytes = Counter(
            "asyncengine:execute_model_request_bytes", "Bytes of ExecuteModelRequests", registry=r
        )
        self.draft_tokens = Counter(
            "asyncengine:spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r
        )
        self.accepted_tokens = Counter(
            "asyncengine:spec_decode_num_accepted_tokens", "Draft tokens the model agreed with", registry=r
        )
        self.last_token_time: dict[int, float] = {}
        self.step_latencies: list[float] = []  # engine-observed step round trips (bounded)

    def snapshot(self) -> StatsSnapshot:
        """The totals and gauges now (the gauges' functions read the scheduler)."""

        def value(metric: Counter | Gauge) -> float:
            return metric.collect()[0].samples[0].value  # a counter's first sample is its _total

        return StatsSnapshot(
            time.monotonic(),
            value(self.prompt_tokens),
            value(self.generation_tokens),
            int(value(self.running)),
            int(value(self.waiting)),
            value(self.kv_usage),
        )

    def bind_scheduler(
        self,
        running: Callable[[], float],
        waiting: Callable[[], float],
        usage: Callable[[], float],
        free: Callable[[], float],
    ) -> None:
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.kv_usage.set_function(usage)
        self.kv_free_blocks.set_function(free)

    def on_arrival(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_new_token(self, state: RequestState, now: float) -> None:
        """A generated token (the first sets the request's first-token time)."""
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
            self.on_first_token(state, now)
        else:
            self.on_token(state, now)

    def on_first_token(self, state: RequestState, now: float) -> None:
        self.ttft.observe(now - state.metrics.arrival_time)
        self.generation_tokens.inc()

    def on_token(self, state: RequestState, now: float) -> None:
        if state.metrics.last_token_time is not None:
            self.itl.observe(now - state.metrics.last_token_time)
        self.generation_tokens.inc()

    def on_finished(self, state: RequestState) -> None:
        reason = next((s.finish_reason for s in state.seqs if s.finish_reason), "abort") or "abort"
        self.request_success.labels(finished_reason=reason).inc()
        if state.metrics.finished_time is not None:
            self.e2e.observe(state.metrics.finished_time - state.metrics.arrival_time)

    def on_drafts(self, proposed: int, accepted: int) -> None:
        self.draft_tokens.inc(proposed)
        self.accepted_tokens.inc(accepted)

    def on_step_sent(self, sched: SchedulerOutput, nbytes: int) -> None:
        self.steps.inc()
        self.step_bytes.inc(nbytes)
        if sched.num_preempted:
            self.preemptions.inc(sched.num_preempted)

    def on_step_done(self, sched: SchedulerOutput, seconds: float, execute_us: int) -> None:
        if len(self.step_latencies) < 100_000:
            self.step_latencies.append(seconds)
