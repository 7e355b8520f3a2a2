"""Locust scenario of the seeds' chat users against a pagellm server or gateway (or any
OpenAI-compatible endpoint): each user asks a 100-300-character question, streams a ~200-token
answer, reads it, thinks, asks again.

    locust -f benchmarks/locustfile.py --headless -u 32 -r 4 -t 2m --host http://127.0.0.1:8080

Environment: PAGELLM_API_KEY (sent as a Bearer token), PAGELLM_MODEL (default: the server's
first model), PAGELLM_MAX_TOKENS (200), PAGELLM_THINK_S ("1,5": think time range, seconds).
Locust's table then has three rows per request kind: "chat" (the whole streamed answer),
"chat TTFT" (time to the first content chunk) and, on errors, the failures.
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, events, task

TOPICS = [
    "the paged KV cache in an inference server", "how continuous batching keeps a GPU busy",
    "why prefix caching saves time on chat prompts", "tensor parallelism on two machines",
    "the difference between AWQ and FP8 quantization", "speculative decoding with a draft model",
    "how nginx should proxy server-sent events", "what a circuit breaker does in a gateway",
    "rate limiting with a token bucket", "how to size a KV cache for 32 users",
]  # fmt: skip
ASKS = [
    "Can you explain {t} in a few sentences, with one concrete example?",
    "I am new to this. What is {t}, and when does it matter in production?",
    "Give me a short, practical summary of {t}; what are the pitfalls to avoid?",
]


def question(rng: random.Random) -> str:
    """A 100-300-character question."""
    text = rng.choice(ASKS).format(t=rng.choice(TOPICS))
    while len(text) < 100:
        text += " Please keep it simple."
    return text[:300]


_think = [float(x) for x in os.environ.get("PAGELLM_THINK_S", "1,5").split(",")]


class ChatUser(HttpUser):
    wait_time = between(_think[0], _think[-1])

    def on_start(self) -> None:
        self.rng = random.Random()
        key = os.environ.get("PAGELLM_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.model = os.environ.get("PAGELLM_MODEL") or self._first_model()
        self.max_tokens = int(os.environ.get("PAGELLM_MAX_TOKENS", "200"))

    def _first_model(self) -> str | None:
        resp = self.client.get("/v1/models", headers=self.headers, name="models")
        data = resp.json().get("data") if resp.ok else None
        return data[0]["id"] if data else None

    @task
    def chat(self) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": question(self.rng)}],
            "max_tokens": self.max_tokens,
            "temperature": 0.7,
            "stream": True,
        }
        start = time.perf_counter()
        first = None
        with self.client.post("/v1/chat/completions", json=body, headers=self.headers,
                              stream=True, catch_response=True, name="chat") as resp:  # fmt: skip
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            chars = 0
            for line in resp.iter_lines():
                if not line or not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    resp.failure(event["error"].get("message", "error event"))
                    return
                delta = (event.get("choices") or [{}])[0].get("delta", {})
                if delta.get("content"):
                    chars += len(delta["content"])
                    if first is None:
                        first = time.perf_counter()
            if first is None:
                resp.failure("no content streamed")
                return
            # a streamed request's time in Locust is to its headers: report the whole answer
            resp.request_meta["response_time"] = 1000 * (time.perf_counter() - start)
            resp.request_meta["response_length"] = chars
            resp.success()
        events.request.fire(
            request_type="POST", name="chat TTFT", response_time=1000 * (first - start),
            response_length=chars, exception=None, context={},
        )  # fmt: skip
