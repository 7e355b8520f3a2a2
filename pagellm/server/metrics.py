"""Prometheus metrics at /metrics, read from the engine's counters at scrape time.

Names follow vLLM's (``pagellm:`` prefix) so existing dashboards carry over. A registry per app,
no globals.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

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
        yield self._gauge(
            "num_requests_swapped", "Sequences swapped out to host memory.", s.num_swapped
        )
        yield self._counter("num_preemptions", "Preemptions (all modes).", s.num_preemptions)
        by_mode = CounterMetricFamily(
            "pagellm:num_preemptions_by_mode",
            "Preemptions by mode: swap or recompute.",
            labels=[*self.labels, "mode"],
        )
        swap = s.num_preemptions_swap
        by_mode.add_metric([*self.labels.values(), "swap"], swap)
        by_mode.add_metric([*self.labels.values(), "recompute"], s.num_preemptions - swap)
        yield by_mode
        yield self._counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        )
        yield self._counter(
            "prefix_cache_hits", "Looked-up tokens found cached.", s.prefix_cache_hits
        )
        yield self._counter("engine_steps", "Engine steps run.", s.num_steps)
        yield self._counter("engine_busy_seconds", "Wall time inside engine steps.", s.busy_seconds)
        yield self._counter(
            "engine_execute_seconds",
            "Wall time inside the model executor (inputs, forward, sampling).",
            s.execute_seconds,
        )
        for name, slot, doc in (
            ("tenant_requests_running", 0, "Running sequences per tenant (the API's user)."),
            ("tenant_requests_waiting", 1, "Waiting sequences per tenant (the API's user)."),
        ):
            g = GaugeMetricFamily(f"pagellm:{name}", doc, labels=[*self.labels, "tenant"])
            for tenant, counts in sorted(bounded_tenants(s.tenants).items()):
                g.add_metric([*self.labels.values(), tenant], counts[slot])
            yield g
        yield from self._spec_decode(s)
        yield from self._structured(s)
        done = CounterMetricFamily(
            "pagellm:request_success",
            "Finished sequences by finish reason.",
            labels=[*self.labels, "finished_reason"],
        )
        for reason, count in sorted(dict(s.finished).items()):
            done.add_metric([*self.labels.values(), reason], count)
        yield done

    def _structured(self, s: EngineStats) -> Iterator[Metric]:
        kinds = CounterMetricFamily(
            "pagellm:structured_output_requests",
            "Requests with structured outputs by kind (json, regex, choice, grammar, "
            "json_object; tool calls that a grammar enforces count as json).",
            labels=[*self.labels, "kind"],
        )
        for kind, count in sorted(dict(s.structured_output_requests).items()):
            kinds.add_metric([*self.labels.values(), kind], count)
        yield kinds
        yield self._counter(
            "structured_output_mask_seconds",
            "Time filling grammar token bitmasks before steps.",
            s.structured_mask_seconds,
        )
        yield self._counter(
            "structured_output_mask_steps",
            "Steps that filled grammar token bitmasks.",
            s.structured_mask_steps,
        )

    def _spec_decode(self, s: EngineStats) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters (zero while speculation is off)."""
        yield self._counter(
            "spec_decode_num_drafts", "Verify steps of sequences with proposals.", s.spec_num_drafts
        )
        yield self._counter(
            "spec_decode_num_draft_tokens", "Proposed tokens verified.", s.spec_num_draft_tokens
        )
        yield self._counter(
            "spec_decode_num_accepted_tokens",
            "Proposed tokens accepted.",
            s.spec_num_accepted_tokens,
        )
        per_pos = CounterMetricFamily(
            "pagellm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted proposed tokens by position in the proposal.",
            labels=[*self.labels, "position"],
        )
        for pos, count in enumerate(list(s.spec_accepted_per_pos)):
            per_pos.add_metric([*self.labels.values(), str(pos)], count)
        yield per_pos


MAX_TENANT_SERIES = 64
"""Tenants (the API's ``user``, chosen by clients) shown by name; the rest add up in one
series, so clients cannot grow the metric's label values without bound."""
OTHER_TENANTS = "_other"


