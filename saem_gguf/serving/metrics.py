"""`GET /metrics`: Prometheus text from the scheduler's and the engine's figures, read at scrape time,
plus the server's own count of HTTP answers. One registry per server (no process-global state)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "saem_"


@dataclass(frozen=True)
class StatMetric:
    name: str  # without PREFIX (and without _total for counters: prometheus-client adds it)
    kind: type[Metric]
    key: str  # in Scheduler.stats()
    help: str
    scale: float = 1.0


STAT_METRICS = (
    StatMetric("requests", CounterMetricFamily, "requests", "Requests the scheduler accepted"),
    StatMetric("tokens_predicted", CounterMetricFamily, "tokens", "Generated tokens"),
    StatMetric("queue_length", GaugeMetricFamily, "queue_len", "Requests waiting for a slot"),
    StatMetric("busy_slots", GaugeMetricFamily, "busy_slots", "Slots decoding a sequence"),
    StatMetric("slots", GaugeMetricFamily, "n_parallel", "Slots (-np): sequences decoded together"),
    StatMetric("decode_steps", CounterMetricFamily, "decode_steps",
               "Decode steps (one token of each decoding sequence; llama-server's n_decode)"),
    StatMetric("mean_batch", GaugeMetricFamily, "mean_batch",
               "Mean sequences per decode step (llama-server's n_busy_slots_per_decode)"),
    StatMetric("expert_hit_rate", GaugeMetricFamily, "hit_rate",
               "Share of routed expert uses served from a GPU-resident slot"),
    StatMetric("expert_bytes_moved", CounterMetricFamily, "bytes_moved", "Bytes of experts copied to the GPU"),
    StatMetric("expert_copies", CounterMetricFamily, "copies", "Experts copied to the GPU"),
    StatMetric("stage_boundaries", CounterMetricFamily, "boundaries", "Stage boundaries the detector reported"),
    StatMetric("placement_updates", CounterMetricFamily, "plans", "Placement updates that changed residency"),
    StatMetric("prompt_tokens_cached", CounterMetricFamily, "prompt_tokens_cached",
               "Prompt tokens the prompt cache served (not evaluated)"),
    StatMetric("prompt_cache_entries", GaugeMetricFamily, "prompt_cache_entries",
               "Prompts held in the host-memory prompt cache (--cache-ram)"),
    StatMetric("prompt_cache_bytes", GaugeMetricFamily, "prompt_cache_bytes",
               "Bytes of KV state held in the host-memory prompt cache"),
)


class SchedulerCollector(Collector):
    """Each scrape reads ``stats()`` once; a figure the stats lack (a dense model has no
    placement) is left out rather than reported as 0. Tokens/s is averaged over the time since the
    previous scrape, as llama-server's gauges are (the first scrape: since the collector began)."""

    def __init__(self, stats: Callable[[], dict], clock: Callable[[], float] = time.monotonic) -> None:
        self._stats = stats
        self._clock = clock
        self._last = (clock(), 0)  # (time, tokens) at the previous scrape

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        tokens, now = stats.get("tokens"), self._clock()
        if isinstance(tokens, int):
            (then, before), self._last = self._last, (now, tokens)
            rate = GaugeMetricFamily(PREFIX + "tokens_per_second",
                                     "Generated tokens per second since the previous scrape")
            rate.add_metric([], (tokens - before) / (now - then) if now > then else 0.0)
            yield rate
        for m in STAT_METRICS:
            value = stats.get(m.key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                family = m.kind(PREFIX + m.name, m.help)
                family.add_metric([], float(value) * m.scale)
                yield family


class ServerMetrics:
    """The registry /metrics renders: the scheduler's figures and the HTTP answers by route and status."""

    def __init__(self, stats: Callable[[], dict], clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SchedulerCollector(stats, clock))
        self.http_responses = Counter(PREFIX + "http_responses", "HTTP answers by route and status",
                                      ("route", "status"), registry=self.registry)

    def count(self, route: str, status: int) -> None:
        self.http_responses.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
