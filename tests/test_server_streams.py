"""Server answers under load and in every streaming shape: 64 concurrent greedy streams equal
the reference's answers (fp32, divergence only at a near-tie), multi-prompt streams, streamed
logprobs."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import openai
import pytest
import torch
from reference import compare_greedy, hf_greedy
from server_helpers import API_KEY, AUTH, MODEL_NAME, running_server

NUM_STREAMS = 64


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(11)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(1, 60))] for _ in range(64)]
    max_tokens = [rng.randrange(4, 24) for _ in range(NUM_STREAMS)]
    return prompts, max_tokens


@pytest.fixture(scope="module")
def server(tiny_models):
    # 16 running at most: the rest wait, so streams also start mid-batch
    with running_server(tiny_models("llama"), "--max-num-seqs", "16") as (_, base):
        yield base


async def _stream_token_ids(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int):
    stream = await client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    ids = []
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                ids += [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    return ids


def test_64_concurrent_streams_equal_the_reference(server, tiny_models, workload):
    import transformers

    prompts, max_tokens = workload

    async def main():
        client = openai.AsyncOpenAI(
            base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120
        )
        jobs = [_stream_token_ids(client, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
        return await asyncio.gather(*jobs)

    streamed = asyncio.run(main())
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_models("llama")), dtype=torch.float32
    ).eval()
    for i, (p, m, ours) in enumerate(zip(prompts, max_tokens, streamed, strict=True)):
        compare_greedy(ours, hf_greedy(hf, p, m), label=f"stream {i}")


def _sse_events(server: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_streamed_multi_prompt_matches_non_streamed(server):
    body = {
        "model": MODEL_NAME,
        "prompt": ["one two", "three", "four five six"],
        "max_tokens": 6,
        "temperature": 0,
        "n": 2,
        "ignore_eos": True,
        "logprobs": 2,
        "stream_options": {"include_usage": True},
    }
    plain = httpx.post(f"{server}/v1/completions", json=body, headers=AUTH, timeout=60).json()
    events = _sse_events(server, {**body, "stream": True})
    texts: dict[int, str] = {}
    logprob_counts: dict[int, int] = {}
    finishes: dict[int, str] = {}
    offsets: dict[int, list[int]] = {}
    for ev in events:
        for c in ev["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            logprob_counts[c["index"]] = logprob_counts.get(c["index"], 0) + len(
                c["logprobs"]["tokens"]
            )
            offsets.setdefault(c["index"], []).extend(c["logprobs"]["text_offset"])
            assert all(len(top) <= 2 for top in c["logprobs"]["top_logprobs"])
            if c["finish_reason"]:
                finishes[c["index"]] = c["finish_reason"]
    assert sorted(texts) == list(range(6))
    assert texts == {c["index"]: c["text"] for c in plain["choices"]}
    assert logprob_counts == dict.fromkeys(range(6), 6)
    for c in plain["choices"]:  # each token's text from where the one before it ended
        lp = c["logprobs"]
        ends = [o + len(t) for o, t in zip(lp["text_offset"], lp["tokens"], strict=True)]
        assert lp["text_offset"] == [0, *ends[:-1]]
        assert offsets[c["index"]] == lp["text_offset"]  # the stream carries them on
    assert finishes == dict.fromkeys(range(6), "length")
    assert events[-1]["usage"] == plain["usage"]
    assert plain["usage"]["completion_tokens"] == 6 * 6


def test_streamed_chat_logprobs(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    entries = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == 5
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)


def test_echo_is_refused_clearly(server):
    body = {"model": MODEL_NAME, "prompt": "x", "echo": True}
    r = httpx.post(f"{server}/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("completions", "suffix", "end"),
        ("completions", "best_of", 3),
        ("completions", "best_of", 0),
        ("completions", "best_of", -5),
        ("completions", "best_of", True),
        ("completions", "prompt_logprobs", 1),
        ("completions", "truncate_prompt_tokens", 4),
        ("completions", "bad_words", ["x"]),
        ("completions", "use_beam_search", True),
        ("completions", "include_stop_str_in_output", True),
        ("chat/completions", "echo", True),
        ("chat/completions", "chat_template", "{{ messages }}"),
        ("chat/completions", "chat_template_kwargs", {"enable_thinking": False}),
        ("chat/completions", "continue_final_message", True),
        ("chat/completions", "add_generation_prompt", False),
        ("chat/completions", "bad_words", ["x"]),
        ("completions", "guided_whitespace_pattern", "[ ]?"),
        ("chat/completions", "guided_decoding_backend", "outlines"),
    ],
)
def test_vllm_fields_not_implemented_are_refused_not_ignored(server, path, field, value):
    """A field that would change the answer, served as if absent, would answer something
    else than asked: a 400 naming it."""
    body = {"model": MODEL_NAME, "max_tokens": 2, field: value}
    body |= (
        {"prompt": "x"}
        if path == "completions"
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    r = httpx.post(f"{server}/v1/{path}", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and "not supported" in r.json()["error"]["message"]


def test_vllm_fields_at_their_unset_values_are_served(server):
    """Fields at their unset values (a client may send best_of 1, add_generation_prompt true)
    change nothing; unknown fields are ignored."""
    unset = {"best_of": 1, "suffix": None, "bad_words": [], "use_beam_search": False,
             "include_stop_str_in_output": False, "unknown_field": 5,
             "guided_decoding_backend": "xgrammar"}  # fmt: skip
    r = httpx.post(f"{server}/v1/completions", headers=AUTH,
                   json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, **unset})  # fmt: skip
    assert r.status_code == 200, r.text
    chat = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
            "add_generation_prompt": True, "chat_template_kwargs": {}, "echo": False}  # fmt: skip
    assert httpx.post(f"{server}/v1/chat/completions", json=chat, headers=AUTH).status_code == 200


def test_continuous_usage_stats_is_refused_and_include_usage_served(server):
    """vLLM's usage in every chunk is not implemented: asked for, a 400 naming it (it was
    accepted and ignored); usage in the last chunk works."""
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    r = httpx.post(f"{server}/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stream_options.continuous_usage_stats"
    body["stream_options"]["continuous_usage_stats"] = False
    r = httpx.post(f"{server}/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200 and '"usage"' in r.text