def bounded_tenants(tenants: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The busiest ``MAX_TENANT_SERIES`` tenants by name, the others summed as ``_other``."""
    ranked = sorted(dict(tenants).items(), key=lambda kv: (-sum(kv[1]), kv[0]))
    shown = dict(ranked[:MAX_TENANT_SERIES])
    rest = [counts for _, counts in ranked[MAX_TENANT_SERIES:]]
    if rest:
        shown[OTHER_TENANTS] = (sum(r for r, _ in rest), sum(w for _, w in rest))
    return shown


class ThreadCpuCollector(Collector):
    """CPU seconds of the engine thread and of the thread serving HTTP (the event loop).

    ``collect`` runs inside the /metrics handler, on the event loop's thread, so
    ``time.thread_time()`` there is that thread's CPU time. Together with the step counters
    these show how much the HTTP side takes from the engine (see docs/architecture.md).
    """

    def __init__(self, engine_thread_cpu: Callable[[], float], model_name: str) -> None:
        self.engine_thread_cpu = engine_thread_cpu
        self.labels = {"model_name": model_name}

    def collect(self) -> Iterator[Metric]:
        for name, doc, value in (
            (
                "engine_thread_cpu_seconds",
                "CPU time of the engine thread.",
                self.engine_thread_cpu(),
            ),
            (
                "api_thread_cpu_seconds",
                "CPU time of the HTTP event-loop thread.",
                time.thread_time(),
            ),
        ):
            c = CounterMetricFamily(f"pagellm:{name}", doc, labels=list(self.labels))
            c.add_metric(list(self.labels.values()), value)
            yield c


class FillThreadCollector(Collector):
    """Grammar matching that ran past its bound (``pagellm.structured.fill_thread``): how many
    fills overran (each failed its request and left its thread behind), and how many of those
    threads still run (while ``max_overrun_fills`` do, constrained requests get 503)."""

    def __init__(self, fills: Any, model_name: str) -> None:
        """``fills``: the engine's ``FillThread`` (``abandoned``, ``left_running()``)."""
        self.fills = fills
        self.labels = {"model_name": model_name}

    def collect(self) -> Iterator[Metric]:
        overruns = CounterMetricFamily(
            "pagellm:structured_output_match_overruns",
            "Structured-output bitmask fills that ran past their bound (each failed its "
            "request and left its thread behind).",
            labels=list(self.labels),
        )
        overruns.add_metric(list(self.labels.values()), self.fills.abandoned)
        yield overruns
        left = GaugeMetricFamily(
            "pagellm:structured_output_fill_threads_left",
            "Threads left behind by overrunning fills that are still running.",
            labels=list(self.labels),
        )
        left.add_metric(list(self.labels.values()), self.fills.left_running())
        yield left


def make_registry(
    stats: EngineStats, model_name: str, engine_thread_cpu: Callable[[], float] | None = None
) -> CollectorRegistry:
    from prometheus_client import ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(stats, model_name))
    if engine_thread_cpu is not None:
        registry.register(ThreadCpuCollector(engine_thread_cpu, model_name))
    ProcessCollector(registry=registry)  # process_cpu_seconds_total, resident memory
    return registry


_LATENCY_BUCKETS = (
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


_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def grammar_compile_histogram(registry: CollectorRegistry, model_name: str) -> Callable:
    """``observe`` of the grammar compile-time histogram (compilations only, not cache hits)."""
    from prometheus_client import Histogram

    h = Histogram(
        "pagellm:structured_output_compile_seconds",
        "Time compiling a structured-output grammar (cache misses).",
        ["model_name"],
        registry=registry,
        buckets=_COMPILE_BUCKETS,
    )
    return h.labels(model_name).observe


def grammar_failure_counter(registry: CollectorRegistry, model_name: str) -> Callable:
    """``count(reason)`` of compilations that ended without a grammar: ``invalid`` (the
    compiler's error), ``deadline`` (worker killed past the compile deadline), ``crashed`` (the
    worker died on the constraint), ``aborted`` (a worker that did not start, a machine too
    busy, a grammar that could not be read back, or the server shut it down). Every reason's
    series exists from the start, at 0."""
    from prometheus_client import Counter

    c = Counter(
        "pagellm:structured_output_compile_failures",
        "Structured-output grammar compilations that failed, by reason.",
        ["model_name", "reason"],
        registry=registry,
    )
    for reason in ("invalid", "deadline", "crashed", "aborted"):
        c.labels(model_name, reason)
    return lambda reason: c.labels(model_name, reason).inc()


class RequestLatencies:
    """Histograms observed by the server as outputs arrive (same monotonic clock as the engine)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, recent: Any = None) -> None:
        """``recent``: also keep the last observations there (``ttft`` and ``itl`` deques of
        (time, seconds), the console's charts)."""
        from prometheus_client import Histogram

        self.recent = recent

        def histogram(name: str, doc: str) -> Histogram:
            h = Histogram(
                f"pagellm:{name}", doc, ["model_name"], registry=registry, buckets=_LATENCY_BUCKETS
            )
            return h.labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between output steps.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduling.")

    async def observe(self, gen, clock):
        """Pass ``gen``'s outputs through, timing them."""
        start = clock()
        last = None
        try:
            async for out in gen:
                now = clock()
                if last is None:
                    self.ttft.observe(now - start)
                    if self.recent is not None:
                        self.recent.ttft.append((now, now - start))
                else:
                    self.itl.observe(now - last)
                    if self.recent is not None:
                        self.recent.itl.append((now, now - last))
                last = now
                if out.finished:
                    self.e2e.observe(now - start)
                    m = out.metrics
                    if m.first_scheduled_time is not None:
                        self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
                yield out
        finally:
            await gen.aclose()  # a consumer that leaves early must abort the request now
