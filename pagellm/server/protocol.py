"""Request bodies of the OpenAI API as we accept them (pydantic), and their sampling params.

Every field a client sends is typed and bounded here or in ``SamplingParams``: numbers must be
finite, integers in range, text valid Unicode (no lone surrogates, which JSON escapes allow but
no tokenizer or metric takes), lists and strings of bounded size. Anything else is a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from pagellm.engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)

MAX_USER_CHARS = 256
"""The ``user`` field names a tenant (fair scheduling, metrics): a short id, not a document."""


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (it holds a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
Int64 = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: Text | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    """OpenAI's: token id (a JSON object key) -> bias in [-100, 100] added to its logit."""
    allowed_token_ids: list[int] | None = None
    """vLLM's extension: sample only among these tokens."""
    user: Annotated[Text, Field(max_length=MAX_USER_CHARS)] | None = None
    priority: Int64 = 0
    return_tokens_as_token_ids: bool = False
    """vLLM's extension: logprobs name tokens as "token_id:{id}" instead of their text."""
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
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
        )


class CompletionRequest(_Common):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class TextPart(_Strict):
    """An OpenAI content part. Only text parts are served (the models are text-only)."""

    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
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
    tokens: list[Int64]


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """What the chat template renders: role and text of each message."""
    return [{"role": m.role, "content": m.text()} for m in messages]
