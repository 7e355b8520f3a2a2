"""The gateway's Prometheus metrics (a registry per gateway, no globals). Label values are
bounded: key names come from the config, replicas from the fleet, models only from those the
replicas serve."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "pagellm_gateway:requests",
            "Requests by API key name, model ('unknown' unless a replica serves it and the key "
            "was checked), replica ('gateway' when answered here) and status.",
            ["key", "model", "replica", "status"],
            registry=self.registry,
        )
        self.retries = Counter(
            "pagellm_gateway:retries",
            "Requests retried on another replica.",
            registry=self.registry,
        )
        self.upstream_latency = Histogram(
            "pagellm_gateway:upstream_response_seconds",
            "Time from sending upstream to the replica's response headers.",
            ["replica"],
            registry=self.registry,
        )
        self.breaker = Gauge(
            "pagellm_gateway:breaker_state",
            "Circuit breaker per replica: 0 closed, 1 half-open, 2 open.",
            ["replica"],
            registry=self.registry,
        )
        self.breaker_opens = Counter(
            "pagellm_gateway:breaker_opens",
            "Times a replica's circuit breaker opened (or re-opened after a failed probe).",
            ["replica"],
            registry=self.registry,
        )
        self.outstanding = Gauge(
            "pagellm_gateway:outstanding",
            "Requests the gateway has in flight at each replica.",
            ["replica"],
            registry=self.registry,
        )
        self.key_in_flight = Gauge(
            "pagellm_gateway:key_in_flight",
            "Requests in flight per API key name.",
            ["key"],
            registry=self.registry,
        )
        self.overload = Counter(
            "pagellm_gateway:overload_actions",
            "Overload steps taken: capped (max_tokens), fallback, queued, rejected (503).",
            ["action"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "pagellm_gateway:queue_depth",
            "Requests waiting at the gateway for a replica with room.",
            registry=self.registry,
        )
        self.reloads = Counter(
            "pagellm_gateway:config_reloads",
            "Reloads of the config file, by result (ok, error).",
            ["result"],
            registry=self.registry,
        )
        self.background_errors = Counter(
            "pagellm_gateway:background_errors",
            "Unexpected errors in a background loop (logged; the loop went on), by loop.",
            ["loop"],
            registry=self.registry,
        )

    def forget_replica(self, url: str) -> None:
        """Drop a replica's series when it leaves the fleet (a restarted cluster replica comes
        back at a new address: its old series must not pile up). ``requests`` keeps its
        history of what each address served: it grows per replica restart, not per request."""
        for family in (self.breaker, self.breaker_opens, self.outstanding, self.upstream_latency):
            with contextlib.suppress(KeyError):
                family.remove(url)
