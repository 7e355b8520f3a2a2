"""Request bodies of the OpenAI API as we accept them (pydantic), and their sampling params."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagellm.engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None
    priority: int = 0
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
        )


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]
