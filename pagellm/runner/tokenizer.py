"""The tokenizer and chat template of a model (Hugging Face tokenizers underneath).

For GGUF files the tokenizer is rebuilt from the file's metadata by ``transformers`` and saved
next to the file's cache entry, so later starts skip the conversion.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from pagellm.engine.errors import RequestRejected, check_unicode
from pagellm.fetch import cache_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
"""A folder with none of these holds no tokenizer for ``transformers`` to load."""


def _from_folder(auto: Any, folder: Path) -> Any:
    """``auto.from_pretrained(folder)``, its failures one line that names the folder."""
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{folder} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): give one with --tokenizer"
        )
    try:
        return auto.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        why = " ".join(str(exc).split())
        raise ValueError(f"cannot load a tokenizer from {folder}: {why}") from exc


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, eos_token_id: int | None) -> None:
        self.hf = hf_tokenizer
        self.eos_token_id = eos_token_id if eos_token_id is not None else hf_tokenizer.eos_token_id
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._max_token_chars: int | None = -1

    @property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token takes, so a text of n characters is at least
        n / this many tokens (an over-long prompt is refused before it is tokenized). None
        where that does not hold: a normalizer may drop characters, and an added token that
        strips whitespace beside it takes any run of it."""
        if self._max_token_chars == -1:
            normalizer = getattr(self._backend, "normalizer", None)
            added = getattr(self.hf, "added_tokens_decoder", {}).values()
            strips = any(getattr(t, "lstrip", False) or getattr(t, "rstrip", False) for t in added)
            vocab = self.hf.get_vocab() if self._backend is not None else {}
            bounded = vocab and normalizer is None and not strips
            self._max_token_chars = max(map(len, vocab)) if bounded else None
        return self._max_token_chars

    @classmethod
    def load(cls, source: Path, eos_token_id: int | None) -> Tokenizer:
        from transformers import AutoTokenizer

        if source.is_file():  # GGUF
            saved = _converted_dir(source)
            if (saved / "tokenizer.json").is_file():
                hf = AutoTokenizer.from_pretrained(str(saved))
            else:
                hf = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
                saved.mkdir(parents=True, exist_ok=True)
                hf.save_pretrained(str(saved))
        else:
            hf = _from_folder(AutoTokenizer, source)
        return cls(hf, eos_token_id)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; text that is not valid Unicode is a RequestRejected
        (``check_unicode``), not the tokenizer's TypeError."""
        if not isinstance(text, str):
            raise RequestRejected(f"text to tokenize must be a string, got {type(text).__name__}")
        check_unicode(text)
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model has no chat template")
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def chat_token_ids(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Render the chat and tokenize without adding special tokens twice."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def _converted_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "tokenizers" / digest
