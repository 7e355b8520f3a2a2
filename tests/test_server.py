"""The OpenAI-compatible server, in a real process on loopback, driven by the official client."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from server_helpers import (
    API_KEY,
    AUTH,
    MODEL_NAME,
    aborted,
    leave_stream_after,
    metrics,
    running_server,
    wait_idle,
)


@pytest.fixture(scope="module")
def server(tiny_models):
    with running_server(tiny_models("llama")) as (_, base):
        yield base


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_completion_and_stream_agree(client):
    kw = dict(model=MODEL_NAME, prompt="Hello there", max_tokens=12, temperature=0)
    full = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 12
    assert full.choices[0].finish_reason == "length"
    chunks = list(
        client.completions.create(
            **kw,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    counted = httpx.post(
        f"{client.base_url}".removesuffix("/v1/") + "/tokenize",
        json={"prompt": "Hello there"},
        headers=AUTH,
    ).json()["count"]
    assert full.usage.prompt_tokens == counted
    assert full.usage.total_tokens == counted + 12


def test_token_id_prompts_and_n(client):
    out = client.completions.create(
        model=MODEL_NAME, prompt=[[5, 6, 7], [8, 9]], max_tokens=4, n=2, temperature=0.7, seed=3
    )
    assert len(out.choices) == 4
    assert out.usage.prompt_tokens == 3 + 2  # a prompt counts once, whatever n is
    assert out.usage.completion_tokens == 4 * 4


def test_stream_with_n_finishes_each_choice_once(client):
    stream = client.completions.create(
        model=MODEL_NAME, prompt="abc", max_tokens=5, n=3, temperature=0.9, seed=1, stream=True
    )
    finishes = [c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]


def test_chat_stream_and_plain(client):
    messages = [{"role": "user", "content": "Say hi"}]
    full = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0
    )
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content
    server = f"{client.base_url}".removesuffix("/v1/")
    counted = httpx.post(f"{server}/tokenize", json={"messages": messages}, headers=AUTH)
    assert full.usage.prompt_tokens == counted.json()["count"]
    assert 1 <= full.usage.completion_tokens <= 8


def test_async_client_concurrent(server):
    import asyncio

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)
        jobs = [
            aclient.completions.create(
                model=MODEL_NAME, prompt=f"Number {i}", max_tokens=6, temperature=0
            )
            for i in range(16)
        ]
        return await asyncio.gather(*jobs)

    outs = asyncio.run(main())
    assert all(o.usage.completion_tokens >= 1 for o in outs)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "top_p": 5}, "top_p"),
        ({}, "prompt"),
    ],
)
def test_bad_parameters_are_400(server, body, param):
    r = httpx.post(
        f"{server}/v1/completions",
        json={"model": MODEL_NAME, **body},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and param in (err["param"] or "")


def test_error_statuses(server, client):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    bad_json = httpx.post(f"{server}/v1/completions", content=b"{nope", headers=auth)
    assert bad_json.status_code == 400
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="word " * 600, max_tokens=100)
    assert info.value.body["code"] == "context_length_exceeded"
    big = httpx.post(f"{server}/v1/completions", content=b"x" * 30000, headers=auth)
    assert big.status_code == 413
    assert httpx.get(f"{server}/health").status_code == 200  # still serving


def test_latency_histograms_are_exported(server, client):
    client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3, temperature=0)
    text = httpx.get(f"{server}/metrics", headers=AUTH).text
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        count = [ln for ln in text.splitlines() if ln.startswith(f"pagellm:{name}_count")]
        assert count and float(count[0].rsplit(" ", 1)[1]) >= 1, name
    for name in (
        "engine_steps",
        "engine_busy_seconds",
        "engine_execute_seconds",
        "engine_thread_cpu_seconds",
        "api_thread_cpu_seconds",
    ):
        total = [ln for ln in text.splitlines() if ln.startswith(f"pagellm:{name}_total")]
        assert total and float(total[0].rsplit(" ", 1)[1]) > 0, name
    assert any(ln.startswith("process_cpu_seconds_total") for ln in text.splitlines())


def test_tokenize_roundtrip(server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    ids = httpx.post(f"{server}/tokenize", json={"prompt": "hello world"}, headers=auth).json()
    text = httpx.post(f"{server}/detokenize", json={"tokens": ids["tokens"]}, headers=auth)
    assert text.json()["prompt"] == "hello world"


LONG = {"model": MODEL_NAME, "prompt": "go", "max_tokens": 500, "ignore_eos": True}


def test_stream_disconnect_aborts_and_frees_kv(server):
    before = aborted(server)
    leave_stream_after(f"{server}/v1/completions", LONG)
    wait_idle(server, before)


def test_non_stream_disconnect_aborts_and_frees_kv(server):
    before = aborted(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=LONG, headers=AUTH, timeout=0.1)
    wait_idle(server, before)


def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_models):
    import signal
    import threading

    with running_server(tiny_models("llama")) as (proc, base):
        events: list[str] = []
        body = {**LONG, "max_tokens": 300, "stream": True}

        def stream() -> None:
            with httpx.stream(
                "POST", f"{base}/v1/completions", json=body, headers=AUTH, timeout=30
            ) as r:
                events.extend(line for line in r.iter_lines() if line.startswith("data:"))

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 10
        while not events and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        reader.join(timeout=30)
        assert events and events[-1] == "data: [DONE]"
        assert '"finish_reason": "length"' in events[-2]
        assert proc.wait(timeout=30) == 0


def test_full_queue_gets_503_with_retry_after(tiny_models):
    import threading

    extra = ("--max-num-seqs", "1", "--max-num-queued-requests", "1")
    with running_server(tiny_models("llama"), *extra) as (_, base):
        first_token = threading.Event()

        def run_long() -> None:  # occupies the only running slot
            body = {**LONG, "max_tokens": 400, "stream": True}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=AUTH) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        first_token.set()

        def run_queued() -> None:  # waits behind it
            httpx.post(f"{base}/v1/completions", json={**LONG, "max_tokens": 2}, headers=AUTH)

        threads = [threading.Thread(target=run_long)]
        threads[0].start()
        assert first_token.wait(30)
        threads.append(threading.Thread(target=run_queued))
        threads[1].start()
        waiting = f'pagellm:num_requests_waiting{{model_name="{MODEL_NAME}"}}'
        deadline = time.monotonic() + 10
        while metrics(base)[waiting] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert metrics(base)[waiting] == 1
        r = httpx.post(f"{base}/v1/completions", json={**LONG, "max_tokens": 2}, headers=AUTH)
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_busy"
        for t in threads:
            t.join(timeout=30)


def test_priority_without_the_priority_policy_is_400(server):
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, "priority": 3}
    r = httpx.post(f"{server}/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"]


def test_tenant_gauges_follow_the_user_field(server):
    body = {**LONG, "stream": True, "user": "alice"}
    gauge = f'pagellm:tenant_requests_running{{model_name="{MODEL_NAME}",tenant="alice"}}'
    seen = 0.0
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=AUTH) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                seen = metrics(server).get(gauge, 0.0)
                break
    assert seen == 1.0
