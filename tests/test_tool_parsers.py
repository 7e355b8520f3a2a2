"""Tool-call parsing (pure units): streamed deltas reassemble to the whole answer whatever the
split points; the formats each parser reads; the constraints tool_choice makes."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagellm.structured.params import StructuredOutputError
from pagellm.structured.tool_parsers import (
    HermesCalls,
    Llama3JsonCalls,
    NamedCall,
    ParsedCalls,
    RequiredCalls,
    scan_call_array,
)
from pagellm.structured.tools import messages_for_template, tool_constraint

REQUIRED = (
    '[ {"name": "get_weather", "parameters": {"city": "Pa\\"ris", "days": [1, 2]}} ,\n'
    '{"name":"noop","parameters":{}}]'
)
HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>{"name": "noop", "arguments": {}}</tool_call>'
)
HERMES_AMID_TEXT = (  # whitespace stretches after calls, a block that is not a call, one unclosed
    'Hi\n\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n\nBye <tool_call>not json'
    '</tool_call> \n<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>  \n'
    '<tool_call>{"name": "c", "arguments": {}}</tool_call> B <tool_call>{"name": "'
)
LLAMA3 = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "noop"}'

PARSERS = {
    "required": (RequiredCalls, REQUIRED),
    "named": (lambda: NamedCall("get_weather"), '{"city": "Paris"}'),
    "hermes": (HermesCalls, HERMES),
    "hermes amid text": (HermesCalls, HERMES_AMID_TEXT),
    "llama3_json": (Llama3JsonCalls, LLAMA3),
}


def streamed(make, text: str, cuts: list[int]) -> ParsedCalls:
    parser, parsed, at = make(), ParsedCalls(), 0
    for cut in sorted(set(cuts)) + [len(text)]:
        parsed.add(*parser.feed(text[at:cut]))
        at = cut
    parsed.add(*parser.finish())
    return parsed


@pytest.mark.parametrize("kind", list(PARSERS))
@given(cuts=st.lists(st.integers(min_value=0, max_value=260), max_size=40))
def test_streamed_deltas_reassemble_to_the_whole_answer(kind, cuts):
    make, text = PARSERS[kind]
    whole = make().parse_all(text)
    assert streamed(make, text, [c for c in cuts if c <= len(text)]) == whole


def test_each_format_is_read():
    required = RequiredCalls().parse_all(REQUIRED)
    assert required.names == ["get_weather", "noop"]
    assert json.loads(required.arguments[0]) == {"city": 'Pa"ris', "days": [1, 2]}
    assert required.arguments[1] == "{}"
    hermes = HermesCalls().parse_all(HERMES)
    assert hermes.content == "Let me check. "
    assert hermes.names == ["get_weather", "noop"]
    assert json.loads(hermes.arguments[0]) == {"city": "Paris"}
    llama = Llama3JsonCalls().parse_all(LLAMA3)
    assert (llama.content, llama.names, llama.arguments[1]) == ("", ["get_weather", "noop"], "{}")


def test_text_that_is_not_a_call_stays_content():
    assert HermesCalls().parse_all("a <tool_call>not json</tool_call> b").content == (
        "a <tool_call>not json</tool_call> b"  # as written: the raw text of a non-call
    )
    amid = HermesCalls().parse_all(HERMES_AMID_TEXT)
    assert amid.names == ["a", "b", "c"]
    assert amid.content == (  # the stretches with text whole, the whitespace-only ones not
        'Hi\n\n\n\nBye <tool_call>not json</tool_call> \n B <tool_call>{"name": "'
    )
    assert HermesCalls().parse_all("x < y, and <tool_ca").content == "x < y, and <tool_ca"
    assert Llama3JsonCalls().parse_all('{"a": 1} and more').names == []
    assert Llama3JsonCalls().parse_all("plain answer").content == "plain answer"


def test_json_that_python_cannot_hold_is_not_a_call():
    """Nesting past the recursion limit and integers past the digit limit raise other errors
    than JSONDecodeError: such a block stays content (it gave a 500 answer)."""
    deep, huge = "[" * 1500, '{"a": ' + "1" * 5000 + "}"
    for body in (deep, '{"name": "f", "arguments": ' + deep, '{"name": "f", "arguments": ' + huge):
        text = f"<tool_call>{body}</tool_call>"
        parsed = HermesCalls().parse_all(text)
        assert (parsed.names, parsed.content) == ([], text)
    for text in ('{"name": "f", "parameters": ' + deep, '{"name": "f", "parameters": ' + huge):
        parsed = Llama3JsonCalls().parse_all(text)
        assert (parsed.names, parsed.content) == ([], text)
    # numbers a float cannot hold, and NaN: written again they would be Infinity / NaN
    for args in ('{"a": 1e999}', '{"a": -1e999}', '{"a": NaN}', "[Infinity]"):
        text = f'<tool_call>{{"name": "f", "arguments": {args}}}</tool_call>'
        assert HermesCalls().parse_all(text).names == []
        assert Llama3JsonCalls().parse_all(f'{{"name": "f", "parameters": {args}}}').names == []


def test_lone_surrogates_spelled_by_escapes_never_reach_a_response():
    """UTF-8 cannot carry them: a name with one is not a call; arguments keep the escape."""
    named = '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>'
    assert HermesCalls().parse_all(named).names == []
    obj = HermesCalls().parse_all(
        '<tool_call>{"name": "f", "arguments": {"a": "\\ud800"}}</tool_call>'
    )
    assert obj.arguments == ['{"a": "\\ud800"}']
    text = HermesCalls().parse_all('<tool_call>{"name": "f", "arguments": "x\\udc00"}</tool_call>')
    assert text.arguments == ["x\\udc00"]
    llama = Llama3JsonCalls().parse_all('{"name": "f", "parameters": {"a": "\\udc00"}}')
    assert llama.arguments == ['{"a": "\\udc00"}']


def test_unfinished_array_scan_keeps_partial_arguments():
    spans = scan_call_array('[{"name": "f", "parameters": {"a": "x y')
    assert spans[0].name == "f" and spans[0].args_end is None


TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}},
    {"name": "noop"},
]  # fmt: skip


def test_tool_choice_constraints():
    required = json.loads(tool_constraint(TOOLS, "required").spec_text)
    jsonschema.validate(json.loads(REQUIRED.replace('"days": [1, 2]', '"x": 1')), required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "other", "parameters": {}}], required)
    single = json.loads(tool_constraint(TOOLS, "required", parallel_tool_calls=False).spec_text)
    assert single["maxItems"] == 1
    named = tool_constraint(TOOLS, {"name": "get_weather"})
    assert json.loads(named.spec_text) == TOOLS[0]["parameters"]
    assert json.loads(tool_constraint(TOOLS, {"name": "noop"}).spec_text) == {"type": "object"}
    assert tool_constraint(TOOLS, "auto") is None and tool_constraint(TOOLS, "none") is None
    with pytest.raises(StructuredOutputError, match="not among the tools"):
        tool_constraint(TOOLS, {"name": "missing"})
    deep: dict = {"type": "integer"}
    for _ in range(64):
        deep = {"type": "array", "items": deep}
    for choice in ("required", {"name": "deep"}):
        with pytest.raises(StructuredOutputError, match="nests") as refused:
            tool_constraint([{"name": "deep", "parameters": deep}], choice)
        assert refused.value.param == "tools"


def test_tools_reach_a_template_that_cannot_render_them():
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}  # fmt: skip
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"temp": 18}', "tool_call_id": "c1"},
    ]
    turns, extra = messages_for_template(messages, TOOLS, renders_tools=False)
    assert extra == {}
    assert turns[0]["role"] == "system" and '"get_weather"' in turns[0]["content"]
    assert turns[2]["content"].startswith("<tool_call>")
    assert json.loads(turns[2]["content"].removeprefix("<tool_call>").removesuffix("</tool_call>"))[
        "arguments"
    ] == {"city": "Paris"}
    turns, extra = messages_for_template(messages, TOOLS, renders_tools=True)
    assert turns == messages and extra["tools"][0]["function"]["name"] == "get_weather"
