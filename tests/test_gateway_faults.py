"""The gateway against scripted replicas (tests/fake_replica.py): the breaker opening and closing
end to end, a stream cut mid-way, per-key concurrency with the key's tenant and priority reaching
the replica, the overload steps (cap, fallback, queue, 503), and reloading replicas and keys from
the config file without a restart."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from server_helpers import (
    API_KEY,
    AUTH,
    gateway_metric,
    running_fake,
    running_gateway,
    stream_outcome,
    wait_until,
)

from pagellm.gateway.limits import hash_key


def control(base: str, **script) -> None:
    httpx.post(f"{base}/control", json=script).raise_for_status()


def release(base: str) -> None:
    httpx.post(f"{base}/control/release").raise_for_status()


def fake_log(base: str) -> dict:
    return httpx.get(f"{base}/control/log").json()


def breaker(gw: str, replica: str) -> float:
    return gateway_metric(gw, f'pagellm_gateway:breaker_state{{replica="{replica}"}}')


def post(gw: str, body: dict, key: str = API_KEY, path: str = "/v1/completions"):
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{gw}{path}", json=body, headers=headers, timeout=30)


@pytest.fixture
def two_fakes():
    with running_fake() as (_, a), running_fake() as (_, b):
        yield a, b


def test_breaker_opens_on_failures_and_closes_when_the_replica_recovers(two_fakes):
    a, b = two_fakes
    with running_gateway(a, b) as gw:
        control(a, fail_status=502, healthy=False)  # 502: it cannot take requests (a 500 is
        for _ in range(4):  # relayed as its answer); retried on b, every request succeeds
            r = post(gw, {"model": "fake", "prompt": "x"})
            assert r.status_code == 200, r.text
        assert gateway_metric(gw, f'pagellm_gateway:breaker_opens_total{{replica="{a}"}}') >= 1
        assert breaker(gw, a) != 0  # open (half-open for a moment each cool-down)
        served_by_a = len(fake_log(a)["requests"])
        assert served_by_a <= 1  # the first failure opened it: no more traffic to a
        assert gateway_metric(gw, "pagellm_gateway:retries_total") == served_by_a
        control(a, fail_status=None, healthy=True)
        wait_until(lambda: breaker(gw, a) == 0, what="the breaker to close")  # probe succeeded
        for _ in range(4):
            assert post(gw, {"model": "fake", "prompt": "x"}).status_code == 200
        assert len(fake_log(a)["requests"]) > served_by_a  # a takes traffic again


def test_a_stream_cut_mid_way_ends_with_an_error_event(two_fakes):
    a, _ = two_fakes
    control(a, cut_after=2, events=5)
    with running_gateway(a) as gw:
        body = {"model": "fake", "prompt": "x", "stream": True}
        with httpx.stream("POST", f"{gw}/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            events = [ln[len("data: ") :] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert len(events) == 4  # two chunks, the error event, [DONE]
        assert "error" in events[2] and "mid-stream" in events[2]
        assert events[3] == "[DONE]"


def test_requests_held_by_a_replica_that_dies_are_retried_on_another(two_fakes):
    a, b = two_fakes
    control(a, hold=True)  # a sends its headers, then nothing
    with (
        running_fake() as (dying, c),
        running_gateway(c, b, extra=("--max-attempts", "3")) as gw,
        concurrent.futures.ThreadPoolExecutor(4) as pool,
    ):
        control(c, hold=True)
        body = {"model": "fake", "prompt": "x", "stream": True}
        results = [pool.submit(stream_outcome, gw, body) for _ in range(4)]
        wait_until(lambda: fake_log(c)["in_flight"] == 2, what="two streams held on c")
        dying.kill()  # c dies with two streams that have sent no event yet
        assert [f.result() for f in results] == ["done"] * 4  # all finished on b
        assert len(fake_log(b)["requests"]) == 4
        assert gateway_metric(gw, "pagellm_gateway:retries_total") == 2
        assert breaker(gw, c) != 0


KEYS_YAML = """
keys:
  - name: team-a
    key_sha256: {digest}
    max_concurrent: 2
    priority: 5
    tenant: team-a
    tokens_per_minute: 100000
