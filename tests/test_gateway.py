"""`pagellm gateway` in front of two real `pagellm serve` replicas (tiny model, loopback): proxying
with the official client, round-robin routing, cancellation reaching the replica (streams, and
plain requests whose client leaves while the replica works), failover when a replica dies, and
503 cluster_unavailable when none is left."""

from __future__ import annotations

import concurrent.futures
import json
import socket

import httpx
import openai
import pytest
from server_helpers import (
    API_KEY,
    AUTH,
    MODEL_NAME,
    aborted,
    free_port,
    gateway_metric,
    leave_stream_after,
    metrics,
    running_gateway,
    running_server,
    start_server,
    stop_server,
    stream_outcome,
    wait_healthy,
    wait_idle,
    wait_until,
)


@pytest.fixture(scope="module")
def replicas(tiny_models):
    model = tiny_models("llama")
    with running_server(model) as (p1, b1), running_server(model) as (p2, b2):
        yield [(p1, b1), (p2, b2)]


def _successes(base: str) -> float:
    return sum(v for k, v in metrics(base).items() if k.startswith("pagellm:request_success"))


def test_proxy_round_robin_and_streaming(replicas):
    (_, b1), (_, b2) = replicas
    with running_gateway(b1, b2) as gw:
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key=API_KEY, max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL_NAME]
        before = [_successes(b1), _successes(b2)]
        for _ in range(4):
            out = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3)
            assert out.usage.completion_tokens >= 1
        after = [_successes(b1), _successes(b2)]
        assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2]  # alternated
        kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hey"}], max_tokens=6,
                  temperature=0)  # fmt: skip
        whole = client.chat.completions.create(**kw)
        with httpx.stream(
            "POST", f"{gw}/v1/chat/completions", json={**kw, "stream": True}, headers=AUTH
        ) as r:
            assert r.headers["cache-control"] == "no-cache"
            assert r.headers["x-accel-buffering"] == "no"
            lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
        assert lines[-1] == "data: [DONE]"
        streamed = client.chat.completions.create(**kw, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == whole.choices[0].message.content
        bad = httpx.post(
            f"{gw}/v1/completions", json={"model": "nope", "prompt": "x"}, headers=AUTH
        )
        assert bad.status_code == 404
        assert httpx.post(f"{gw}/v1/completions", content=b"{", headers=AUTH).status_code == 400


def test_disconnect_through_the_gateway_frees_the_replica(replicas):
    (_, b1), _ = replicas
    aborted_before = aborted(b1)
    with running_gateway(b1) as gw:
        body = {"model": MODEL_NAME, "prompt": "go", "max_tokens": 480, "ignore_eos": True}
        leave_stream_after(f"{gw}/v1/completions", body)
        wait_idle(b1, aborted_before, within=1.0)  # running and KV back to 0 within a second
        assert aborted(b1) == aborted_before + 1  # the replica aborted it: it did not just finish


def test_a_plain_request_whose_client_leaves_is_aborted_at_the_replica(replicas):
    (_, b1), _ = replicas
    aborted_before = aborted(b1)
    running = f'pagellm:num_requests_running{{model_name="{MODEL_NAME}"}}'
    body = {"model": MODEL_NAME, "prompt": "go", "max_tokens": 480, "ignore_eos": True}
    content = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {API_KEY}"
            f"\r\nContent-Type: application/json\r\nContent-Length: {len(content)}\r\n\r\n")  # fmt: skip
    with running_gateway(b1) as gw:
        host, port = gw.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as client:
            client.sendall(head.encode() + content)
            wait_until(lambda: metrics(b1)[running] == 1, what="the request at the replica")
        # the client left before any answer: the replica aborts it, it does not finish it
        wait_idle(b1, aborted_before, within=2.0)
        assert aborted(b1) == aborted_before + 1


def test_failover_then_cluster_unavailable(tiny_models):
    model = tiny_models("llama")
    with (
        running_server(model) as (p1, b1),
        running_server(model) as (p2, b2),
        running_gateway(b1, b2) as gw,
    ):
        p2.terminate()
        p2.wait(timeout=20)
        for _ in range(4):  # every request completes: the dead replica is skipped or retried
            r = httpx.post(
                f"{gw}/v1/completions",
                json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2},
                headers=AUTH,
                timeout=30,
            )
            assert r.status_code == 200
        text = httpx.get(f"{gw}/metrics").text
        assert f'pagellm_gateway:breaker_state{{replica="{b2}"}} 2.0' in text
        p1.terminate()
        p1.wait(timeout=20)
        r = httpx.post(
            f"{gw}/v1/completions", json={"model": MODEL_NAME, "prompt": "x"}, headers=AUTH
        )
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "cluster_unavailable"
        assert r.headers["retry-after"]


def _breaker(gw: str, replica: str) -> float:
    line = f'pagellm_gateway:breaker_state{{replica="{replica}"}}'
    return gateway_metric(gw, line)


