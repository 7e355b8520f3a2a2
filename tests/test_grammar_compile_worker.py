"""Grammars compile in worker processes: a compile past its deadline or its memory is refused,
a worker that dies costs its constraint alone, and the server's process never runs one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
from server_helpers import pid_alive
from transformers import AutoTokenizer

from pagellm.structured.grammar import GrammarCompiler
from pagellm.structured.params import (
    CompileAborted,
    CompileQueueFull,
    StructuredOutputError,
    StructuredOutputsParams,
)

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


def accepts(compiler: GrammarCompiler, compiled, text: str, tokenizer) -> bool:
    matcher = compiler.matcher(compiled)
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_a_compile_past_the_deadline_is_refused_and_its_worker_killed(tokenizer):
    compiler = make_compiler(tokenizer, max_workers=1, max_compile_seconds=1.0)
    failures = []
    compiler.on_failed = failures.append
    try:
        compiler.compile_now(DIGITS)
        (first,) = compiler.worker_pids()
        with pytest.raises(StructuredOutputError, match="too expensive to compile: it took more"):
            compiler.compile_now(SLOW)
        assert failures == ["deadline"]
        assert not pid_alive(first) and compiler.worker_pids() == []
        letters = compiler.compile_now(StructuredOutputsParams(regex="[a-z]+"))  # a new worker
        assert accepts(compiler, letters, "abc", tokenizer)
        assert not accepts(compiler, letters, "123", tokenizer)
        (second,) = compiler.worker_pids()
        assert second != first
        # the refusal is cached like any compile error: the same constraint is refused at once
        with pytest.raises(StructuredOutputError, match="too expensive"):
            compiler.compile_now(SLOW)
        assert compiler.worker_pids() == [second]
    finally:
        compiler.shutdown()


def test_a_worker_that_dies_costs_its_constraint_alone(tokenizer):
    compiler = make_compiler(tokenizer, max_workers=1, max_compile_seconds=600.0)
    failures = []
    compiler.on_failed = failures.append
    try:
        compiler.compile_now(DIGITS)
        (pid,) = compiler.worker_pids()
        future = compiler.compile(SLOW)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(StructuredOutputError, match=r"failed on it \(exit code -9\)"):
            future.result(timeout=300)
        assert failures == ["crashed"]
        choice = compiler.compile_now(StructuredOutputsParams(choice=["yes", "no"]))
        assert accepts(compiler, choice, "yes", tokenizer)
        assert compiler.compile(SLOW) is not future  # a crash is not cached: tried again
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
    assert pids and not any(pid_alive(pid) for pid in pids)  # shutdown kills the workers
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
        assert pid_alive(pid)
    finally:
        compiler.shutdown()


def test_a_cancelled_compile_is_forgotten_and_spoils_nothing(tokenizer):
    """A queued compile cancelled (a pool shut down, a caller's cancellation reaching a future
    others share) leaves the cache working: the next constraints compile, the same one again."""
    compiler = make_compiler(tokenizer, max_workers=1, max_compile_seconds=600.0)
    try:
        compiler.compile(SLOW)  # holds the one worker
        queued = compiler.compile(DIGITS)
        assert queued.cancel()
        compiler.compile(StructuredOutputsParams(regex="[a-z]+"))  # the cache's upkeep runs
        again = compiler.compile(DIGITS)
        assert again is not queued and not again.cancelled()
    finally:
        compiler.shutdown()


def test_a_grammar_too_large_to_send_is_compiled_here(tokenizer):
    """Past the reply cap the worker only says it compiled; the server compiles it itself
    (a deserialized grammar holds about its serialized size, a compiled one far less)."""
    shipped = make_compiler(tokenizer, max_workers=1)
    here = make_compiler(tokenizer, max_workers=1, max_reply_bytes=1000)
    try:
        for compiler in (shipped, here):
            compiled = compiler.compile_now(DIGITS)
            assert accepts(compiler, compiled, "123", tokenizer)
            assert not accepts(compiler, compiled, "12a", tokenizer)
        big, small = here.compile_now(DIGITS), shipped.compile_now(DIGITS)
        assert big.nbytes == big.grammar.memory_size_bytes
        assert small.nbytes == len(small.grammar.serialize_json())  # counted as read
        assert small.nbytes > small.grammar.memory_size_bytes
    finally:
        shipped.shutdown()
        here.shutdown()


def test_a_worker_that_died_idle_is_replaced_before_the_next_compile(tokenizer):
    compiler = make_compiler(tokenizer, max_workers=1)
    try:
        compiler.compile_now(DIGITS)
        (pid,) = compiler.worker_pids()
        os.kill(pid, signal.SIGKILL)
        while pid_alive(pid) and not _reaped(pid):
            time.sleep(0.05)  # bounded by the test's timeout: a killed process ends
        compiled = compiler.compile_now(StructuredOutputsParams(regex="x+"))
        assert accepts(compiler, compiled, "xx", tokenizer)
        assert compiler.worker_pids() != [pid]
    finally:
        compiler.shutdown()


def _reaped(pid: int) -> bool:
    """Ended, or a zombie whose threads have all ended (its parent can wait for it now)."""
    try:
        zombie = Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
        return zombie and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


def test_the_memory_cap_keeps_within_a_hard_limit_already_set():
    """Under ``ulimit -v`` (a container's, a batch node's) the worker's cap may not exceed the
    hard limit, which a process cannot raise: it stays at that limit and the worker starts."""
    code = (
        "import resource; from pagellm.structured.compile_worker import _cap_address_space; "
        "_cap_address_space(2 << 30); print(*resource.getrlimit(resource.RLIMIT_AS))"
    )
    hard_kib = 8 << 20  # 8 GiB: above the interpreter's own size, below its size + 2 GiB
    out = subprocess.run(
        ["bash", "-c", f'ulimit -v {hard_kib} && "$0" -c "$1"', sys.executable, code],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    soft, hard = map(int, out.stdout.split())
    assert hard == hard_kib << 10 and soft <= hard


def test_new_compiles_past_the_pending_bound_are_refused_cached_ones_are_not(tokenizer):
    compiler = make_compiler(tokenizer, max_workers=1, max_compile_seconds=600.0)
    try:
        for regex in ("a+", "b+", "c+"):  # one at a time: each ends before the next
            compiler.compile(StructuredOutputsParams(regex=regex), max_pending=1).result()
        compiler.compile(SLOW, max_pending=2)  # holds the one worker
        digits = compiler.compile(DIGITS, max_pending=2)  # queued behind it
        with pytest.raises(CompileQueueFull):
            compiler.compile(StructuredOutputsParams(regex="[a-z]+"), max_pending=2)
        assert compiler.compile(DIGITS, max_pending=2) is digits  # a cache hit needs no room
        compiler.compile(StructuredOutputsParams(regex="[a-z]+"))  # no bound: queued
        cancelled = compiler.compile(StructuredOutputsParams(regex="d+"))
        assert cancelled.cancel()  # counted off once: room for one more beside the four
        compiler.compile(StructuredOutputsParams(regex="e+"), max_pending=4)
        with pytest.raises(CompileQueueFull):
            compiler.compile(StructuredOutputsParams(regex="f+"), max_pending=4)
    finally:
        compiler.shutdown()


def _queue_full(params, max_pending=None):
    assert max_pending == 64  # the server's max_pending_compiles
    raise CompileQueueFull("64 grammars are waiting to compile")


def _aborted(params, max_pending=None):
    future = Future()
    future.set_exception(CompileAborted("the server is too busy to compile the regex now"))
    return future


def _never_called(params, max_pending=None):
    raise AssertionError("refused before compiling")


@pytest.mark.parametrize(
    "compile, left_running, message",
    [(_queue_full, 0, "too many grammars waiting to compile"),
     (_aborted, 7, "too busy to compile"),
     (_never_called, 8, "8 grammar matches that overran their bound are still running")],
)  # fmt: skip
def test_the_server_answers_503_with_retry_after_for_its_own_trouble(
    compile, left_running, message
):
    """The HTTP mapping: a full compile queue, a compile the server could not run now (a
    worker that did not start, a machine too busy), or ``max_overrun_fills`` (8) fill threads
    left behind still running, is a 503 the client may retry, not a 400 or a 500."""
    from types import SimpleNamespace

    from fakes import FakeTokenizer, make_engine
    from fastapi.testclient import TestClient

    from pagellm.engine.async_engine import AsyncLLMEngine
    from pagellm.server.app import ServerSettings, build_app

    engine, _ = make_engine()
    engine.structured = SimpleNamespace(
        compiler=SimpleNamespace(compile=compile),
        fills=SimpleNamespace(left_running=lambda: left_running),
    )
    app = build_app(AsyncLLMEngine(engine), FakeTokenizer(), ServerSettings("m", 128))
    body = {"prompt": [5, 6], "max_tokens": 2, "structured_outputs": {"regex": "[0-9]+"}}
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", json=body)
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert message in r.json()["error"]["message"]


def test_the_deadline_counts_cpu_time_not_waiting(tokenizer):
    """A worker that gets no CPU (a busy machine; here a CPU clock that stands still) is not
    charged for waiting: past a minute of wall time the compile is the server's trouble
    (CompileAborted: a 503, not cached), not the constraint's (CompileDeadline: a 400)."""
    import xgrammar as xgr

    from pagellm.structured.worker_handle import CompileWorker

    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id]
    ).serialize_json()
    wall = {"now": 0.0, "step": 0.0}  # no CPU is ever used; the wall clock moves as set

    def clock() -> float:
        wall["now"] += wall["step"]
        return wall["now"]

    worker = CompileWorker(info, clock=clock, cpu_clock=lambda pid: 0.0)
    try:
        assert worker.compile("regex", "[0-9]+", False, 1.0).startswith("{")
        wall["step"] = 10.0  # 10 s a reading from now: past 60 s, the compile is given up
        with pytest.raises(CompileAborted, match="too busy to compile the json constraint"):
            worker.compile("json", SLOW.spec_text, False, 1.0)
        assert worker.pid is None  # killed; the next compile starts another
        wall["step"] = 0.0
        assert worker.compile("regex", "[a-z]+", False, 1.0).startswith("{")
    finally:
        worker.close()


