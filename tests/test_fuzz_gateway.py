"""Property-based fuzzing through `pagellm gateway` (with API keys and a token limit) in front of
a real `pagellm serve`: hostile bodies and headers never get a 5xx, failures are OpenAI error
objects, and a normal request still goes through after every case."""

from __future__ import annotations

import httpx
import pytest
from fuzz_requests import CHAT, COMPLETION, FUZZ_SETTINGS, RAW, SERVER_FLAGS, check_answer, encode
from hypothesis import given, note
from hypothesis import strategies as st
from server_helpers import running_gateway, running_server

KEY = "fuzz-key"
GATEWAY_CONFIG = f"""
keys:
  - name: fuzzer
    key: {KEY}
    tokens_per_minute: 100000000
    max_concurrent: 64
"""
HEADERS = st.one_of(
    st.just({}),
    st.fixed_dictionaries(
        {},
        optional={
            "accept": st.sampled_from(["text/event-stream", "*/*", "application/json"]),
            "x-request-id": st.text(alphabet="abc-_0123", max_size=20),
        },
    ),
)


@pytest.fixture(scope="module")
def fuzz_gateway(tiny_models, tmp_path_factory):
    config = tmp_path_factory.mktemp("gw") / "gateway.yaml"
    config.write_text(GATEWAY_CONFIG)
    with (
        running_server(tiny_models("llama"), *SERVER_FLAGS) as (_, replica),
        running_gateway(replica, extra=("--config", str(config))) as gw,
        httpx.Client(base_url=gw, timeout=60) as client,
    ):
        yield client


def fire(client: httpx.Client, path: str, body, headers: dict[str, str]) -> None:
    raw = encode(body)
    note(f"{path} {raw[:500]!r}")
    auth = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    check_answer(client.post(path, content=raw, headers={**headers, **auth}), raw)
    normal = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=auth)
    assert normal.status_code == 200, f"not serving after {path} {raw[:300]!r}: {normal.text}"


@pytest.mark.parametrize(("path", "bodies"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])  # fmt: skip
def test_fuzzed_bodies_never_break_the_gateway(fuzz_gateway, path, bodies):
    @FUZZ_SETTINGS
    @given(body=st.one_of(bodies, RAW), headers=HEADERS)
    def run(body, headers):
        fire(fuzz_gateway, path, body, headers)

    run()


def test_keyless_and_wrong_keys_are_401_objects(fuzz_gateway):
    for auth in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic x"}):
        resp = fuzz_gateway.post("/v1/completions", json={"prompt": "hi"}, headers=auth)
        assert resp.status_code == 401 and set(resp.json()["error"]) >= {"message", "type"}