"""


def test_per_key_concurrency_and_the_keys_tenant_and_priority(two_fakes, tmp_path):
    a, _ = two_fakes
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(KEYS_YAML.format(digest=hash_key("key-a")))
    control(a, hold=True)
    with running_gateway(a, extra=("--config", str(cfg))) as gw:
        body = {"model": "fake", "prompt": "x", "max_tokens": 8, "user": "someone"}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = [pool.submit(post, gw, body, "key-a") for _ in range(2)]
            wait_until(lambda: fake_log(a)["in_flight"] == 2, what="two requests held")
            over = post(gw, body, "key-a")
            assert over.status_code == 429 and int(over.headers["retry-after"]) >= 1
            assert "concurrent" in over.json()["error"]["message"]
            release(a)
            assert all(f.result().status_code == 200 for f in held)
        assert post(gw, body, "key-a").status_code == 200  # the slots came back
        seen = fake_log(a)["requests"]
        assert {s["body"]["user"] for s in seen} == {"team-a"}  # the key's tenant, not the client's
        assert {s["body"]["priority"] for s in seen} == {5}
        assert {s["authorization"] for s in seen} == {f"Bearer {API_KEY}"}  # never the client's key
        counted = 'pagellm_gateway:requests_total{key="team-a",model="fake",'
        auth = {"Authorization": "Bearer key-a"}
        assert gateway_metric(gw, counted + f'replica="{a}",status="200"}}', auth) == 3
        assert gateway_metric(gw, counted + 'replica="gateway",status="429"}', auth) == 1


OVERLOAD_YAML = """
fallbacks: [{fallback}]
overload:
  max_load: 1
  cap_at: 1
  max_tokens_cap: 16
  queue_size: 1
  queue_timeout: 30
