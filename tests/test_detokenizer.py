"""Incremental detokenization never emits broken UTF-8; stop strings are cut from the text."""

from __future__ import annotations

import pytest

from pagellm.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    from pagellm.fetch import require_default_model
    from pagellm.runner.tokenizer import Tokenizer

    return Tokenizer.load(require_default_model(), None)


def _stream(tokenizer, text: str, stop: list[str] | None = None):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer.for_prompt(tokenizer.decode, [], True, stop or [])
    seen = []
    for tid in ids:
        matched = detok.add_tokens([tid])
        seen.append(detok.text)
        if matched:
            return detok, seen, matched
    return detok, seen, None


@pytest.mark.parametrize("text", ["héllo wörld 日本語のテキスト 🤖🚀 ok", "naïve café — “quotes”"])
def test_multibyte_characters_are_never_split(tokenizer, text):
    detok, seen, _ = _stream(tokenizer, text)
    assert detok.text == text
    for partial in seen:
        assert "\ufffd" not in partial
        assert text.startswith(partial)


def test_prompt_context_keeps_the_first_space(tokenizer):
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    out = tokenizer.encode(" world", add_special_tokens=False)
    detok = IncrementalDetokenizer.for_prompt(tokenizer.decode, prompt, True, [])
    detok.add_tokens(out)
    assert detok.text == " world"


def test_stop_string_is_excluded_and_held_back_while_streaming(tokenizer):
    detok, seen, matched = _stream(tokenizer, "one two three four", stop=["thr"])
    assert matched == "thr"
    assert detok.text == "one two "
    d = IncrementalDetokenizer.for_prompt(tokenizer.decode, [], True, ["STOPX"])
    d.text = "abc ST"
    assert d.visible_text(finished=False) == "ab"  # "c ST" may still become "STOPX"
    assert d.visible_text(finished=True) == "abc ST"


def test_special_tokens_are_skipped_or_kept(tokenizer):
    eos = tokenizer.eos_token_id
    keep = IncrementalDetokenizer.for_prompt(tokenizer.decode, [], False, [])
    skip = IncrementalDetokenizer.for_prompt(tokenizer.decode, [], True, [])
    ids = tokenizer.encode("hi", add_special_tokens=False) + [eos]
    keep.add_tokens(ids)
    skip.add_tokens(ids)
    assert skip.text == "hi"
    assert keep.text.startswith("hi") and len(keep.text) > 2
