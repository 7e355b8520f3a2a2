"""Grammars compile in worker processes: a compile past its deadline or its memory is refused,
a worker that dies costs its constraint alone, and the server's process never runs one."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from transformers import AutoTokenizer

from pagellm.structured.grammar import GrammarCompiler
from pagellm.structured.params import StructuredOutputError, StructuredOutputsParams

pytestmark = pytest.mark.timeout(600)

SLOW = StructuredOutputsParams(
    json={"type": "object", "properties": {"a": {"type": "string", "pattern": "(.{0,10}){0,10}"}}}
)
"""A 100-byte schema that takes xgrammar over 25 s to compile (Zen 4, idle)."""
DIGITS = StructuredOutputsParams(regex="[0-9]+")


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(default_tokenizer_dir))


def make_compiler(tokenizer, **kw) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], **kw)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def accepts(compiler: GrammarCompiler, compiled, text: str, tokenizer) -> bool:
    matcher = compiler.matcher(compiled)
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_a_compile_past_the_deadline_is_refused_and_its_worker_killed(tokenizer):
    compiler = make_compiler(tokenizer, max_workers=1, max_compile_seconds=1.0)
    try:
        compiler.compile_now(DIGITS)
        (first,) = compiler.worker_pids()
        with pytest.raises(StructuredOutputError, match="too expensive to compile: it took more"):
            compiler.compile_now(SLOW)
        assert not alive(first) and compiler.worker_pids() == []
        letters = compiler.compile_now(StructuredOutputsParams(regex="[a-z]+"))  # a new worker
        assert accepts(compiler, letters, "abc", tokenizer)
        assert not accepts(compiler, letters, "123", tokenizer)
        (second,) = compiler.worker_pids()
        assert second != first
        # a missed deadline is not cached as the constraint's error: it is tried again
        with pytest.raises(StructuredOutputError, match="too expensive"):
            compiler.compile_now(SLOW)
        assert not alive(second) and compiler.worker_pids() == []
    finally:
        compiler.shutdown()


def test_a_worker_that_dies_costs_its_constraint_alone(tokenizer):
    compiler = make_compiler(tokenizer, max_workers=1, max_compile_seconds=600.0)
    try:
        compiler.compile_now(DIGITS)
        (pid,) = compiler.worker_pids()
        future = compiler.compile(SLOW)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(StructuredOutputError, match=r"failed on it \(exit code -9\)"):
            future.result(timeout=300)
        choice = compiler.compile_now(StructuredOutputsParams(choice=["yes", "no"]))
        assert accepts(compiler, choice, "yes", tokenizer)
        assert compiler.compile(SLOW) is not future  # not cached: tried again
    finally:
        compiler.shutdown()


def test_a_compile_past_its_memory_is_refused_and_the_worker_goes_on(tokenizer):
    compiler = make_compiler(tokenizer, max_workers=1, max_compile_memory=16 << 20)
    try:
        compiler.compile_now(DIGITS)
        (pid,) = compiler.worker_pids()
        with pytest.raises(StructuredOutputError, match="needs too much memory to compile"):
            compiler.compile_now(StructuredOutputsParams(regex=".{0,1000}"))
        compiled = compiler.compile_now(StructuredOutputsParams(regex="x+"))
        assert accepts(compiler, compiled, "xxx", tokenizer)
        assert compiler.worker_pids() == [pid]
    finally:
        compiler.shutdown()


def test_a_slow_compile_holds_one_worker_and_others_compile_beside_it(tokenizer):
    compiler = make_compiler(tokenizer, max_workers=2, max_compile_seconds=600.0)
    try:
        slow = compiler.compile(SLOW)
        done = threading.Event()
        threading.Thread(target=lambda: (compiler.compile_now(DIGITS), done.set())).start()
        assert done.wait(timeout=300)
        assert not slow.done()  # still compiling in the other worker
        assert len(compiler.worker_pids()) == 2
    finally:
        pids = compiler.worker_pids()
        compiler.shutdown()
    assert pids and not any(alive(pid) for pid in pids)  # shutdown kills the workers
    with pytest.raises(StructuredOutputError):
        slow.result(timeout=300)


def test_compile_errors_keep_their_messages(tokenizer):
    compiler = make_compiler(tokenizer, max_workers=1)
    cases = [
        (StructuredOutputsParams(grammar="root ::= foo"), 'Rule "foo" is not defined'),
        (StructuredOutputsParams(regex="(a"), "regex constraint cannot be compiled"),
        (StructuredOutputsParams(json='{"type": "object"'), "not valid JSON"),
        (StructuredOutputsParams(json={"$ref": "https://example.com/s.json"}), "is not local"),
    ]
    try:
        for params, message in cases:
            with pytest.raises(StructuredOutputError, match=message):
                compiler.compile_now(params)
        (pid,) = compiler.worker_pids()  # one worker served them all
        assert alive(pid)
    finally:
        compiler.shutdown()
