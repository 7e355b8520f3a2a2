"""Prometheus metrics at /metrics, read from the engine's counters at scrape time.

Names follow vLLM's (``pagellm:`` prefix) so existing dashboards carry over. A registry per app,
no globals.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagellm.engine.outputs import EngineStats


class EngineCollector(Collector):
    def __init__(self, stats: EngineStats, model_name: str) -> None:
        self.stats = stats
        self.labels = {"model_name": model_name}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(f"pagellm:{name}", doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(f"pagellm:{name}", doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        yield self._gauge("num_requests_running", "Sequences in the running batch.", s.num_running)
        yield self._gauge("num_requests_waiting", "Sequences waiting to run.", s.num_waiting)
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV blocks in use.", s.kv_usage)
        yield self._counter("prompt_tokens", "Prompt tokens received.", s.prompt_tokens)
        yield self._counter("generation_tokens", "Tokens generated.", s.generation_tokens)
        yield self._counter("num_preemptions", "Preemptions by recompute.", s.num_preemptions)
        done = CounterMetricFamily(
            "pagellm:request_success",
            "Finished sequences by finish reason.",
            labels=[*self.labels, "finished_reason"],
        )
        for reason, count in sorted(dict(s.finished).items()):
            done.add_metric([*self.labels.values(), reason], count)
        yield done


def make_registry(stats: EngineStats, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(stats, model_name))
    return registry
