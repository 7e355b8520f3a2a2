"""OpenAI tool calling on top of structured outputs: what ``tool_choice`` constrains the output
to, and how the tools reach the model's chat template.

``required`` makes the output a JSON array of ``{"name": ..., "parameters": {...}}`` (one item
unless ``parallel_tool_calls``), each matching one tool's parameter schema; a named function
makes the output that function's arguments; ``auto`` and ``none`` leave the output free (``auto``
then parses the model's own tool-call format, ``pagellm.structured.tool_parsers``).

A chat template that renders tools (it reads ``tools``) gets them as Hugging Face passes them.
One that does not (the default SmolLM2's) would hide them from the model, so pagellm writes
them into the system message itself, with the Hermes convention (``<tool_call>{"name": ...,
"arguments": ...}</tool_call>``), and renders earlier assistant tool calls that way as text.
"""

from __future__ import annotations

import json
from typing import Any

from pagellm.structured.params import (
    StructuredOutputError,
    StructuredOutputsParams,
    map_schema_refs,
)

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def tool_constraint(
    tools: list[dict[str, Any]],
    tool_choice: str | dict[str, Any],
    parallel_tool_calls: bool = True,
) -> StructuredOutputsParams | None:
    """``tools``: OpenAI function definitions ``{"name", "description", "parameters"}``;
    ``tool_choice``: none / auto / required, or ``{"name": ...}`` for one function."""
    if isinstance(tool_choice, dict):
        name = tool_choice["name"]
        tool = next((t for t in tools if t["name"] == name), None)
        if tool is None:
            raise StructuredOutputError(
                f"tool_choice names the function {name!r}, which is not among the tools",
                "tool_choice",
            )
        return _tools_constraint(tool.get("parameters") or ANY_OBJECT)
    if tool_choice != "required":
        return None
    calls: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [_call_schema(t, f"#/$defs/tool_{i}") for i, t in enumerate(tools)]},
        "$defs": {f"tool_{i}": _rebased(t, f"#/$defs/tool_{i}") for i, t in enumerate(tools)},
    }
    if not parallel_tool_calls:
        calls["maxItems"] = 1
    return _tools_constraint(calls)


def _tools_constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    """The output's schema, made of the tools' parameters: a size or depth it may not have is
    the tools' fault (``param`` names them)."""
    try:
        return StructuredOutputsParams(json=schema)
    except StructuredOutputError as exc:
        raise StructuredOutputError(str(exc), "tools") from None


def _call_schema(tool: dict[str, Any], parameters_ref: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [tool["name"]]},
            "parameters": {"$ref": parameters_ref},
        },
        "required": ["name", "parameters"],
    }


def _rebased(tool: dict[str, Any], where: str) -> Any:
    """The tool's parameter schema placed at ``where`` in the wrapper: its own references
    (``#``, ``#/$defs/...``) are rewritten to point inside it there, so they resolve as they
    did in the tool's schema alone."""
    parameters = tool.get("parameters") or ANY_OBJECT
    try:
        return map_schema_refs(
            parameters, lambda ref: where + ref[1:] if ref.startswith("#") else ref
        )
    except RecursionError:
        raise StructuredOutputError(
            f"the parameters of the tool {tool['name']!r} are nested too deeply", "tools"
        ) from None


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def messages_for_template(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], renders_tools: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template arguments that show the tools to the model."""
    if renders_tools:
        return messages, {"tools": [{"type": "function", "function": t} for t in tools]}
    out = [_as_text_turn(m) for m in messages]
    preamble = tools_system_prompt(tools)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}"}
    else:
        out.insert(0, {"role": "system", "content": preamble})
    return out, {}


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps({"type": "function", "function": t}) for t in tools)
    return (
        "You may call functions to help with the user's request. The functions are:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call a function, reply with its name and arguments as JSON inside tags:\n"
        '<tool_call>{"name": "<function name>", "arguments": {<arguments>}}</tool_call>'
    )


def _as_text_turn(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's tool calls written as Hermes text, for a template that does not
    render ``tool_calls``."""
    calls = message.get("tool_calls")
    if not calls:
        return {k: v for k, v in message.items() if k in ("role", "content")}
    text = "\n".join(
        "<tool_call>"
        + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        + "</tool_call>"
        for c in calls
    )
    content = message.get("content") or ""
    return {"role": message["role"], "content": f"{content}\n{text}" if content else text}
