"""Request bodies of the OpenAI API as we accept them (pydantic), and their sampling params.

Every field a client sends is typed and bounded here or in ``SamplingParams``: numbers must be
finite, integers in range, text valid Unicode (no lone surrogates, which JSON escapes allow but
no tokenizer or metric takes), lists and strings of bounded size. Anything else is a 400.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
)

from pagellm.engine.errors import check_unicode
from pagellm.engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)
from pagellm.server.errors import quoted_name
from pagellm.structured.params import StructuredOutputError, StructuredOutputsParams

MAX_USER_CHARS = 256
"""The ``user`` field names a tenant (fair scheduling, metrics): a short id, not a document."""


Text = Annotated[str, AfterValidator(check_unicode)]
Int64 = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]


def _id_key(key: Any) -> Any:
    """A JSON object key naming a token id: its decimal digits as they stand (pydantic would
    also take " 5", "1_000" or "5.0")."""
    if isinstance(key, str) and not (key.isascii() and key.lstrip("-").isdigit()):
        raise ValueError("keys must be token ids (decimal integers)")
    return key


TokenId = StrictInt
"""A token id as the client wrote it: an integer, not a bool, float or string (pydantic's lax
mode would turn ``true`` or ``1.0`` into token 1 before ``SamplingParams`` sees it)."""
TokenIdKey = Annotated[int, BeforeValidator(_id_key)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Strict):
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "continuous_usage_stats": (None, False),  # vLLM's usage in every chunk
    }
    """As ``_Common.UNSUPPORTED``, for the stream's options."""

    include_usage: bool = False


JsonValue = dict[str, Any] | Text


class StructuredOutputsBody(_Strict):
    """vLLM's ``structured_outputs`` request field: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: JsonValue | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    """vLLM's: no fallback to another backend (pagellm has one, so there is none anyway)."""


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: Text = "response"
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(_Strict):
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "echo": (None, False),  # no prompt logprobs to echo with
        "suffix": (None, ""),
        "prompt_logprobs": (None,),
        "truncate_prompt_tokens": (None,),
        "bad_words": (None, []),
        "use_beam_search": (None, False),
        "include_stop_str_in_output": (None, False),
        "guided_whitespace_pattern": (None, ""),
        # the engine's backend is xgrammar; vLLM also refuses a request's other backend
        "guided_decoding_backend": (None, "", "auto", "xgrammar"),
    }
    """vLLM / OpenAI request fields pagellm does not implement, and the values that mean
    "unset": a request giving another value is refused (a 400 naming the field) instead of
    served as if the field were absent. ``best_of`` is refused above ``n`` and below 1."""

    model: Text | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[TokenIdKey, StrictFloat] | None = None
    """OpenAI's: token id (a JSON object key) -> bias in [-100, 100] added to its logit."""
    allowed_token_ids: list[TokenId] | None = None
    """vLLM's extension: sample only among these tokens."""
    user: Annotated[Text, Field(max_length=MAX_USER_CHARS)] | None = None
    priority: Int64 = 0
    return_tokens_as_token_ids: bool = False
    """vLLM's extension: logprobs name tokens as "token_id:{id}" instead of their text."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    structured_outputs: StructuredOutputsBody | None = None
    response_format: ResponseFormat | None = None
    guided_json: JsonValue | None = None
    """vLLM's older names for the structured_outputs fields."""
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """Raises ParamError (a ValueError naming the parameter) on out-of-range values."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            structured_outputs=structured,
        )

    def unsupported_field(self) -> str | None:
        """The first field of ``UNSUPPORTED`` (or ``best_of`` outside [1, n]) this request sets
        to a value that would change its answer, or None."""
        name = _set_unsupported(self)
        if name is None and self.stream_options is not None:
            name = _set_unsupported(self.stream_options, "stream_options.")
        if name is not None:
            return name
        best_of = (self.model_extra or {}).get("best_of")
        if best_of is not None and not (type(best_of) is int and 1 <= best_of <= self.n):
            return "best_of"  # above n is not built; below 1 (or not an integer) is no value
        return None

    def output_constraint(self) -> tuple[StructuredOutputsParams | None, str]:
        """The request's structured-output constraint from ``structured_outputs``,
        ``response_format`` or a ``guided_*`` field, and that field's name; more than one of
        them is an error (StructuredOutputError, a 400)."""
        found: list[tuple[str, StructuredOutputsParams]] = []
        if self.structured_outputs is not None:
            b = self.structured_outputs
            found.append(("structured_outputs", _constraint(
                "structured_outputs", json=b.json_, regex=b.regex, choice=b.choice,
                grammar=b.grammar, json_object=b.json_object,
                disable_any_whitespace=b.disable_any_whitespace,
            )))  # fmt: skip
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", _constraint("response_format", json_object=True)))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise StructuredOutputError(
                    "response_format of type json_schema needs json_schema.schema",
                    "response_format",
                )
            found.append(
                ("response_format", _constraint("response_format", json=fmt.json_schema.schema_))
            )
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                found.append((name, _constraint(name, **{kind: value})))
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise StructuredOutputError(
                f"give one structured-output constraint, not several ({names})", found[1][0]
            )
        return (found[0][1], found[0][0]) if found else (None, "structured_outputs")


def _set_unsupported(model: BaseModel, prefix: str = "") -> str | None:
    """The first of ``model.UNSUPPORTED``'s fields it sets to other than an unset value."""
    for name, value in (model.model_extra or {}).items():
        unset = model.UNSUPPORTED.get(name)
        if unset is not None and not any(_same(value, u) for u in unset):
            return prefix + name
    return None


