"""Property-based fuzzing of a real `pagellm serve` (hypothesis): hostile bodies for every
endpoint never get a 5xx, failures are OpenAI error objects, and after every case the engine
still serves a normal request. Seeded (derandomized) so CI sees the same few hundred cases;
PAGELLM_FUZZ_EXAMPLES raises the count for a longer local run."""

from __future__ import annotations

import httpx
import pytest
from fuzz_requests import ENDPOINTS, FUZZ_SETTINGS, RAW, SERVER_FLAGS, check_answer, encode
from hypothesis import given, note
from hypothesis import strategies as st
from server_helpers import AUTH, running_server


@pytest.fixture(scope="module")
def fuzz_server(tiny_models):
    with (
        running_server(tiny_models("llama"), *SERVER_FLAGS) as (_, base),
        httpx.Client(base_url=base, headers=AUTH, timeout=60) as client,
    ):
        yield client


def fire(client: httpx.Client, path: str, body) -> None:
    raw = encode(body)
    note(f"{path} {raw[:500]!r}")
    resp = client.post(path, content=raw, headers={"content-type": "application/json"})
    check_answer(resp, raw)
    normal = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert normal.status_code == 200, f"not serving after {path} {raw[:300]!r}: {normal.text}"


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_fuzzed_bodies_never_break_the_server(fuzz_server, path):
    @FUZZ_SETTINGS
    @given(body=st.one_of(ENDPOINTS[path], RAW))
    def run(body):
        fire(fuzz_server, path, body)

    run()
