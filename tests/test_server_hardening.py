"""Regression tests of the hardening review against a real `pagellm serve` on loopback: values
that used to kill the engine, input that gave a 500, bodies past the limit, requests that ask
for too many sequences, and auth on every path."""

from __future__ import annotations

import json
import os
import shutil
import socket

import httpx
import pytest
from server_helpers import API_KEY, AUTH, MODEL_NAME, running_server

SEQ_LIMIT_FLAGS = ("--max-num-queued-requests", "64", "--client-body-timeout", "5")


@pytest.fixture(scope="module")
def server(tiny_models):
    with running_server(tiny_models("llama"), *SEQ_LIMIT_FLAGS) as (_, base):
        yield base


def _post(server: str, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**AUTH, "content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(f"{server}{path}", content=content, headers=headers, timeout=60, **kwargs)


def _assert_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _assert_serving(server: str) -> None:
    assert httpx.get(f"{server}/health").status_code == 200
    ok = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


ENGINE_KILLERS = [
    b'{"prompt": "hi", "seed": 18446744073709551616}',
    b'{"prompt": "hi", "top_k": 100000000000000000000, "top_p": 0.5}',
    b'{"prompt": "hi", "min_tokens": 1, "stop_token_ids": [99999999]}',
    b'{"prompt": "hi", "temperature": NaN}',
    b'{"prompt": "hi", "temperature": Infinity}',
    b'{"prompt": "hi", "presence_penalty": -Infinity}',
    b'{"prompt": "hi", "repetition_penalty": NaN}',
    b'{"prompt": "hi", "logit_bias": {"99999999": 1}}',
    b'{"prompt": "hi", "logit_bias": {"5": Infinity}}',
    b'{"prompt": "hi", "allowed_token_ids": [-1]}',
    b'{"prompt": "hi", "top_k": 49153}',
    b'{"prompt": "hi", "priority": 100000000000000000000000}',
]


@pytest.mark.parametrize("body", ENGINE_KILLERS)
def test_values_that_killed_the_engine_are_400_and_it_serves_on(server, body):
    _assert_error(_post(server, "/v1/completions", body), 400)
    _assert_serving(server)


def test_64_bit_seeds_work_for_every_copy(server):
    body = {"prompt": "hi", "seed": (1 << 63) - 1, "n": 3, "max_tokens": 3, "temperature": 1}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3


def test_logit_bias_and_allowed_token_ids_choose_the_tokens(server):
    def ids(r):
        return [t.removeprefix("token_id:") for t in r.json()["choices"][0]["logprobs"]["tokens"]]

    common = {"prompt": "hi", "max_tokens": 4, "logprobs": 0, "return_tokens_as_token_ids": True}
    forced = _post(
        server, "/v1/completions", {**common, "temperature": 0, "logit_bias": {"77": 100}}
    )
    assert ids(forced) == ["77"] * 4
    only = _post(server, "/v1/completions", {**common, "temperature": 1, "allowed_token_ids": [42]})
    assert ids(only) == ["42"] * 4


def test_too_many_sequences_in_one_request_is_400(server):
    err = _assert_error(_post(server, "/v1/completions", {"prompt": [[1]] * 1000, "n": 128}), 400)
    assert "sequences" in err["message"]
    _assert_serving(server)


def test_queue_limit_counts_every_sequence(server):
    r = _post(server, "/v1/completions", {"prompt": [[5, 6]] * 40, "n": 2, "max_tokens": 1})
    _assert_error(r, 503)
    assert r.headers["retry-after"]


@pytest.mark.parametrize(
    "stop", [["x"] * 33, ["y" * 257]], ids=["too many stop strings", "a stop string too long"]
)
def test_stop_strings_are_capped(server, stop):
    err = _assert_error(_post(server, "/v1/completions", {"prompt": "hi", "stop": stop}), 400)
    assert err["param"] == "stop"


_DEEP_CALL = {"id": "1", "function": {"name": "f", "arguments": "[" * 900 + "]" * 900}}
_DEEP_TURNS = [
    {"role": "user", "content": "x"},
    {"role": "assistant", "tool_calls": [_DEEP_CALL]},
    {"role": "tool", "tool_call_id": "1", "content": "r"},
]
DEEP_ARGUMENTS_CHAT = json.dumps({"messages": _DEEP_TURNS, "max_tokens": 2}).encode()
DEEP_ARGUMENTS_TOKENIZE = json.dumps({"messages": _DEEP_TURNS}).encode()

CLIENT_ERRORS = [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udcff"}]}'),
    ("/v1/completions", b'{"prompt": "\\udcff"}'),
    ("/v1/completions", b'{"prompt": "hi", "user": "\\ud800"}'),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\udfff"]}'),
    ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("/v1/completions", b'{"prompt": "hi", "user": "' + b"u" * 300 + b'"}'),
    ("/detokenize", b'{"tokens": [-1, 1000000000]}'),
    ("/detokenize", b'{"tokens": [100000000000000000000000]}'),
    ("/tokenize", b'{"prompt": "\\udcff"}'),
    ("/tokenize", b'{}'),
    ("/tokenize", b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}'),
    # token ids that pydantic's lax mode had turned into token 1 (or 5, or 1000)
    ("/v1/completions", b'{"prompt": [true]}'),
    ("/v1/completions", b'{"prompt": [[1.0]]}'),
    ("/v1/completions", b'{"prompt": "hi", "allowed_token_ids": [true]}'),
    ("/v1/completions", b'{"prompt": "hi", "stop_token_ids": ["5"]}'),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {" 5": 1}}'),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"1_000": 1}}'),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"5": true}}'),
    ("/detokenize", b'{"tokens": [true]}'),
    # an earlier tool call's arguments nested past the recursion limit of the template's code
    ("/v1/chat/completions", DEEP_ARGUMENTS_CHAT),
    ("/tokenize", DEEP_ARGUMENTS_TOKENIZE),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body"), CLIENT_ERRORS)
