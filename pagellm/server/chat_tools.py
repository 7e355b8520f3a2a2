"""Tool calling in chat completions: what ``tools`` / ``tool_choice`` ask of a request (its
output constraint, how the template sees the tools) and how each choice's text becomes
``message.tool_calls`` or streamed ``delta.tool_calls``, as OpenAI and vLLM send them.

finish_reason follows vLLM: ``tool_calls`` when ``auto`` found calls or ``required`` was
enforced, ``stop`` for a named function.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from pagellm.server.errors import APIError
from pagellm.structured.params import StructuredOutputsParams
from pagellm.structured.tool_parsers import (
    CallDelta,
    CallParser,
    NamedCall,
    RequiredCalls,
    auto_parser,
)
from pagellm.structured.tools import tool_constraint


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """``mode``: none (no tool handling), auto, required or named (``name``)."""

    mode: str
    tools: list[dict[str, Any]] = field(default_factory=list)
    name: str | None = None
    parser: str | None = None
    constraint: StructuredOutputsParams | None = None

    def new_parser(self) -> CallParser | None:
        if self.mode == "named":
            return NamedCall(self.name or "")
        if self.mode == "required":
            return RequiredCalls()
        if self.mode == "auto":
            return auto_parser(self.parser or "hermes")
        return None

    def finish_reason(
        self, reason: str | None, num_calls: int, stop_reason: int | str | None = None
    ) -> str | None:
        """``tool_calls`` for an output that ended with calls. Not for a ``required`` array
        that a stop string cut (``stop_reason`` the string): its last call may be unfinished
        (the parser sends a call once its name is known), as with ``length``."""
        cut = self.mode == "required" and isinstance(stop_reason, str)
        if reason == "stop" and num_calls and self.mode in ("auto", "required") and not cut:
            return "tool_calls"
        return reason


def plan_tools(body: Any, auto_enabled: bool, parser: str | None) -> ToolPlan:
    """The request's tool handling; a choice it cannot have is a 400 (vLLM's messages)."""
    tools = [t.function.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise APIError(400, "tool_choice needs tools: none were given", param="tool_choice")
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if not (auto_enabled and parser):
            raise APIError(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                param="tool_choice",
            )
        return ToolPlan("auto", tools, parser=parser)
    if choice == "required":
        constraint = tool_constraint(tools, "required", body.parallel_tool_calls)
        return ToolPlan("required", tools, constraint=constraint)
    name = choice.function.name
    return ToolPlan("named", tools, name, constraint=tool_constraint(tools, {"name": name}))


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ChoiceCalls:
    """One choice's tool calls: the deltas to stream, and what was sent in total."""

    def __init__(self, parser: CallParser) -> None:
        self.parser = parser
        self.ids: list[str] = []
        self.names: list[str] = []
        self.arguments: list[str] = []
        self.content = ""

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        return self._deltas(*self.parser.feed(text))

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self._deltas(*self.parser.finish())

    def _deltas(self, content: str, calls: list[CallDelta]) -> tuple[str, list[dict[str, Any]]]:
        self.content += content
        out: list[dict[str, Any]] = []
        for d in calls:
            if d.name is not None:
                self.ids.append(call_id())
                self.names.append(d.name)
                self.arguments.append("")
                out.append({"index": d.index, "id": self.ids[d.index], "type": "function",
                            "function": {"name": d.name, "arguments": d.arguments}})  # fmt: skip
            else:
                out.append({"index": d.index, "function": {"arguments": d.arguments}})
            self.arguments[d.index] += d.arguments
        return content, out

    def message(self) -> dict[str, Any]:
        calls = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
            for i, n, a in zip(self.ids, self.names, self.arguments, strict=True)
        ]
        return {"role": "assistant", "content": self.content or None, "tool_calls": calls}