def test_a_grammar_too_expensive_to_match_is_refused_before_it_runs(tokenizer):
    """It compiles in 0.05 s, but one bitmask fill takes ~0.7 s (Zen 4): the worker's trial
    walk finds it, so the engine thread never fills it."""
    compiler = make_compiler(tokenizer, max_workers=1)
    failures = []
    compiler.on_failed = failures.append
    try:
        with pytest.raises(StructuredOutputError, match="too expensive to match: one step took"):
            compiler.compile_now(StructuredOutputsParams(regex="(.{0,5}){0,5}"))
        assert failures == ["invalid"]
        compiler.compile_now(StructuredOutputsParams(regex=".{0,200}"))  # wide, but cheap
    finally:
        compiler.shutdown()


def test_engine_shutdown_stops_compiles_queued_and_running(tiny_models):
    """A server stopping with compiles queued must not work through them (each up to the
    deadline) before its process can exit: the engine's shutdown cancels the queued ones and
    kills the workers."""
    from llm_helpers import tiny_llm

    engine = tiny_llm(tiny_models).engine
    compiler = engine.structured.compiler
    running = compiler.compile(SLOW)
    queued = [compiler.compile(StructuredOutputsParams(regex=f"{c}+")) for c in "abc"]
    while not compiler.worker_pids():  # bounded by the test's timeout: a worker starts
        time.sleep(0.05)
    pids = compiler.worker_pids()
    engine.shutdown()
    for future in queued:  # cancelled, failed, or compiled before the shutdown
        if not future.cancelled():
            future.exception(timeout=300)
    with pytest.raises(StructuredOutputError):  # killed, not left to run its 26 s
        running.result(timeout=300)
    assert not any(pid_alive(pid) for pid in pids)