def test_client_input_that_gave_a_500_is_a_400_error_object(server, path, body):
    _assert_error(_post(server, path, body), 400)
    _assert_serving(server)


CONSTRAINT_CONFLICTS = [
    ({"guided_regex": "[^\\s\\S]"}, "admits no output"),
    ({"guided_choice": ["a"], "min_tokens": 8, "n": 2}, "min_tokens=8"),
    ({"guided_choice": ["yes"], "allowed_token_ids": [0]}, "allowed_token_ids"),
]


@pytest.mark.parametrize(("fields", "why"), CONSTRAINT_CONFLICTS)
def test_settings_no_output_can_meet_are_400_streamed_or_not(server, fields, why):
    """They were 500s ("the grammar rejected a token"); streamed, the error event says 400."""
    body = {"prompt": "x", "max_tokens": 10, "temperature": 0, **fields}
    assert why in _assert_error(_post(server, "/v1/completions", body), 400)["message"]
    streamed = _post(server, "/v1/completions", {**body, "stream": True})
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert events[-1] == "[DONE]" and len(errors) == 1, streamed.text
    assert errors[0]["type"] == "invalid_request_error" and why in errors[0]["message"]
    _assert_serving(server)


def test_error_params_name_the_field(server):
    too_long = _post(server, "/v1/completions", {"prompt": [5] * 5000})
    assert _assert_error(too_long, 400)["param"] == "prompt"
    assert _assert_error(_post(server, "/v1/completions", b'{"prompt": }'), 400)["param"] is None


def test_unknown_paths_and_methods_answer_error_objects(server):
    _assert_error(httpx.get(f"{server}/v1/nope", headers=AUTH), 404)
    _assert_error(httpx.get(f"{server}/v1/completions", headers=AUTH), 405)


def test_a_chunked_body_over_the_limit_is_413(server):
    def chunks():
        for _ in range(30):
            yield b"x" * 1000

    r = httpx.post(f"{server}/v1/completions", content=chunks(), headers=AUTH, timeout=60)
    _assert_error(r, 413)
    _assert_serving(server)


def test_every_path_but_health_needs_the_key(server):
    for path in ("/v1/models", "/metrics", "/version", "/docs", "/openapi.json"):
        assert httpx.get(f"{server}{path}").status_code == 401, path
        assert httpx.get(f"{server}{path}", headers=AUTH).status_code == 200, path
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
        assert httpx.post(f"{server}{path}", json=body).status_code == 401, path
        bad = {"Authorization": f"Bearer {API_KEY}x"}
        assert httpx.post(f"{server}{path}", json=body, headers=bad).status_code == 401, path
        assert httpx.post(f"{server}{path}", json=body, headers=AUTH).status_code == 200, path
    assert httpx.get(f"{server}/health").status_code == 200


