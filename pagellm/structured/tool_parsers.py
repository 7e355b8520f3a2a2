"""Tool calls out of generated text, as it streams: the same parser gives the streamed deltas and
the whole answer, so a client that reassembles the deltas gets exactly the non-streamed calls.

- ``RequiredCalls``: the JSON array that ``tool_choice: required`` constrains the output to;
  a call's name is sent once it is complete, its arguments as they are generated.
- ``NamedCall``: the whole output is the named function's arguments.
- ``auto`` parsers (``--tool-call-parser``, vLLM's names): ``hermes`` (``<tool_call>{"name",
  "arguments"}</tool_call>`` blocks amid text) and ``llama3_json`` (the output is one or more
  ``{"name", "parameters"}`` objects separated by ``;``, optionally after ``<|python_tag|>``).
  Text outside calls is content (a stretch of only whitespace between or after calls is not);
  a block that does not parse stays content, tags and all.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from pagellm.engine.errors import is_valid_unicode

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass(slots=True)
class CallDelta:
    """New text of call ``index``: ``name`` on its first delta only."""

    index: int
    name: str | None
    arguments: str


@dataclass(slots=True)
class ParsedCalls:
    """Everything a parser produced, accumulated (the non-streamed answer)."""

    content: str = ""
    names: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)

    def add(self, content: str, deltas: list[CallDelta]) -> None:
        self.content += content
        for d in deltas:
            if d.name is not None:
                self.names.append(d.name)
                self.arguments.append("")
            self.arguments[d.index] += d.arguments


class CallParser(ABC):
    """Feed the output's text as it grows; each call returns (new content, call deltas)."""

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[CallDelta]]: ...

    def finish(self) -> tuple[str, list[CallDelta]]:
        """The end of the output: what was held back."""
        return "", []

    def parse_all(self, text: str) -> ParsedCalls:
        parsed = ParsedCalls()
        parsed.add(*self.feed(text))
        parsed.add(*self.finish())
        return parsed


class NamedCall(CallParser):
    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        if self._started and not text:
            return "", []
        name = None if self._started else self.name
        self._started = True
        return "", [CallDelta(0, name, text)]

    def finish(self) -> tuple[str, list[CallDelta]]:
        return self.feed("")


@dataclass(slots=True)
class _Span:
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None


class RequiredCalls(CallParser):
    """The array ``[{"name": ..., "parameters": {...}}, ...]`` scanned as it grows (the grammar
    keeps the keys in this order); each character is looked at once, however the text arrives."""

    def __init__(self) -> None:
        self._scan = CallArrayScanner()
        self._sent_names = 0
        self._sent_args: list[int] = []

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        scan = self._scan
        scan.feed(text)
        deltas = []
        for i in range(self._sent_names, len(scan.spans)):
            if scan.spans[i].name is None:
                break
            deltas.append(CallDelta(i, scan.spans[i].name, ""))
            self._sent_names += 1
            self._sent_args.append(0)
        for i in range(self._sent_names):
            span = scan.spans[i]
            if (
                span.args_start is None
                or span.args_end is not None
                and self._sent_args[i] >= (span.args_end)
            ):
                continue
            begin = max(self._sent_args[i], span.args_start)
            end = span.args_end if span.args_end is not None else len(scan.text)
            if end > begin:
                piece = scan.text[begin:end]
                if deltas and deltas[-1].index == i:
                    deltas[-1].arguments += piece
                else:
                    deltas.append(CallDelta(i, None, piece))
                self._sent_args[i] = end
        return "", deltas


class CallArrayScanner:
    """Where each call's name and parameters are in a (possibly unfinished) JSON array of call
    objects, advanced over new text only: a string cut by the end of the text is resumed."""

    def __init__(self) -> None:
        self.text = ""
        self.spans: list[_Span] = []
        self._at = 0
        self._depth = 0
        self._expect_key = False
        self._key: str | None = None
        self._string_start: int | None = None
        """Where the string being read began (None: not in a string)."""
        self._escaped = False

    def feed(self, text: str) -> None:
        self.text += text
        text = self.text
        while self._at < len(text):
            i, ch = self._at, text[self._at]
            self._at += 1
            if self._string_start is not None:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._end_string(self._string_start, i)
                continue
            if ch == '"':
                self._string_start = i
            elif ch in "{[":
                self._open(ch, i)
            elif ch in "}]":
                self._depth -= 1
                span = self.spans[-1] if self.spans else None
                if (
                    self._depth == 2
                    and span
                    and span.args_end is None
                    and self._key == "parameters"
                ):
                    span.args_end = i + 1
            elif self._depth == 2 and ch == ":":
                self._expect_key = False
            elif self._depth == 2 and ch == ",":
                self._expect_key = True

    def _open(self, ch: str, i: int) -> None:
        if self._depth == 1 and ch == "{":
            self.spans.append(_Span())
            self._expect_key = True
        elif self._depth == 2 and self._key == "parameters" and self.spans[-1].args_start is None:
            self.spans[-1].args_start = i
        self._depth += 1

    def _end_string(self, start: int, end: int) -> None:
        self._string_start = None
        if self._depth != 2 or not self.spans:
            return
        value = json.loads(self.text[start : end + 1])
        span = self.spans[-1]
        if self._expect_key:
            self._key = value
        elif self._key == "name":
            span.name = value
        elif self._key == "parameters" and span.args_start is None:
            span.args_start, span.args_end = start, end + 1


