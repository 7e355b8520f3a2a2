"""API keys and their limits at the gateway: a key is stored as its SHA-256 and compared in
constant time; each key may have allowed models, a requests-per-minute and a tokens-per-minute
token bucket, a cap on concurrent requests, and a priority and tenant passed to the replicas.
Buckets run on an injected clock; a request is charged an upper bound of its tokens up front and
settled on what it really used (refunded, or charged the overage: a bucket may go into debt).
A key's running state (requests in flight, buckets) lives apart from its settings so that
reloading the keys keeps it."""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagellm.server.errors import quoted_name


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
        if amount < 0:
            raise ValueError(f"a negative charge ({amount}) would fill the bucket")
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

    def charge(self, amount: float) -> None:
        """Take ``amount`` whatever the level (below 0 is a debt the refill pays first)."""
        self._refill()
        self.level -= amount


@dataclass
class KeyState:
    """What a key is using now; carried over when the keys are reloaded."""

    in_flight: int = 0
    buckets: dict[str, TokenBucket] = field(default_factory=dict)


DEFAULT_MAX_TOKENS = 1024


@dataclass
class KeyPolicy:
    """One API key's settings (the config's ``keys`` entries) and its running state."""

    name: str
    key_sha256: str
    models: frozenset[str] | None = None
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    """Tokens (prompt + completion) a minute. A request is charged its prompt plus the most it
    may generate (max_tokens x n per prompt) when admitted, and settled on its usage."""
    max_concurrent: int | None = None
    priority: int | None = None
    """Sent to the replicas as the request's priority (replacing the client's)."""
    tenant: str | None = None
    """Sent to the replicas as the request's ``user`` (their fairness tenant)."""
    allow_client_priority: bool = False
    """Pass the client's ``priority`` on (the key's own when it gives none); otherwise it is
    dropped: without this, a client cannot raise its own priority."""
    allow_client_user: bool = False
    """Pass the client's ``user`` on (the tenant when it gives none); otherwise it is dropped."""
    max_tokens_default: int = DEFAULT_MAX_TOKENS
    """With a tokens_per_minute limit, a request that gives neither max_tokens nor
    max_completion_tokens is sent with max_tokens set to this, lowered to what the model's
    context (max_model_len, from the replicas' model cards) leaves after the prompt: the prompt
    counted with ``--tokenizer MODEL=PATH``, else bounded by its UTF-8 bytes plus 64. When not
    even one token surely fits, nothing is set and the request is charged the whole context
    (which the replica enforces). Its charge is then a real upper bound."""
    operator: bool = False
    """May read the fleet's state (the console's ``/ui/api/state`` and ``/metrics``). Once any
    key is an operator, only operators may: those views name every replica's URL and every
    key's name. With none, every key may (as it may read the model list)."""
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
        self.has_operators = any(p.operator for p in self.keys)
        """Some key is an operator's: then only operators read the fleet's state."""

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
            allow_client_priority=bool(e.get("allow_client_priority")),
            allow_client_user=bool(e.get("allow_client_user")),
            max_tokens_default=e.get("max_tokens_default") or DEFAULT_MAX_TOKENS,
            operator=bool(e.get("operator")),
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
        if policy.models is not None and model is None:  # it names no model: which, then?
            return Denied(400, "give 'model': this key may use only some of the models")
        if policy.models is not None and model not in policy.models:
            return Denied(
                404, f"the model {quoted_name(model)} does not exist", code="model_not_found"
            )
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
        """The request ended: it no longer counts in flight; refund what it did not use, or take
        what it used beyond its charge (``used`` None: unknown, the charge stands)."""
        policy.state.in_flight -= 1
        bucket = policy.buckets.get("tokens")
        if not bucket or used is None:
            return
        if used < charged:
            bucket.give_back(charged - used)
        elif used > charged:
            bucket.charge(used - charged)
