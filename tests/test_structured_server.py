"""Structured outputs and tool calling over HTTP (a real server process on loopback with the tiny
model, the official ``openai`` client): 100 generated schemas at temperature 1, streamed and not;
regex, choice and grammar; a bad constraint is a 400 while other requests run on; tool_choice
required / named / auto, streamed deltas reassembling to the whole answer; the metrics.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from schema_gen import schemas
from server_helpers import API_KEY, AUTH, MODEL_NAME, metrics, running_server

pytestmark = pytest.mark.timeout(900)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
NOOP = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object",
        "properties": {}, "additionalProperties": False}}}  # fmt: skip
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_models):
    # no prefix caching: a repeated greedy request then takes exactly the same path; no free
    # whitespace in JSON (the random model would wander in it: see test_structured_outputs)
    args = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--no-enable-prefix-caching", "--max-num-seqs", "32",
            "--structured-outputs-config", '{"disable_any_whitespace": true}')  # fmt: skip
    with running_server(tiny_models("llama"), *args) as (_, base):
        yield base


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _json_answer(client, schema: dict, i: int) -> tuple[str | None, str]:
    """(text, finish reason) of one sampled answer: odd i streamed, half through
    response_format and half through structured_outputs."""
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "JSON please"}],
              temperature=1.0, seed=i, max_tokens=300)  # fmt: skip
    if i % 4 < 2:
        kw["response_format"] = {"type": "json_schema",
                                 "json_schema": {"name": f"s{i}", "schema": schema}}  # fmt: skip
    else:
        kw["extra_body"] = {"structured_outputs": {"json": schema}}
    if i % 2 == 0:
        choice = client.chat.completions.create(**kw).choices[0]
        return choice.message.content, choice.finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_100_sampled_schemas_streamed_and_not(client):
    cases = schemas(100, seed=7)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda a: _json_answer(client, a[1], a[0]), enumerate(cases)))
    completed = {0: 0, 1: 0}
    for i, (schema, (text, reason)) in enumerate(zip(cases, answers, strict=True)):
        assert reason in ("stop", "length")
        if reason == "stop":
            completed[i % 2] += 1
            jsonschema.validate(json.loads(text), schema)
    assert completed[0] >= 40 and completed[1] >= 40, completed


def test_regex_choice_grammar_and_json_object(client):
    regex = r"[a-z]{3}-[0-9]{2}"
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    grammar_done = 0
    for seed in range(4):
        kw = dict(model=MODEL_NAME, prompt="x", max_tokens=60, temperature=1.0, seed=seed)
        out = client.completions.create(**kw, extra_body={"guided_regex": regex}).choices[0]
        assert re.fullmatch(regex, out.text) and out.finish_reason == "stop"
        out = client.completions.create(
            **kw, extra_body={"structured_outputs": {"choice": ["left", "right"]}}
        ).choices[0]
        assert out.text in ("left", "right")
        out = client.completions.create(**kw, extra_body={"guided_grammar": grammar}).choices[0]
        if out.finish_reason == "stop":
            grammar_done += 1
            assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", out.text), out.text
    assert grammar_done > 0
    # the random model rarely closes an object within max_tokens (its keys wander): every
    # answer is an object's beginning, and one that completes parses as an object
    objects = []
    for seed in range(4):
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=USER, max_tokens=200, temperature=1.0, seed=seed,
            response_format={"type": "json_object"},
        ).choices[0]  # fmt: skip
        assert out.message.content.startswith("{"), out.message.content
        if out.finish_reason == "stop":
            objects.append(json.loads(out.message.content))
    assert all(isinstance(o, dict) for o in objects)


def test_bad_constraints_are_400_and_other_requests_run_on(client):
    done: dict[str, str] = {}

    def long_stream():
        text = ""
        for chunk in client.completions.create(
            model=MODEL_NAME, prompt="go", max_tokens=200, stream=True,
            extra_body={"ignore_eos": True},
        ):  # fmt: skip
            text += chunk.choices[0].text if chunk.choices else ""
        done["text"] = text

    runner = threading.Thread(target=long_stream)
    runner.start()
    bad = [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
         "response_format"),
        ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= nothing"}}},
         "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
         "structured_outputs"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ]  # fmt: skip
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=5, **kw)
        assert err.value.body["param"] == param, (kw, err.value.body)
    runner.join(120)
    assert not runner.is_alive()
    assert len(done["text"]) > 0


def _reassembled(stream) -> tuple[list[dict], str | None, str]:
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
        reason = chunk.choices[0].finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason, content


def _calls(message) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []]  # fmt: skip


@pytest.mark.parametrize(
    "choice, reason",
    [("required", "tool_calls"), ({"type": "function", "function": {"name": "get_weather"}},
                                  "stop")],
)  # fmt: skip
def test_enforced_tool_calls_whole_and_streamed(client, choice, reason):
    kw = dict(model=MODEL_NAME, messages=USER, tools=[WEATHER, NOOP], tool_choice=choice,
              max_tokens=200, temperature=0)  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == reason
    assert whole.message.content is None
    calls = _calls(whole.message)
    assert calls and all(c["id"].startswith("chatcmpl-tool-") for c in calls)
    params = {"get_weather": WEATHER, "noop": NOOP}
    for call in calls:
        schema = params[call["name"]]["function"]["parameters"]
        jsonschema.validate(json.loads(call["arguments"]), schema)
    if not isinstance(choice, str):
        assert [c["name"] for c in calls] == ["get_weather"]
    streamed, stream_reason, content = _reassembled(
        client.chat.completions.create(**kw, stream=True)
    )
    assert stream_reason == reason and content == ""
    strip = [{k: v for k, v in c.items() if k != "id"} for c in calls]
    assert [{k: v for k, v in c.items() if k != "id"} for c in streamed] == strip
    # the conversation goes on with the tool's result
    follow = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]},
        *({"role": "tool", "tool_call_id": c["id"], "content": '{"temp": 18}'} for c in calls),
    ]  # fmt: skip
    final = client.chat.completions.create(
        model=MODEL_NAME, messages=follow, tools=[WEATHER, NOOP], tool_choice="none",
        max_tokens=8, temperature=0,
    ).choices[0]  # fmt: skip
    assert final.message.tool_calls is None and final.finish_reason in ("stop", "length")


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_required_calls_cut_before_a_name_agree_whole_and_streamed(client, max_tokens):
    """Cut before the first call's name: no call and no content either way (the whole answer
    had shown the array's first characters as content)."""
    kw = dict(model=MODEL_NAME, messages=USER, tools=[WEATHER, NOOP], tool_choice="required",
              max_tokens=max_tokens, temperature=0)  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    assert (whole.finish_reason, whole.message.content, whole.message.tool_calls) == (
        "length", "", None)  # fmt: skip
    streamed, reason, content = _reassembled(client.chat.completions.create(**kw, stream=True))
    assert (reason, content, streamed) == ("length", "", [])