def _same(value: Any, unset: Any) -> bool:
    """JSON equality that keeps booleans apart from numbers (``1`` is not ``true``)."""
    return type(value) is type(unset) and value == unset


def _constraint(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except StructuredOutputError as exc:
        raise StructuredOutputError(str(exc), param) from None


class CompletionRequest(_Common):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class TextPart(_Strict):
    """An OpenAI content part. Only text parts are served (the models are text-only)."""

    type: Literal["text"]
    text: Text


class FunctionCall(_Strict):
    name: Text
    arguments: Text = "{}"
    """JSON text, as OpenAI sends it."""


class ToolCall(_Strict):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


def _text_parts_only(content: Any) -> Any:
    """A list of content parts may hold only text parts: say so, rather than pydantic's
    "Input should be a valid string" of the union's first member."""
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(
                    f"content parts of type {quoted_name(kind, 40)} are not served: the model "
                    "takes text only (parts of type 'text')"
                )
    return content


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[Text | list[TextPart] | None, BeforeValidator(_text_parts_only)] = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    """An assistant turn's calls (sent back in the next request of a tool conversation)."""
    tool_call_id: Text | None = None
    """A tool turn: the call whose result this is."""

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]


class FunctionDefinition(_Strict):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments (none: any JSON object)."""
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_Common):
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_Common.UNSUPPORTED,
        "chat_template": (None,),
        "chat_template_kwargs": (None, {}),
        "continue_final_message": (None, False),
        "add_generation_prompt": (None, True),
    }
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: "auto" when tools are given, else "none" (OpenAI's and vLLM's)."""
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class TokenizeRequest(_Strict):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: Text | None = None
    tokens: list[Annotated[TokenId, Field(ge=SEED_MIN, le=SEED_MAX)]]


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """What the chat template renders: role and text of each message, and the tool calls and
    tool-call ids of a tool conversation (arguments as a mapping where they are JSON, as
    templates that render tool calls expect)."""
    out = []
    for m in messages:
        item: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            item["name"] = m.name
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            item["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _arguments(c.function)}}
                for c in m.tool_calls
            ]  # fmt: skip
        out.append(item)
    return out


def _arguments(call: FunctionCall) -> Any:
    """The arguments as a mapping where they are JSON, else as the text they are (not JSON,
    an integer over Python's digit limit, or nested past the recursion limit)."""
    try:
        return json.loads(call.arguments)
    except (ValueError, RecursionError):
        return call.arguments
