"""Structured outputs and tool calls with the real default model (SmolLM2-135M-Instruct) behind
a real server, driven by the official ``openai`` client as an application would drive it:
``chat.completions.parse`` with a pydantic model, and two-turn tool conversations (call, tool
result, final answer) with ``tool_choice="required"`` and a named function, streamed and not.
"""

from __future__ import annotations

import json
from typing import Literal

import openai
import pydantic
import pytest
from server_helpers import API_KEY, running_server

from pagellm.fetch import require_default_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "smollm2"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    country: str = pydantic.Field(max_length=40)
    founded: int = pydantic.Field(ge=-1000, le=2100)
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]


@pytest.fixture(scope="module")
def client():
    args = ("--served-model-name", MODEL, "--kv-cache-memory", "0.25", "--max-model-len", "2048",
            "--no-enable-prefix-caching")  # fmt: skip
    with running_server(require_default_model(), *args) as (_, base):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def test_parse_returns_the_pydantic_object(client):
    reply = client.chat.completions.parse(
        model=MODEL, temperature=0, max_tokens=200, response_format=City,
        messages=[{"role": "user", "content": "Give me facts about Paris as JSON."}],
    )  # fmt: skip
    city = reply.choices[0].message.parsed
    assert isinstance(city, City)
    assert city.continent in ("Europe", "Asia", "Africa", "America", "Oceania")


def _stream_calls(client, **kw) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name, args = calls.setdefault(d.index, ["", ""])
            calls[d.index] = [name + (d.function.name or ""), args + (d.function.arguments or "")]
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_two_turn_tool_conversation(client, tool_choice):
    kw = dict(model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice=tool_choice,
              parallel_tool_calls=False, temperature=0, max_tokens=120)  # fmt: skip
    first = client.chat.completions.create(**kw).choices[0]
    assert first.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    [call] = first.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and "paris" in args["city"].lower()
    assert _stream_calls(client, **kw) == [(call.function.name, call.function.arguments)]
    result = {
        "role": "tool",
        "tool_call_id": call.id,
        "content": json.dumps({"temperature": 18, "unit": args["unit"], "sky": "sunny"}),
    }
    second = client.chat.completions.create(
        model=MODEL, messages=[*QUESTION, first.message.model_dump(exclude_none=True), result],
        tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=60,
    ).choices[0]  # fmt: skip
    assert second.message.tool_calls is None
    # the answer uses the tool's result
    assert any(w in second.message.content.lower() for w in ("18", "sunny")), second.message
