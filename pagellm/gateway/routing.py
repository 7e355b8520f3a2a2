"""Replica state and routing policies: round-robin, least-load, power-of-two, prefix-affinity.

A policy picks one replica among the candidates (healthy, serving the model) for a request.
Least-load uses each replica's load: the requests the gateway has outstanding there or, if
larger, the running + waiting requests the replica reports at /metrics, plus its KV usage. Prefix-affinity
hashes the start of the prompt so requests sharing a system prompt or a conversation history go
to the same replica (hitting its prefix cache), unless that replica is much busier than the
least loaded one.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

from pagellm.gateway.breaker import CircuitBreaker

ROUTING_POLICIES = ("least-load", "prefix-affinity", "round-robin", "power-of-two")


@dataclass(eq=False)
class Replica:
    url: str
    breaker: CircuitBreaker
    models: set[str] = field(default_factory=set)
    outstanding: int = 0
    """Requests the gateway has in flight at this replica."""
    scraped_requests: float = 0.0
    """Running + waiting requests the replica itself reported at the last health check (its
    /metrics: other clients and gateways count there too)."""
    scraped_kv_usage: float = 0.0
    fallback: bool = False
    """Used only when every primary replica is saturated or down."""

    @property
    def load(self) -> float:
        """Least-load's measure: the larger of what this gateway and the replica count, with
        KV-cache usage (0..1) breaking ties."""
        return max(self.outstanding, self.scraped_requests) + self.scraped_kv_usage

    def serves(self, model: str | None) -> bool:
        return model is None or not self.models or model in self.models


class Router:
    def __init__(self, policy: str, seed: int = 0, affinity_chars: int = 512, slack: int = 4):
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose from {ROUTING_POLICIES}")
        self.policy = policy
        self.rng = random.Random(seed)
        self.affinity_chars = affinity_chars
        self.slack = slack
        """Prefix-affinity gives up its replica when it has this many more requests than the
        least loaded one."""
        self._next = 0

    def choose(self, candidates: list[Replica], prompt_key: str = "") -> Replica:
        if not candidates:
            raise LookupError("no replica can serve the request")
        if self.policy == "round-robin":
            replica = candidates[self._next % len(candidates)]
            self._next += 1
            return replica
        least = min(candidates, key=lambda r: r.load)
        if self.policy == "least-load" or len(candidates) == 1:
            return least
        if self.policy == "power-of-two":
            a, b = self.rng.sample(candidates, 2)
            return a if a.load <= b.load else b
        home = max(candidates, key=lambda r: _weight(prompt_key[: self.affinity_chars], r.url))
        return home if home.load - least.load < self.slack else least


def _weight(key: str, url: str) -> int:
    """Rendezvous hashing: a replica leaving moves only the keys that lived on it."""
    return int.from_bytes(hashlib.sha256(f"{url}\0{key}".encode()).digest()[:8], "big")
