"""What a streamed response sends per engine output: a chunk for every output that brings
tokens, as vLLM does, its text "" where the text is held back (half of a UTF-8 character)."""

from __future__ import annotations

import asyncio

from pagellm.bench.serve import is_token_event
from pagellm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagellm.server.app import _Delta, _text_deltas, _Usage


def _output(text: str, tokens: list[int], finish: str | None = None) -> RequestOutput:
    comp = CompletionOutput(index=0, text=text, token_ids=tokens, finish_reason=finish)
    return RequestOutput("r", None, [1, 2], [comp], finish is not None, RequestMetrics(0.0))


def _deltas(outputs: list[RequestOutput]) -> list[_Delta]:
    async def gen():
        for out in outputs:
            yield out

    async def collect():
        return [d async for d in _text_deltas(gen(), 1) if not isinstance(d, _Usage)]

    return asyncio.run(collect())


def test_tokens_whose_text_is_held_back_still_get_their_chunk():
    outputs = [
        _output("a", [10]),
        _output("a", [10, 11]),  # the first half of a two-token character: no text yet
        _output("a\u00e9", [10, 11, 12]),
        _output("a\u00e9", [10, 11, 12]),  # nothing new at all: no chunk
        _output("a\u00e9!", [10, 11, 12, 13], finish="length"),
    ]
    assert [d.text for d in _deltas(outputs)] == ["a", "", "\u00e9", "!"]


def test_the_benchmarks_count_token_events_not_the_opening_role_chunk():
    assert is_token_event({"choices": [{"index": 0, "text": ""}]})
    assert is_token_event({"choices": [{"index": 0, "delta": {"content": "x"}}]})
    assert not is_token_event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    assert not is_token_event({"choices": [], "usage": {"completion_tokens": 3}})


def test_a_chat_stream_without_tools_sends_held_back_tokens_as_empty_content():
    from pagellm.server.app import _chat_delta
    from pagellm.server.chat_tools import ToolPlan

    plan = ToolPlan(mode="none")
    item = _Delta(index=0, text="", logprobs=None, finish_reason=None, stop_reason=None)
    assert _chat_delta(item, plan, {}) == ({"content": ""}, None)
