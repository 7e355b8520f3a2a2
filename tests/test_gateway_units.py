"""Gateway parts with an injected clock (no sleeping): the circuit breaker and the routers."""

from __future__ import annotations

import pytest

from pagellm.gateway.breaker import BreakerState, CircuitBreaker
from pagellm.gateway.routing import Replica, Router


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_probes_and_closes():
    clock = Clock()
    b = CircuitBreaker(clock, failure_threshold=3, reset_after=5.0)
    for _ in range(2):
        b.record_failure()
    assert b.state is BreakerState.CLOSED and b.allows()
    b.record_failure()
    assert b.state is BreakerState.OPEN and not b.allows()
    clock.now = 5.0
    assert b.state is BreakerState.HALF_OPEN
    assert b.allows() and not b.allows()  # one probe at a time
    b.record_failure()  # the probe failed: open again, cool-down restarts
    assert b.state is BreakerState.OPEN
    clock.now = 10.0
    assert b.allows()
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.failures == 0


def _replicas(n: int) -> list[Replica]:
    clock = Clock()
    return [Replica(f"http://r{i}", CircuitBreaker(clock)) for i in range(n)]


def test_round_robin_and_least_load():
    rs = _replicas(3)
    rr = Router("round-robin")
    assert [rr.choose(rs).url for _ in range(4)] == [
        "http://r0",
        "http://r1",
        "http://r2",
        "http://r0",
    ]
    rs[0].outstanding, rs[1].outstanding, rs[2].outstanding = 5, 1, 3
    assert Router("least-load").choose(rs) is rs[1]


def test_power_of_two_takes_the_lighter_of_two():
    rs = _replicas(2)
    rs[0].outstanding = 10
    router = Router("power-of-two", seed=1)
    assert all(router.choose(rs) is rs[1] for _ in range(10))


def test_prefix_affinity_is_sticky_and_yields_to_load():
    rs = _replicas(4)
    router = Router("prefix-affinity", slack=4)
    homes = {router.choose(rs, f"system prompt {i}").url for i in range(40)}
    assert len(homes) > 1  # keys spread over replicas
    home = router.choose(rs, "shared system prompt")
    assert all(router.choose(rs, "shared system prompt") is home for _ in range(5))
    others = [r for r in rs if r is not home]
    assert router.choose(others + [home], "shared system prompt") is home  # order-independent
    home.outstanding = 4  # much busier than the idle others: fall back to least load
    assert router.choose(rs, "shared system prompt") is not home
    home.outstanding = 0
    # a replica leaving moves only its own keys (rendezvous hashing)
    keys = [f"k{i}" for i in range(60)]
    before = {k: router.choose(rs, k) for k in keys}
    after = {k: router.choose(rs[1:], k) for k in keys}
    assert all(after[k] is before[k] for k in keys if before[k] is not rs[0])


def test_unknown_routing_policy():
    with pytest.raises(ValueError, match="unknown routing policy"):
        Router("random-walk")
