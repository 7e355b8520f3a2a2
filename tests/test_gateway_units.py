"""Gateway parts with an injected clock (no sleeping): the circuit breaker and the routers."""

from __future__ import annotations

import pytest
from fakes import FakeClock as Clock

from pagellm.gateway.breaker import BreakerState, CircuitBreaker
from pagellm.gateway.routing import Replica, Router


def test_breaker_opens_probes_and_closes():
    clock = Clock(step=0.0)
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
    clock = Clock(step=0.0)
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


# ----- keys and limits ------------------------------------------------------------------------

from pagellm.gateway.limits import KeyRing, TokenBucket, hash_key  # noqa: E402


def test_token_bucket_refills_per_minute_and_says_how_long_to_wait():
    clock = Clock(step=0.0)
    bucket = TokenBucket(60, clock)  # 1 token per second
    assert bucket.take(60) == 0.0
    assert bucket.take(3) == pytest.approx(3.0)  # nothing taken
    clock.now = 2.0
    assert bucket.take(2) == 0.0
    assert bucket.take(61) == float("inf")  # can never fit
    bucket.give_back(100)
    assert bucket.level == 60


def _ring(clock, **limits):
    entry = {"name": "a", "key_sha256": hash_key("secret-a"), "models": ["m"], **limits}
    return KeyRing([entry, {"name": "b", "key_sha256": hash_key("secret-b")}], clock)


def test_keys_are_identified_by_hash():
    ring = _ring(Clock(step=0.0))
    assert ring.identify("Bearer secret-a").name == "a"
    assert ring.identify("Bearer secret-b").name == "b"
    assert ring.identify("Bearer nope") is None and ring.identify(None) is None
    assert ring.identify("secret-a") is None  # not a bearer token
    assert all(len(k.key_sha256) == 64 for k in ring.keys)  # only hashes are kept


def test_model_concurrency_and_request_limits():
    clock = Clock(step=0.0)
    ring = _ring(clock, max_concurrent=2, requests_per_minute=3)
    key = ring.identify("Bearer secret-a")
    assert ring.admit(key, "other", 1).status == 404
    assert ring.admit(key, "m", 1) is None and ring.admit(key, "m", 1) is None
    denied = ring.admit(key, "m", 1)
    assert denied.status == 429 and "concurrent" in denied.message
    ring.settle(key, 1, 1)
    assert ring.admit(key, "m", 1) is None  # third request of the minute
    ring.settle(key, 1, 1)
    denied = ring.admit(key, "m", 1)
    assert denied.status == 429 and denied.retry_after == pytest.approx(20.0)  # 3/min refill
    clock.now = 20.0
    assert ring.admit(key, "m", 1) is None


def test_token_limit_charges_then_refunds_unused_tokens():
    clock = Clock(step=0.0)
    ring = _ring(clock, tokens_per_minute=100)
    key = ring.identify("Bearer secret-a")
    assert ring.admit(key, "m", 80) is None
    assert ring.admit(key, "m", 30).status == 429  # 20 left
    ring.settle(key, 80, 30)  # it used 30: 50 come back
    assert ring.admit(key, "m", 60) is None
    assert ring.admit(key, "m", 101).retry_after is None  # larger than the bucket: never


def test_forwarded_body_carries_the_keys_priority_and_tenant():
    from pagellm.gateway.intake import apply_policy, estimate_tokens

    ring = _ring(Clock(step=0.0), priority=3, tenant="team-a")
    key = ring.identify("Bearer secret-a")
    body = {"model": "m", "prompt": "x" * 40, "max_tokens": 10, "user": "someone"}
    out = apply_policy(body, key)
    assert out["priority"] == 3 and out["user"] == "team-a" and body["user"] == "someone"
    assert estimate_tokens(body, 10) == 11 + 10  # ceil(42 characters with quotes / 4) + 10
    assert estimate_tokens({"messages": [], "n": 2}, 256) == 1 + 2 * 256
    assert estimate_tokens({"prompt": ["a", "b", "c"], "n": 2}, 5) == 4 + 3 * 2 * 5
    assert estimate_tokens({"prompt": [1, 2, 3]}, 5, [3]) == 3 + 5  # token ids: one prompt


def test_least_load_counts_what_the_replicas_report():
    rs = _replicas(3)
    rs[0].scraped_requests = 6  # busy with other clients' requests
    rs[1].outstanding = 2
    rs[2].outstanding, rs[2].scraped_kv_usage = 2, 0.9  # as many, but its cache is fuller
    assert Router("least-load").choose(rs) is rs[1]
    rs[1].scraped_requests = 7
    assert Router("least-load").choose(rs) is rs[2]


def test_reloaded_keys_keep_their_in_flight_count_and_bucket_levels():
    from pagellm.gateway.limits import KeyRing, hash_key

    clock = Clock(step=0.0)
    entry = {"name": "a", "key_sha256": hash_key("secret-a"), "max_concurrent": 2,
             "requests_per_minute": 3}  # fmt: skip
    old = KeyRing([entry], clock)
    key = old.identify("Bearer secret-a")
    assert old.admit(key, None, 0) is None and old.admit(key, None, 0) is None
    new = KeyRing([{**entry, "tenant": "t"}, {"key": "secret-b"}], clock, previous=old)
    reloaded = new.identify("Bearer secret-a")
    assert reloaded.tenant == "t" and reloaded.in_flight == 2
    assert new.admit(reloaded, None, 0).status == 429  # still two in flight
    old.settle(key, 0, 0)  # a request admitted before the reload ends: counted on the new one
    assert reloaded.in_flight == 1
    assert new.admit(reloaded, None, 0) is None  # the third of the minute
    new.settle(reloaded, 0, 0)
    new.settle(reloaded, 0, 0)
    denied = new.admit(reloaded, None, 0)  # the bucket kept its level across the reload
    assert denied.status == 429 and "requests-per-minute" in denied.message
    assert new.identify("Bearer secret-b") is not None


