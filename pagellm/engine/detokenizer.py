"""Incremental detokenization that never emits broken UTF-8, and stop strings.

Each step decodes only a short window of tokens: the text of ``tokens[prefix:read]`` is already
emitted; decoding ``tokens[prefix:]`` and taking what lies past it gives the new text. While the
new text ends in U+FFFD (a multi-byte character split across tokens) nothing is emitted. A few
prompt tokens seed the window so that tokenizers which drop a leading space when decoding a
sequence start (SentencePiece) still give the right first word.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

DecodeFn = Callable[[list[int], bool], str]
"""decode(token_ids, skip_special_tokens) -> text"""

_PROMPT_CONTEXT = 5
_MAX_PENDING = 8
"""Tokens held undecoded while they add no text or the text ends in U+FFFD. A character is
at most 4 bytes, so past this the run is bytes that will never form one (let out as U+FFFD,
keeping the last ``_INCOMPLETE_TAIL`` tokens, which may hold a character still being
completed) or tokens without text (skipped special tokens). Without the bound an output of
such tokens would be decoded whole again at every step: quadratic in its length."""
_INCOMPLETE_TAIL = 3


@dataclass(slots=True)
class IncrementalDetokenizer:
    decode: DecodeFn
    skip_special_tokens: bool
    stop: list[str]
    tokens: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""

    @classmethod
    def for_prompt(
        cls, decode: DecodeFn, prompt_ids: list[int], skip_special: bool, stop: list[str]
    ) -> IncrementalDetokenizer:
        context = list(prompt_ids[-_PROMPT_CONTEXT:])
        return cls(decode, skip_special, stop, context, 0, len(context))

    @property
    def stop_holdback(self) -> int:
        """Characters a stream must hold back: they may be the start of a stop string."""
        return max((len(s) for s in self.stop), default=1) - 1

    def add_tokens(self, token_ids: list[int], check_stop: bool = True) -> str | None:
        """Append tokens and extend ``text``; returns the stop string that matched, if any
        (``check_stop`` False: none is looked for, as while min_tokens is not reached)."""
        self.tokens.extend(token_ids)
        end = len(self.tokens)
        stuck = end - self.read_offset > _MAX_PENDING
        prefix_text = self.decode(self.tokens[self.prefix_offset : self.read_offset], self.skip)
        full = self.decode(self.tokens[self.prefix_offset :], self.skip)
        if full.endswith("\ufffd"):
            if not stuck:
                return None
            end -= _INCOMPLETE_TAIL
            full = self.decode(self.tokens[self.prefix_offset : end], self.skip)
        if len(full) <= len(prefix_text) and not stuck:
            return None
        delta = full[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = end
        if not check_stop:
            self.text += delta
            return None
        return self._append_checking_stop(delta)

    @property
    def skip(self) -> bool:
        return self.skip_special_tokens

    def _append_checking_stop(self, delta: str) -> str | None:
        old_len = len(self.text)
        self.text += delta
        if not self.stop:
            return None
        search_from = max(0, old_len - self.stop_holdback)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            idx = self.text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: while running, a possible stop-string prefix is held back."""
        if finished or not self.stop:
            return self.text
        keep = len(self.text) - self.stop_holdback
        return self.text[: max(keep, 0)]