"""


def test_overload_caps_then_falls_back_then_queues_then_refuses(two_fakes, tmp_path):
    primary, fallback = two_fakes
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(OVERLOAD_YAML.format(fallback=fallback))
    for fake in two_fakes:
        control(fake, hold=True)
    body = {"model": "fake", "prompt": "x", "max_tokens": 100}
    with (
        running_gateway(primary, extra=("--config", str(cfg)), health_interval=60) as gw,
        concurrent.futures.ThreadPoolExecutor(3) as pool,
    ):
        first = pool.submit(post, gw, body)  # the primary has room: as asked
        wait_until(lambda: fake_log(primary)["in_flight"] == 1, what="the primary busy")
        second = pool.submit(post, gw, body)  # the primary is full: capped, to the fallback
        wait_until(lambda: fake_log(fallback)["in_flight"] == 1, what="the fallback busy")
        third = pool.submit(post, gw, body)  # both full: waits at the gateway
        wait_until(lambda: gateway_metric(gw, "pagellm_gateway:queue_depth") == 1, what="queue")
        refused = post(gw, body)  # the queue is full
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "overloaded"
        assert refused.json()["error"]["type"] == "cluster_unavailable"
        release(primary)  # the first finishes; the queued one takes its place
        assert first.result().status_code == 200 and third.result().status_code == 200
        release(fallback)
        assert second.result().status_code == 200
        asked = [s["body"]["max_tokens"] for s in fake_log(primary)["requests"]]
        assert asked == [100, 16]  # the queued request was capped too
        assert [s["body"]["max_tokens"] for s in fake_log(fallback)["requests"]] == [16]
        for action, n in (("capped", 3), ("fallback", 1), ("queued", 1), ("rejected", 1)):
            line = f'pagellm_gateway:overload_actions_total{{action="{action}"}}'
            assert gateway_metric(gw, line) == n, action


def test_queued_requests_time_out_with_503(two_fakes, tmp_path):
    a, _ = two_fakes
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text("overload: {max_load: 1, queue_size: 4, queue_timeout: 0.5}\n")
    control(a, hold=True)
    with running_gateway(a, extra=("--config", str(cfg))) as gw:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(post, gw, {"model": "fake", "prompt": "x"})
            wait_until(lambda: fake_log(a)["in_flight"] == 1, what="the replica busy")
            late = post(gw, {"model": "fake", "prompt": "x"})
            assert late.status_code == 503 and late.json()["error"]["code"] == "overloaded"
            release(a)
            assert held.result().status_code == 200
        assert len(fake_log(a)["requests"]) == 1  # the timed-out request never reached it


def test_a_client_that_leaves_the_queue_never_reaches_a_replica(two_fakes, tmp_path):
    a, _ = two_fakes
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text("overload: {max_load: 1, queue_size: 4, queue_timeout: 60}\n")
    control(a, hold=True)
    body = {"model": "fake", "prompt": "x"}
    with (
        running_gateway(a, extra=("--config", str(cfg))) as gw,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        held = pool.submit(post, gw, body)
        wait_until(lambda: fake_log(a)["in_flight"] == 1, what="the replica busy")
        with pytest.raises(httpx.ReadTimeout):  # waits in the queue; the client gives up
            httpx.post(f"{gw}/v1/completions", json=body, headers=AUTH, timeout=0.5)
        wait_until(lambda: gateway_metric(gw, "pagellm_gateway:queue_depth") == 0,
                   what="the queue to forget it")  # fmt: skip
        release(a)
        assert held.result().status_code == 200
        assert len(fake_log(a)["requests"]) == 1  # the one that left was never sent
        assert gateway_metric(gw, 'pagellm_gateway:requests_total{key="",model="fake",'
                              'replica="gateway",status="499"}') == 1  # fmt: skip


def test_replicas_and_keys_reload_without_a_restart(tmp_path):
    cfg = tmp_path / "gateway.yaml"
    with running_fake("model-a") as (_, a), running_fake("model-b") as (_, b):
        entry = "  - {{name: {name}, key_sha256: {digest}}}\n"
        cfg.write_text(
            f"backends: [{a}]\nkeys:\n" + entry.format(name="one", digest=hash_key("k1"))
        )
        with running_gateway(extra=("--config", str(cfg))) as gw:

            def models(key: str) -> list[str]:
                listed = httpx.get(f"{gw}/v1/models", headers={"Authorization": f"Bearer {key}"})
                if listed.status_code != 200:  # k2 before the reload: 401
                    return []
                return [m["id"] for m in listed.json()["data"]]

            assert models("k1") == ["model-a"]
            assert post(gw, {"model": "model-a", "prompt": "x"}, key="k1").status_code == 200
            time.sleep(0.01)  # a new modification time, whatever the file system's resolution
            cfg.write_text(
                f"backends: [{a}, {b}]\nkeys:\n" + entry.format(name="two", digest=hash_key("k2"))
            )
            wait_until(lambda: models("k2") == ["model-a", "model-b"], what="the new replica")
            assert post(gw, {"model": "model-b", "prompt": "x"}, key="k2").status_code == 200
            assert post(gw, {"model": "model-a", "prompt": "x"}, key="k1").status_code == 401
            cfg.write_text(f"backends: [{b}]\nkeys:\n  - {{name: x, color: red}}\n")  # bad
            wait_until(
                lambda: (
                    gateway_metric(
                        gw,
                        'pagellm_gateway:config_reloads_total{result="error"}',
                        {"Authorization": "Bearer k2"},
                    )
                    == 1
                ),
                what="the failed reload",
            )
            assert models("k2") == ["model-a", "model-b"]  # the running fleet stayed
            assert post(gw, {"model": "model-a", "prompt": "x"}, key="k2").status_code == 200