def test_config_errors_name_the_key(tmp_path):
    from pagellm.gateway.config import ConfigError, read_fleet

    cfg = tmp_path / "g.yaml"
    for text, named in (
        ("backends: [http://a]\nroutes: 1\n", "routes"),
        ("backends: [http://a]\nkeys: [{key: k, colour: red}]\n", "colour"),
        ("backends: [http://a]\nkeys: [{name: n}]\n", "key_sha256"),
        ("backends: [http://a]\noverload: {max_load: lots}\n", "max_load"),
        ("overload: {queue_depth: 3}\n", "queue_depth"),
        ("keys: []\n", "at least one replica"),
    ):
        cfg.write_text(text)
        with pytest.raises(ConfigError, match=named):
            read_fleet(cfg)
    cfg.write_text("backends: [http://a/]\nfallbacks: [http://q]\noverload: {max_load: 8}\n")
    fleet = read_fleet(cfg, ("http://b",))
    assert fleet.backends == ("http://a", "http://b") and fleet.fallbacks == ("http://q",)
    assert fleet.overload.max_load == 8 and fleet.overload.queue_size == 0


def test_admission_queue_is_first_come_first_served():
    import asyncio

    from pagellm.gateway.overload import AdmissionQueue

    async def scenario() -> list[str]:
        queue, room, order = AdmissionQueue(Clock(step=0.0)), [0], []

        async def request(name: str) -> None:
            if await queue.wait_turn(lambda: room[0] > 0, timeout=60):
                room[0] -= 1  # takes its slot before it next awaits
                order.append(name)

        first = asyncio.create_task(request("first"))
        await asyncio.sleep(0)
        second = asyncio.create_task(request("second"))
        await asyncio.sleep(0)
        assert len(queue) == 2 and order == []
        room[0] = 1
        queue.notify()
        for _ in range(10):  # let the woken waiters run (no time passes)
            await asyncio.sleep(0)
        assert order == ["first"] and len(queue) == 1  # only the head left
        room[0] = 1
        queue.notify()
        await asyncio.gather(first, second)
        return order

    assert asyncio.run(scenario()) == ["first", "second"]


def test_admission_queue_times_out_on_the_injected_clock():
    import asyncio

    from pagellm.gateway.overload import AdmissionQueue

    async def scenario() -> bool:
        clock = Clock(step=0.0)
        queue = AdmissionQueue(clock)
        waiter = asyncio.create_task(queue.wait_turn(lambda: False, timeout=5))
        await asyncio.sleep(0)
        clock.now = 6.0  # past its deadline: the next look says no
        queue.notify()
        return await waiter

    assert asyncio.run(scenario()) is False


def test_max_tokens_cap_and_stream_usage():
    from pagellm.gateway.app import _cap_tokens
    from pagellm.gateway.events import EventSplitter, usage_of

    body = {"max_tokens": 100}
    assert _cap_tokens(body, 16) and body == {"max_tokens": 16}
    body = {"max_completion_tokens": 8}
    assert not _cap_tokens(body, 16) and body == {"max_completion_tokens": 8}
    body = {}
    assert _cap_tokens(body, 16) and body == {"max_tokens": 16}
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}\n\n'
    assert usage_of(usage) == (12, True)
    both = b'data: {"choices":[1],"usage":{"prompt_tokens":1,"completion_tokens":1}}'
    assert usage_of(both) == (2, False)  # a usage on an event with choices: not usage alone
    assert usage_of(b'data: {"choices":[1]}\n\n') is None
    assert usage_of(b'data: {"usage":{"prompt_tokens":5,"comp') is None  # cut: the charge stands
    splitter = EventSplitter(limit=128)
    stream = b'data: {"choices":[1]}\n\n' + usage + b"data: [DONE]\r\n\r\n"
    events = [e for i in range(0, len(stream), 7) for e in splitter.feed(stream[i : i + 7])]
    assert events == [b'data: {"choices":[1]}\n\n', usage, b"data: [DONE]\r\n\r\n"]
    assert splitter.feed(b"x" * 200) == [b"x" * 200] and splitter.rest() == b""  # over the limit


def test_admission_queue_keeps_a_line_per_model():
    import asyncio

    from pagellm.gateway.overload import AdmissionQueue

    async def scenario() -> list[str]:
        queue, room, order = AdmissionQueue(Clock(step=0.0)), {"a": 0, "b": 0}, []

        async def request(name: str, model: str) -> None:
            if await queue.wait_turn(lambda: room[model] > 0, timeout=60, model=model):
                room[model] -= 1
                order.append(name)

        waiters = [asyncio.create_task(request(n, m)) for n, m in (("a1", "a"), ("b1", "b"),
                                                                   ("a2", "a"))]  # fmt: skip
        for _ in range(3):
            await asyncio.sleep(0)
        assert len(queue) == 3 and queue.waiting("a") == 2 and queue.waiting("b") == 1
        room["b"] = 1  # b has room while a stays full: b's request need not wait behind a's
        queue.notify()
        for _ in range(10):
            await asyncio.sleep(0)
        assert order == ["b1"] and queue.waiting("b") == 0 and queue.waiting("a") == 2
        room["a"] = 2
        queue.notify()
        await asyncio.gather(*waiters)
        return order

    assert asyncio.run(scenario()) == ["b1", "a1", "a2"]  # first come first served within a


def test_a_negative_charge_never_fills_a_bucket():
    bucket = TokenBucket(100, Clock())
    with pytest.raises(ValueError):
        bucket.take(-1_000_000_000)
    assert bucket.level == 100