def test_killing_a_replica_under_load_loses_no_request(tiny_models):
    model = tiny_models("llama")
    port = free_port()
    b2 = f"http://127.0.0.1:{port}"
    running = f'pagellm:num_requests_running{{model_name="{MODEL_NAME}"}}'
    plain = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
    with running_server(model) as (_, b1):
        p2 = start_server(model, port)
        try:
            wait_healthy(p2, b2)
            with (  # no health checks during the test: the breaker learns from requests alone
                running_gateway(b1, b2, health_interval=60) as gw,
                concurrent.futures.ThreadPoolExecutor(12) as pool,
            ):
                body = {"model": MODEL_NAME, "prompt": "go", "max_tokens": 300,
                        "ignore_eos": True, "stream": True}  # fmt: skip
                streams = [pool.submit(stream_outcome, gw, body) for _ in range(12)]
                wait_until(lambda: metrics(b2)[running] >= 3, what="streams on the replica")
                p2.kill()  # dies mid-load
                p2.wait(timeout=20)
                for _ in range(6):  # new requests all complete: b2 is retried or skipped
                    r = httpx.post(f"{gw}/v1/completions", json=plain, headers=AUTH, timeout=30)
                    assert r.status_code == 200, r.text
                outcomes = [f.result() for f in streams]
                # every stream finished whole or ended with an error event: none cut silently
                assert set(outcomes) == {"done", "error"}, outcomes
                opened = f'pagellm_gateway:breaker_opens_total{{replica="{b2}"}}'
                assert gateway_metric(gw, opened) >= 1
                assert _breaker(gw, b2) != 0  # open, or half-open waiting for a probe
                p2 = start_server(model, port)  # the replica comes back on its address
                wait_healthy(p2, b2)
                before = _successes(b2)

                def probed_and_closed() -> bool:
                    r = httpx.post(f"{gw}/v1/completions", json=plain, headers=AUTH, timeout=30)
                    assert r.status_code == 200
                    return _breaker(gw, b2) == 0

                wait_until(probed_and_closed, timeout=30, what="the breaker to close")
                assert _successes(b2) > before  # the probe was served by the returned replica
        finally:
            stop_server(p2)


def test_gateway_keys_and_limits(replicas, tmp_path):
    from pagellm.gateway.limits import hash_key

    (_, b1), _ = replicas
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(
        f"""
keys:
  - name: team-a
    key_sha256: {hash_key("key-a")}
    models: [{MODEL_NAME}]
    requests_per_minute: 3
    tenant: team-a
  - name: team-b
    key_sha256: {hash_key("key-b")}
    models: [some-other-model]
"""
    )
    with running_gateway(b1, extra=("--config", str(cfg))) as gw:
        url = f"{gw}/v1/completions"
        body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
        assert httpx.post(url, json=body).status_code == 401
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer no"}).status_code == 401
        b = httpx.post(url, json=body, headers={"Authorization": "Bearer key-b"})
        assert b.status_code == 404
        a = {"Authorization": "Bearer key-a"}
        for _ in range(3):  # 3 a minute
            r = httpx.post(url, json=body, headers=a, timeout=30)
            assert r.status_code == 200, r.text
        over = httpx.post(url, json=body, headers=a)
        assert over.status_code == 429 and int(over.headers["retry-after"]) >= 1
        # the fleet console's state needs a gateway key too (its page does not)
        assert httpx.get(f"{gw}/ui/api/state").status_code == 401
        state = httpx.get(f"{gw}/ui/api/state", headers={"Authorization": "Bearer key-b"})
        assert state.status_code == 200 and state.json()["replicas"][0]["url"] == b1
        assert httpx.get(f"{gw}/ui").status_code == 200


def test_prompt_length_precheck_never_reaches_a_replica(replicas, tiny_models):
    (_, b1), _ = replicas
    tok = f"{MODEL_NAME}={tiny_models('llama')}"
    prompt_tokens = f'pagellm:prompt_tokens_total{{model_name="{MODEL_NAME}"}}'
    with running_gateway(b1, extra=("--tokenizer", tok)) as gw:
        before = metrics(b1)[prompt_tokens]
        for body in (
            {"model": MODEL_NAME, "prompt": "word " * 600, "max_tokens": 10},
            {"model": MODEL_NAME, "prompt": ["ok", "word " * 600], "max_tokens": 10},
            {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi " * 300}],
             "max_tokens": 300},
        ):  # fmt: skip
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = httpx.post(f"{gw}{path}", json=body, headers=AUTH)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and "512" in err["message"]
        assert metrics(b1)[prompt_tokens] == before  # no replica saw them
        ok = httpx.post(
            f"{gw}/v1/completions",
            json={"model": MODEL_NAME, "prompt": "word " * 20, "max_tokens": 4},
            headers=AUTH,
            timeout=30,
        )
        assert ok.status_code == 200
        assert metrics(b1)[prompt_tokens] > before


def _hits(base: str) -> float:
    return metrics(base)[f'pagellm:prefix_cache_hits_total{{model_name="{MODEL_NAME}"}}']


def _shared_prefix_hits(replicas, routing: str, seed: int) -> float:
    import random

    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "theta"]
    systems = [" ".join(rng.choice(words) for _ in range(110)) for _ in range(3)]
    (_, b1), (_, b2) = replicas
    before = _hits(b1) + _hits(b2)
    with running_gateway(b1, b2, routing=routing) as gw:
        for i in range(12):  # 3 system prompts, 4 questions each, interleaved
            body = {"model": MODEL_NAME, "prompt": f"{systems[i % 3]} question {i}",
                    "max_tokens": 2}  # fmt: skip
            r = httpx.post(f"{gw}/v1/completions", json=body, headers=AUTH, timeout=30)
            assert r.status_code == 200
    return _hits(b1) + _hits(b2) - before


def test_prefix_affinity_hits_the_prefix_cache_more_than_round_robin(replicas):
    round_robin = _shared_prefix_hits(replicas, "round-robin", seed=1)
    affinity = _shared_prefix_hits(replicas, "prefix-affinity", seed=2)
    # round-robin alternates replicas, so each system prompt (3 of them, interleaved) is
    # computed on both replicas; affinity computes each on one
    assert affinity > round_robin > 0
