"""Errors the engine raises for bad requests; the server maps them onto HTTP statuses."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request that can never run; ``code`` and ``param`` follow OpenAI's error fields."""

    def __init__(self, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


def is_valid_unicode(text: str) -> bool:
    """False for a text holding a lone surrogate (JSON's ``\\udcff`` escape gives one): it
    cannot be encoded as UTF-8, tokenized or sent back."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_unicode(text: str) -> str:
    """``text`` if it is valid Unicode (``is_valid_unicode``), else a RequestRejected."""
    if not is_valid_unicode(text):
        raise RequestRejected("text is not valid Unicode (it holds a lone surrogate)")
    return text


class ContextLengthExceeded(RequestRejected):
    def __init__(
        self,
        prompt_tokens: int,
        max_tokens: int | None,
        max_model_len: int,
        at_least: bool = False,
    ) -> None:
        """``at_least``: ``prompt_tokens`` is a lower bound (the prompt was not tokenized)."""
        wanted = prompt_tokens + (max_tokens or 0)
        detail = f"{'at least ' if at_least else ''}{prompt_tokens} in the prompt"
        if max_tokens:
            detail += f" + {max_tokens} requested for the completion = {wanted}"
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens; "
            f"the request needs {detail}.",
            code="context_length_exceeded",
            param="messages" if max_tokens is None else "max_tokens",
        )
