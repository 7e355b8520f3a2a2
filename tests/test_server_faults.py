"""The server when things go wrong inside it: a request over --request-timeout (set from a YAML
--config) is aborted with 504, and a model forward that raises fails every in-flight request,
turns /health to 503 and leaves a process that still answers and stops."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import AUTH, MODEL_NAME, metrics, running_server

LONG = {"model": MODEL_NAME, "prompt": "go", "max_tokens": 480, "ignore_eos": True}


def _read_events(base: str, body: dict, events: list[str], first: threading.Event) -> None:
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        events.append(f"status {r.status_code}")
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(line)
                first.set()


def test_request_timeout_from_yaml_config_aborts_with_504(tiny_models, tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("request-timeout: 0.5\nserved-model-name: loses-to-the-flag\n")
    # a 480-token request takes seconds on 2 cores; each decode step is well under the timeout
    extra = ("--config", str(cfg), "--max-num-seqs", "1")
    with running_server(tiny_models("llama"), *extra) as (_, base):
        assert httpx.get(f"{base}/v1/models", headers=AUTH).json()["data"][0]["id"] == MODEL_NAME
        plain = httpx.post(f"{base}/v1/completions", json=LONG, headers=AUTH, timeout=60)
        assert plain.status_code == 504
        assert plain.json()["error"]["code"] == "request_timeout"
        events: list[str] = []
        _read_events(base, {**LONG, "stream": True}, events, threading.Event())
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "request_timeout"
        running = f'pagellm:num_requests_running{{model_name="{MODEL_NAME}"}}'
        deadline = time.monotonic() + 5
        while metrics(base)[running] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metrics(base)[running] == 0
        short = httpx.post(
            f"{base}/v1/completions", json={**LONG, "max_tokens": 2}, headers=AUTH, timeout=30
        )
        assert short.status_code == 200


def test_engine_fault_fails_in_flight_requests_and_health(tiny_models, tmp_path):
    trigger = tmp_path / "fault"
    launcher = (str(Path(__file__).with_name("fault_server.py")), str(trigger))
    with running_server(tiny_models("llama"), launcher=launcher) as (proc, base):
        events: list[str] = []
        first = threading.Event()
        reader = threading.Thread(
            target=_read_events, args=(base, {**LONG, "stream": True}, events, first)
        )
        reader.start()
        answers: list[httpx.Response] = []
        plain = threading.Thread(
            target=lambda: answers.append(
                httpx.post(f"{base}/v1/completions", json=LONG, headers=AUTH, timeout=60)
            )
        )
        plain.start()
        assert first.wait(30)
        trigger.touch()  # every forward from now on raises
        for thread in (reader, plain):
            thread.join(timeout=30)
            assert not thread.is_alive()
        assert answers[0].status_code == 503
        assert "injected fault" in answers[0].json()["error"]["message"]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert "engine stopped" in error["message"] and "injected fault" in error["message"]
        health = httpx.get(f"{base}/health", timeout=5)
        assert health.status_code == 503
        after = httpx.post(f"{base}/v1/completions", json=LONG, headers=AUTH, timeout=5)
        assert after.status_code == 503 and after.headers["retry-after"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("max-num-sqs: 3\n", "unknown setting 'max-num-sqs'"),
        ("max-num-seqs: lots\n", "'lots' is not a valid int"),
        ("- a list\n", "expected a mapping"),
    ],
)
def test_bad_config_file_is_a_clear_cli_error(tmp_path, capsys, yaml_text, message):
    from pagellm.cli import main

    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--config", str(cfg)])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_priority_policy_server_serves_priorities(tiny_models):
    extra = ("--scheduling-policy", "priority")
    with running_server(tiny_models("llama"), *extra) as (_, base):
        for prio in (-1, 0, 5):
            body = {**LONG, "max_tokens": 3, "priority": prio}
            r = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