def test_a_required_array_cut_by_a_stop_string_does_not_end_in_tool_calls(client):
    """The key after each name is "parameters": stopping there leaves a call with a name and
    no arguments, which is not a finished tool call (finish reason stop, as with length)."""
    kw = dict(model=MODEL_NAME, messages=USER, tools=[WEATHER, NOOP], tool_choice="required",
              max_tokens=60, temperature=0, stop=["parameters"])  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "stop" and whole.model_extra["stop_reason"] == "parameters"
    assert [c.function.name for c in whole.message.tool_calls] in (["get_weather"], ["noop"])
    streamed, reason, _ = _reassembled(client.chat.completions.create(**kw, stream=True))
    assert reason == "stop" and [c["name"] for c in streamed] == [
        c.function.name for c in whole.message.tool_calls
    ]


def test_auto_tool_choice_parses_hermes_calls(client):
    # the random model would not call tools by itself: a regex makes it write one
    forced = r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,8}", "unit": "c"\}\}</tool_call>'
    kw = dict(model=MODEL_NAME, messages=USER, tools=[WEATHER], max_tokens=120,
              temperature=0.7, seed=3, extra_body={"guided_regex": forced})  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == "Sure. "
    [call] = _calls(whole.message)
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["unit"] == "c"
    streamed, reason, content = _reassembled(client.chat.completions.create(**kw, stream=True))
    assert reason == "tool_calls" and content == "Sure. "
    assert [(c["name"], c["arguments"]) for c in streamed] == [(call["name"], call["arguments"])]
    plain = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, tools=[WEATHER], max_tokens=6, temperature=0,
        extra_body={"guided_regex": "no tools here"},
    ).choices[0]  # fmt: skip
    assert plain.message.content == "no tools here" and plain.finish_reason == "stop"
    assert not plain.message.tool_calls


def test_auto_tool_choice_needs_the_flags(tiny_models):
    with running_server(tiny_models("llama")) as (_, base):
        r = httpx.post(f"{base}/v1/chat/completions", headers=AUTH, json={
            "model": MODEL_NAME, "messages": USER, "tools": [WEATHER]}, timeout=60)  # fmt: skip
        assert r.status_code == 400
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
        r = httpx.post(f"{base}/v1/chat/completions", headers=AUTH, json={
            "model": MODEL_NAME, "messages": USER, "tools": [WEATHER], "max_tokens": 4,
            "tool_choice": "none"}, timeout=60)  # fmt: skip
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_metrics_count_kinds_and_compile_times(client, server):
    client.completions.create(
        model=MODEL_NAME, prompt="x", max_tokens=4,
        extra_body={"structured_outputs": {"choice": ["metric-a", "metric-b"]}},
    )  # fmt: skip
    m = metrics(server)
    kinds = {k: v for k, v in m.items() if k.startswith("pagellm:structured_output_requests")}
    assert any('kind="choice"' in k and v >= 1 for k, v in kinds.items()), kinds
    compiles = [
        v for k, v in m.items() if k.startswith("pagellm:structured_output_compile_seconds_count")
    ]
    assert compiles and compiles[0] >= 1
    assert any(k.startswith("pagellm:structured_output_mask_steps") and v > 0 for k, v in m.items())
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=4,
            extra_body={"structured_outputs": {"grammar": "root ::= undefined_rule"}},
        )  # fmt: skip
    failures = {
        k: v for k, v in metrics(server).items()
        if k.startswith("pagellm:structured_output_compile_failures_total")
    }  # fmt: skip
    assert (
        len(failures) == 4 and failures[next(k for k in failures if 'reason="invalid"' in k)] >= 1
    )
    m = metrics(server)
    label = f'{{model_name="{MODEL_NAME}"}}'  # none of this module's grammars overruns
    assert m[f"pagellm:structured_output_match_overruns_total{label}"] == 0
    assert m[f"pagellm:structured_output_fill_threads_left{label}"] == 0
