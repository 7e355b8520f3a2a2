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


def _lead_byte(tokenizer) -> list[int]:
    """The byte-level token of the byte 0xE2 alone (a 3-byte character's start: "â" in the
    GPT-2 byte alphabet)."""
    return [tokenizer.hf.convert_tokens_to_ids("\u00e2")]


def _recording(tokenizer, longest: list[int]):
    def decode(ids, skip):
        longest[0] = max(longest[0], len(ids))
        return tokenizer.decode(ids, skip)

    return decode


@pytest.mark.parametrize("skip", [True, False])
def test_tokens_that_never_make_text_are_not_decoded_again_and_again(tokenizer, skip):
    """A run of lone lead bytes (each U+FFFD for ever) or of skipped special tokens: every step
    decodes a bounded window, and the text is the run's text (the replacement characters)."""
    lone = _lead_byte(tokenizer)
    assert tokenizer.decode(lone, False) == "\ufffd"
    special = [tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]]
    for run in (lone * 300, special * 300):
        longest = [0]
        detok = IncrementalDetokenizer.for_prompt(_recording(tokenizer, longest), [1], skip, [])
        for tid in run:
            detok.add_tokens([tid])
        assert longest[0] <= 40
        whole = tokenizer.decode(run, skip)
        assert whole.startswith(detok.text) and len(whole) - len(detok.text) <= 8


def test_a_character_completed_after_stray_bytes_is_whole(tokenizer):
    stray = _lead_byte(tokenizer) * 20
    emoji = tokenizer.encode("🤖 ok", add_special_tokens=False)
    detok = IncrementalDetokenizer.for_prompt(tokenizer.decode, [], True, [])
    for tid in stray + emoji:
        detok.add_tokens([tid])
    assert detok.text == "\ufffd" * 20 + "🤖 ok"


def test_the_characters_a_token_takes_bound_a_prompts_tokens(tokenizer):
    """``max_token_chars``: every token of a text takes at most that many of its characters
    (the early refusal of over-long prompts rests on it); none where it cannot hold."""
    import copy

    from tokenizers import AddedToken

    from pagellm.runner.tokenizer import Tokenizer

    most = tokenizer.max_token_chars
    assert most == max(map(len, tokenizer.hf.get_vocab()))
    for text in ("#" * 500, " " * 500, "日本語" * 100, "<|im_end|>" * 50, "word " * 100):
        assert len(tokenizer.encode(text, add_special_tokens=False)) >= len(text) / most
    stripping = copy.deepcopy(tokenizer.hf)  # "<x>" takes the spaces after it, however many
    stripping.add_special_tokens({"additional_special_tokens": [AddedToken("<x>", rstrip=True)]})
    assert Tokenizer(stripping, None).max_token_chars is None
