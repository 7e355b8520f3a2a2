"""API keys and their limits at the gateway: a key is stored as its SHA-256 and compared in
constant time; each key may have allowed models, a requests-per-minute and a tokens-per-minute
token bucket, a cap on concurrent requests, and a priority and tenant passed to the replicas.
Buckets run on an injected clock. A key's running state (requests in flight, buckets) lives
apart from its settings so that reloading the keys keeps it."""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class TokenBucket:
    """``capacity`` tokens, refilled at ``capacity`` per minute."""

    def __init__(self, capacity: float, clock: Callable[[], float]) -> None:
        self.capacity = capacity
        self.rate = capacity / 60.0
        self.clock = clock
        self.level = capacity
        self.updated = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def take(self, amount: float) -> float:
        """Take ``amount`` if available and return 0.0; otherwise take nothing and return the
        seconds until it will be (inf if it never fits)."""
        self._refill()
        if amount <= self.level:
            self.level -= amount
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self.level) / self.rate

    def give_back(self, amount: float) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + amount)


@dataclass
class KeyState:
    """What a key is using now; carried over when the keys are reloaded."""

    in_flight: int = 0
    buckets: dict[str, TokenBucket] = field(default_factory=dict)


@dataclass
class KeyPolicy:
    name: str
    key_sha256: str
    models: frozenset[str] | None = None
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_concurrent: int | None = None
    priority: int | None = None
    tenant: str | None = None
    state: KeyState = field(default_factory=KeyState)

    @property
    def in_flight(self) -> int:
        return self.state.in_flight

    @property
    def buckets(self) -> dict[str, TokenBucket]:
        return self.state.buckets


@dataclass(frozen=True, slots=True)
class Denied:
    status: int
    message: str
    retry_after: float | None = None
    code: str | None = None


class KeyRing:
    """The configured keys. With none configured the gateway is open (no auth)."""

    def __init__(
        self,
        entries: list[dict[str, Any]],
        clock: Callable[[], float],
        previous: KeyRing | None = None,
    ) -> None:
        self.clock = clock
        old = {p.key_sha256: p for p in previous.keys} if previous else {}
        self.keys = [self._policy(e, old) for e in entries]

    def _policy(self, e: dict[str, Any], old: dict[str, KeyPolicy]) -> KeyPolicy:
        digest = e.get("key_sha256") or (hash_key(e["key"]) if e.get("key") else None)
        if not digest:
            raise ValueError(f"key {e.get('name')!r}: give key_sha256 (or key)")
        p = KeyPolicy(
            name=str(e.get("name") or digest[:8]),
            key_sha256=str(digest).lower(),
            models=frozenset(e["models"]) if e.get("models") else None,
            requests_per_minute=e.get("requests_per_minute"),
            tokens_per_minute=e.get("tokens_per_minute"),
            max_concurrent=e.get("max_concurrent"),
            priority=e.get("priority"),
            tenant=e.get("tenant"),
        )
        before = old.get(p.key_sha256)
        kept = dict(before.buckets) if before else {}
        if before is not None:  # a reload: in-flight requests and bucket levels carry over
            p.state.in_flight = before.state.in_flight
            before.state = p.state  # requests admitted under the old settings settle here
        for name, per_minute in (
            ("requests", p.requests_per_minute),
            ("tokens", p.tokens_per_minute),
        ):
            if name in kept and kept[name].capacity == per_minute:
                p.buckets[name] = kept[name]
            elif per_minute:
                p.buckets[name] = TokenBucket(per_minute, self.clock)
        return p

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def identify(self, authorization: str | None) -> KeyPolicy | None:
        """The key's policy, comparing against every stored hash in constant time."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        digest = hash_key(authorization[len("Bearer ") :])
        found = None
        for policy in self.keys:
            if hmac.compare_digest(policy.key_sha256, digest):
                found = policy
        return found

    def admit(self, policy: KeyPolicy, model: str | None, tokens: int) -> Denied | None:
        """Check model, concurrency and both buckets; on success count the request in flight
        and charge ``tokens`` (the caller settles the real count with ``settle``)."""
        if policy.models is not None and model not in policy.models:
            return Denied(404, f"the model {model!r} does not exist", code="model_not_found")
        if policy.max_concurrent is not None and policy.in_flight >= policy.max_concurrent:
            return Denied(429, "too many concurrent requests for this key", 1.0)
        requests = policy.buckets.get("requests")
        wait = requests.take(1) if requests else 0.0
        if wait:
            return Denied(429, "requests-per-minute limit reached", wait)
        bucket = policy.buckets.get("tokens")
        wait = bucket.take(tokens) if bucket else 0.0
        if wait:
            if requests:
                requests.give_back(1)
            if math.isinf(wait):
                return Denied(429, f"the request ({tokens} tokens) exceeds tokens-per-minute")
            return Denied(429, "tokens-per-minute limit reached", wait)
        policy.state.in_flight += 1
        return None

    def settle(self, policy: KeyPolicy, charged: int, used: int | None) -> None:
        """The request ended: it no longer counts in flight; refund what it did not use."""
        policy.state.in_flight -= 1
        bucket = policy.buckets.get("tokens")
        if bucket and used is not None and used < charged:
            bucket.give_back(charged - used)
