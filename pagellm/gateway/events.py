"""Server-sent events as the gateway relays them: whole events cut out of a replica's byte chunks
(however the network split or joined them), and the token usage an event carries."""

from __future__ import annotations

import json
import re

_EVENT_END = re.compile(rb"\r?\n\r?\n")
MAX_PARTIAL = 1 << 20
"""Bytes of an unfinished event held back at most; beyond them they are passed on as they are."""


class EventSplitter:
    """Feed byte chunks, get whole events (each with its blank-line end)."""

    def __init__(self, limit: int = MAX_PARTIAL) -> None:
        self.limit = limit
        self.partial = bytearray()

    def feed(self, chunk: bytes) -> list[bytes]:
        # an event end may straddle the chunks: look again only at the last 3 bytes held back,
        # so a long unfinished event is scanned once, not once per chunk
        search = max(0, len(self.partial) - 3)
        self.partial += chunk
        events, start = [], 0
        for end in _EVENT_END.finditer(self.partial, search):
            events.append(bytes(self.partial[start : end.end()]))
            start = end.end()
        del self.partial[:start]
        if len(self.partial) > self.limit:
            events.append(self.rest())
        return events

    def rest(self) -> bytes:
        """What is left unfinished when the stream ends."""
        rest = bytes(self.partial)
        self.partial.clear()
        return rest


def usage_of(event: bytes) -> tuple[int, bool] | None:
    """(prompt + completion tokens, whether the event carries nothing else) for an event with a
    usage object; None for any other event, or one that does not parse."""
    if b'"usage"' not in event:
        return None
    for line in event.splitlines():
        if not line.startswith(b"data:"):
            continue
        try:
            payload = json.loads(line[len(b"data:") :])
            usage = payload["usage"]
            tokens = int(usage["prompt_tokens"]) + int(usage["completion_tokens"])
        except (ValueError, KeyError, TypeError):
            return None
        return tokens, not payload.get("choices")
    return None
