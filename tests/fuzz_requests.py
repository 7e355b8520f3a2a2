"""Hypothesis strategies for hostile request bodies, and the checks every answer must pass.

Bodies mix well-formed fields with wrong types, extreme and non-finite numbers, huge lists,
invalid Unicode (lone surrogates), deep nesting, unknown fields and bytes that are not JSON.
Shared by the server and gateway fuzz tests.
"""

from __future__ import annotations

import json
import math
import os

import httpx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("PAGELLM_FUZZ_EXAMPLES", "60"))
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
"""Seeded, so CI runs the same cases each time; PAGELLM_FUZZ_EXAMPLES=1000 for a long run."""
SERVER_FLAGS = ("--max-model-len", "64", "--max-seqs-per-request", "8")
"""Small limits keep every accepted request cheap: a few tokens, a few sequences."""

EXTREME_INTS = [0, -1, 1, 2, 127, 128, 129, 49151, 49152, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]  # fmt: skip
EXTREME_FLOATS = [0.0, -0.0, 1e-300, -1e-300, 1e300, -1e300, math.inf, -math.inf, math.nan, 0.5, 2.5]  # fmt: skip
ODD_TEXT = ["\ud800", "\udcff", "a\udfffb", "\x00", "\u202e", "💥" * 50, "", " ", "x" * 5000]

texts = st.one_of(st.text(max_size=40), st.sampled_from(ODD_TEXT))
numbers = st.one_of(
    st.sampled_from(EXTREME_INTS),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(EXTREME_FLOATS),
    st.floats(allow_nan=True, allow_infinity=True),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
huge_lists = st.builds(lambda v, n: [v] * n, st.one_of(st.integers(0, 10), st.just([1])), st.integers(500, 3000))  # fmt: skip


def field(good: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: a plausible one most of the time, anything otherwise."""
    return st.one_of(good, good, json_values, st.sampled_from(EXTREME_INTS), huge_lists)


SMALL = st.integers(1, 4)
COMMON = {
    "model": field(st.sampled_from(["tiny-llama", "other"])),
    "max_tokens": field(SMALL),
    "temperature": field(st.sampled_from([0.0, 0.7, 1.0])),
    "top_p": field(st.sampled_from([0.5, 1.0])),
    "top_k": field(st.sampled_from([0, -1, 5])),
    "min_p": field(st.sampled_from([0.0, 0.1])),
    "seed": field(st.integers(-(2**63), 2**63 - 1)),
    "n": field(st.integers(1, 3)),
    "stop": field(st.one_of(texts, st.lists(texts, max_size=4))),
    "stop_token_ids": field(st.lists(st.integers(0, 100), max_size=4)),
    "presence_penalty": field(st.floats(-2, 2)),
    "frequency_penalty": field(st.floats(-2, 2)),
    "repetition_penalty": field(st.floats(0.5, 2)),
    "min_tokens": field(st.integers(0, 2)),
    "logit_bias": field(st.dictionaries(st.integers(0, 100).map(str), st.floats(-100, 100), max_size=3)),
    "allowed_token_ids": field(st.lists(st.integers(0, 100), min_size=1, max_size=4)),
    "user": field(texts),
    "priority": field(st.integers(-3, 3)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "ignore_eos": field(st.booleans()),
    "return_tokens_as_token_ids": field(st.booleans()),
}  # fmt: skip
messages = st.lists(
    st.fixed_dictionaries(
        {"role": field(st.sampled_from(["user", "system", "assistant"]))},
        optional={
            "content": field(
                st.one_of(
                    texts,
                    st.lists(
                        st.fixed_dictionaries(
                            {"type": field(st.just("text")), "text": field(texts)}
                        ),
                        max_size=3,
                    ),
                )
            )
        },
    ),
    max_size=4,
)
prompts = st.one_of(
    texts,
    st.lists(texts, max_size=3),
    st.lists(st.integers(-5, 60000), max_size=20),
    st.lists(st.lists(st.integers(0, 100), max_size=5), max_size=3),
)


def _body(required: dict, optional: dict) -> st.SearchStrategy:
    return st.fixed_dictionaries(required, optional=optional)


COMPLETION = _body({}, {"prompt": field(prompts), **COMMON, "logprobs": field(st.integers(0, 3))})
CHAT = _body(
    {},
    {
        "messages": field(messages),
        **COMMON,
        "max_completion_tokens": field(SMALL),
        "logprobs": field(st.booleans()),
        "top_logprobs": field(st.integers(0, 3)),
    },
)
TOKENIZE = _body({}, {"prompt": field(texts), "messages": field(messages), "model": field(texts)})
DETOKENIZE = _body({}, {"tokens": field(st.lists(st.integers(-10, 60000), max_size=20))})
RAW = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"null", b"[]", b'"x"', b"{", b"{}" * 3, b"\xff\xfe{}"]),
    st.integers(100, 20000).map(lambda d: b'{"prompt": ' + b"[" * d + b"]" * d + b"}"),
)

SERVER_FAULTS = ("internal_server_error", "service_unavailable")
"""Error types of a server-side fault: a fuzzed request must never cause one."""

ENDPOINTS = {
    "/v1/completions": COMPLETION,
    "/v1/chat/completions": CHAT,
    "/tokenize": TOKENIZE,
    "/detokenize": DETOKENIZE,
}


def encode(body) -> bytes:
    """JSON as a hostile client writes it: NaN/Infinity and lone surrogates (as escapes)."""
    return body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()


def check_answer(resp: httpx.Response, body: bytes) -> None:
    """Never a 5xx; a failure is an OpenAI error object; a stream ends with [DONE]."""
    where = f"{resp.request.url.path} {body[:300]!r}"
    assert resp.status_code < 500, f"{resp.status_code} {resp.text[:300]} for {where}"
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = [ln[6:] for ln in resp.text.split("\n") if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"stream without [DONE] for {where}"
        for event in events[:-1]:
            payload = json.loads(event)
            if "error" in payload:
                assert set(payload["error"]) == {"message", "type", "param", "code"}, where
                assert payload["error"]["type"] not in SERVER_FAULTS, f"{event} for {where}"
        return
    payload = resp.json()
    if resp.status_code != 200:
        err = payload.get("error")
        assert isinstance(err, dict), f"not an error object: {resp.text[:300]} for {where}"
        assert set(err) == {"message", "type", "param", "code"}, where