def test_key_from_the_environment_stays_out_of_ps_and_metrics_may_open(tiny_models):
    env = {**os.environ, "PAGELLM_API_KEY": "env-secret"}
    with running_server(
        tiny_models("llama"), "--allow-unauthenticated-metrics", key_args=(), env=env
    ) as (proc, base):
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            assert b"env-secret" not in f.read()
        assert httpx.get(f"{base}/metrics").status_code == 200
        assert httpx.post(f"{base}/tokenize", json={"prompt": "a"}).status_code == 401
        key = {"Authorization": "Bearer env-secret"}
        assert httpx.post(f"{base}/tokenize", json={"prompt": "a"}, headers=key).status_code == 200


def _with_template(src, dst, template: str | None):
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    if template is not None:
        cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    for extra in dst.glob("chat_template.*"):
        extra.unlink()
    return dst


RAISING = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role here') }}"
    "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
)


def test_a_template_that_raises_or_is_missing_is_400(tiny_models, tmp_path):
    raising = _with_template(tiny_models("llama"), tmp_path / "raising", RAISING)
    with running_server(raising) as (_, base):
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        err = _assert_error(_post(base, "/v1/chat/completions", {"messages": messages}), 400)
        assert "no system role here" in err["message"]
        _assert_error(_post(base, "/tokenize", {"messages": messages}), 400)
        user_only = {"messages": messages[1:], "max_tokens": 2}
        assert _post(base, "/v1/chat/completions", user_only).status_code == 200
    missing = _with_template(tiny_models("llama"), tmp_path / "missing", None)
    with running_server(missing) as (_, base):
        _assert_error(
            _post(base, "/tokenize", {"messages": [{"role": "user", "content": "u"}]}), 400
        )
        assert httpx.get(f"{base}/health").status_code == 200


def test_model_name_in_errors_is_short(server):
    err = _assert_error(
        _post(server, "/v1/completions", {"prompt": "hi", "model": "m" * 5000}), 404
    )
    assert len(err["message"]) < 300 and MODEL_NAME not in err["message"]


def test_a_body_that_does_not_arrive_in_time_is_408(server):
    """A client trickling its body (or stopping half-way) held its connection for ever."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
                "Content-Length: 50\r\n\r\n")  # fmt: skip
        sock.sendall(head.encode() + b'{"prompt"')
        answer = b""
        while b"\r\n\r\n" not in answer:  # the server answers within its 5 s (+ slack)
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    _assert_serving(server)


def test_tool_call_arguments_python_cannot_parse_go_to_the_template_as_text(server):
    """An integer past Python's digit limit is a ValueError, not a JSONDecodeError: such
    arguments are text, as any other arguments that are not JSON (it was a 500)."""
    turns = [{**t} for t in _DEEP_TURNS]
    turns[1] = {"role": "assistant", "tool_calls": [
        {"id": "1", "function": {"name": "f", "arguments": '{"a": ' + "1" * 5000 + "}"}}]}  # fmt: skip
    r = _post(server, "/v1/chat/completions", {"messages": turns, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_content_part_that_is_not_text_is_named(server):
    """Not pydantic's "Input should be a valid string" (the union's first member)."""
    part = {"type": "image_url", "image_url": {"url": "x"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, part]}]}
    err = _assert_error(_post(server, "/v1/chat/completions", body), 400)
    assert "content parts of type 'image_url' are not served" in err["message"]
    assert err["param"] == "messages.0.content"


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(tiny_models):
    """Each token takes at most the longest vocabulary entry's characters (81 here), so a
    prompt longer than that times the context is refused at once, without its token list
    (eight 4 MiB chats at once had taken a server from 3.5 to 7.5 GB and stalled /health)."""
    text = "word " * 3000  # 15000 characters: over 81 x 63
    with running_server(tiny_models("llama"), "--max-model-len", "64") as (_, base):
        for path, body in (
            ("/v1/completions", {"prompt": text, "max_tokens": 1}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        ):
            err = _assert_error(_post(base, path, body), 400)
            assert err["code"] == "context_length_exceeded", err
            assert "needs at least 186 in the prompt" in err["message"]
        messages = [{"role": "user", "content": text}]
        counted = _post(base, "/tokenize", {"messages": messages})
        assert counted.status_code == 200 and counted.json()["count"] > 3000  # any length