def scan_call_array(text: str) -> list[_Span]:
    """The spans of ``text`` scanned at once (``CallArrayScanner`` for growing text)."""
    scanner = CallArrayScanner()
    scanner.feed(text)
    return scanner.spans


def _loads(text: str) -> Any:
    """``text`` as JSON, or None where it is not (json's errors are ValueErrors; nesting past
    the recursion limit is a RecursionError)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _call_from_json(obj: Any, args_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """A call's name and arguments (as JSON text) from its decoded object, or None if it is
    not one. JSON escapes can spell lone surrogates, which no response can carry as UTF-8: a
    name with one is not a call, and arguments with one keep their escapes. Arguments with a
    number past a float's range (``1e999``) or NaN / Infinity are not a call either: written
    again they would not be JSON."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if not is_valid_unicode(obj["name"]):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        return obj["name"], args.encode(errors="backslashreplace").decode()
    try:
        text = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return None
    return obj["name"], text if is_valid_unicode(text) else json.dumps(args)


class HermesCalls(CallParser):
    """Text between calls is content, unless it is only whitespace; that rule is about a
    whole stretch between two calls (or after the last), so whitespace that follows a call
    waits until text or the next call shows which it is: the streamed content then joins up
    to the non-streamed one however the text is cut."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self._calls = 0
        self._searched = 0
        """How much of an open call's body was searched for its end tag."""
        self._stretch_has_text = False
        """The stretch since the last call has had text other than whitespace (sent)."""

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._buffer += text
        content, deltas = "", []
        while True:
            if self._in_call:
                # the call's body so far was searched already: only its new tail can hold END
                end = self._buffer.find(self.END, max(0, self._searched - len(self.END) + 1))
                if end < 0:
                    self._searched = len(self._buffer)
                    break
                self._searched = 0
                content += self._close(self._buffer[:end], deltas, closed=True)
                self._buffer = self._buffer[end + len(self.END) :]
                continue
            start = self._buffer.find(self.START)
            if start < 0:
                ready = len(self._buffer) - _partial_suffix(self._buffer, self.START)
                if self._undecided(self._buffer[:ready]):
                    break  # whitespace after a call: it waits in the buffer
                content += self._text(self._buffer[:ready])
                self._buffer = self._buffer[ready:]
                break
            content += self._text(self._buffer[:start])
            self._buffer = self._buffer[start + len(self.START) :]
            self._in_call = True
        return content, deltas

    def finish(self) -> tuple[str, list[CallDelta]]:
        deltas: list[CallDelta] = []
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            return self._close(rest, deltas, closed=False), deltas
        return self._text(rest), deltas

    def _close(self, body: str, deltas: list[CallDelta], closed: bool) -> str:
        """A call block's body: a call, or (not a call) content again, tags and all."""
        self._in_call = False
        call = _call_from_json(_loads(body), ("arguments", "parameters"))
        if call is None:
            return self._text(self.START + body + (self.END if closed else ""))
        deltas.append(CallDelta(self._calls, call[0], call[1]))
        self._calls += 1
        self._stretch_has_text = False
        return ""

    def _undecided(self, text: str) -> bool:
        """Whether ``text`` is whitespace after a call whose stretch has no text yet."""
        return bool(self._calls) and not self._stretch_has_text and not text.strip()

    def _text(self, text: str) -> str:
        """Content: all of a stretch with text, none of one that is only whitespace between
        or after calls."""
        if self._undecided(text):
            return ""
        self._stretch_has_text = self._stretch_has_text or bool(text.strip())
        return text


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class Llama3JsonCalls(CallParser):
    """Calls only when the whole output is calls; decided at the end if it starts like one."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buffer = ""
        self._holding: bool | None = None

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self._buffer += text
        if self._holding is None:
            head = self._buffer.lstrip()
            if not head:
                return "", []
            if head.startswith("{") or head.startswith(self.TAG):
                self._holding = True
            elif self.TAG.startswith(head):
                return "", []
            else:
                self._holding = False
        if self._holding:
            return "", []
        out, self._buffer = self._buffer, ""
        return out, []

    def finish(self) -> tuple[str, list[CallDelta]]:
        text, self._buffer = self._buffer, ""
        calls = _json_calls(text.strip().removeprefix(self.TAG).strip())
        if calls is None:
            return text, []
        return "", [CallDelta(i, name, args) for i, (name, args) in enumerate(calls)]


def _json_calls(text: str) -> list[tuple[str, str]] | None:
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            obj, end = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        call = _call_from_json(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        at = end
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
    return calls or None


def auto_parser(name: str) -> CallParser:
    if name == "hermes":
        return HermesCalls()
    if name == "llama3_json":
        return Llama3JsonCalls()
    raise ValueError(f"unknown tool call parser {name!r} (one of {', '.join(TOOL_CALL_PARSERS)})")
