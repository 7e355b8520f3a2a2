"""Grammar compilation in a child process, so that its time and memory are bounded.

xgrammar's compile time is not bounded by a constraint's size: a 100-byte schema pattern such as
``(.{0,10}){0,10}`` compiles for minutes, and a thread cannot be stopped. So every constraint is
compiled by a ``CompileWorker``: a child process (``python -P -c``, not multiprocessing, so no
script's main module is run again) that compiles one constraint at a time and answers with the
compiled grammar serialized. A worker that misses the deadline is killed, and its constraint
refused; one that crashes costs its constraint alone (``CompileAborted``). The server keeps only the deserialized
grammar, whose matchers run in the engine.

Owns: the worker's side (``serve``: build the grammar, compile, serialize, within an address
space cap) and the parent's handle (``CompileWorker``: start, ask, kill).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import zlib
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pagellm.structured.params import StructuredOutputError, map_schema_refs

MAX_COMPILE_SECONDS = 10.0
"""A constraint whose grammar takes longer than this to compile is refused (its worker killed):
ordinary schemas compile in milliseconds, a schema pattern ``.{0,2000}`` in ~2 s, nested
repetitions ``(.{0,10}){0,10}`` in ~30 s and more (Zen 4)."""
MAX_COMPILE_MEMORY = 2 << 30
"""Address space a compile may add to the worker's own, in bytes (its allocations fail past it)."""
MAX_REPLY_BYTES = 16 << 20
"""A compiled grammar is sent back serialized up to this size (3,000 regex alternatives take
~0.6 MB, ``.{0,1000}`` ~12 MB); past it the worker only says it compiled, and the server
compiles it again itself: a deserialized grammar holds about its serialized size in memory
(800 chained rules: 89 MB of JSON, ~80 MB once read, against 1.8 MB compiled in place)."""
TOO_BIG_TO_SEND = None
"""What ``CompileWorker.compile`` returns for a grammar that compiled but is not sent."""
WORKER_NICENESS = 10
"""Added to a worker's nice value: on a busy server a slow compile takes only idle CPU."""
PROBE_STEPS = 16
"""Tokens of the trial walk through a compiled grammar (``probe_matching``)."""
MAX_PROBE_STEP_SECONDS = 0.05
"""A grammar one of whose trial steps (a bitmask fill and a token) takes more CPU than this
is refused: the engine fills a request's bitmasks on its one thread, each step, for every
copy (ordinary grammars take under 1 ms; the regex ``(.{0,5}){0,5}`` 0.7 s, ``(.{0,10}){0,10}``
2.5 s, though both compile in 0.05 s)."""
START_SECONDS = 300.0
"""How long a new worker may take to be ready (it imports xgrammar and torch: seconds, more on
a busy machine)."""

_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"
_LOG = logging.getLogger(__name__)
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


class CompileAborted(StructuredOutputError):
    """The worker did not answer (it crashed, did not start, was shut down): unlike the
    compiler's errors and a missed deadline this says nothing certain of the constraint, so it
    is not cached."""


class CompileDeadline(StructuredOutputError):
    """The compile ran past its deadline (its worker was killed)."""


def _clean(exc: BaseException) -> str:
    """xgrammar's message without its time stamp and source line."""
    return _LOG_PREFIX.sub("", str(exc).strip()).strip()


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _local_ref(ref: str) -> str:
    """A reference into the schema itself; others (xgrammar would take them as any JSON, with
    a warning in the log) are refused: nothing is fetched."""
    if ref != "#" and not ref.startswith("#/"):
        raise StructuredOutputError(
            f"the JSON schema's $ref {ref[:200]!r} is not local: only references into the "
            "schema itself ('#' or '#/...') are supported"
        )
    return ref


def _json_schema_grammar(xgr: Any, schema: str, any_whitespace: bool) -> Any:
    """xgrammar's grammar of a schema, with JSON's own string characters: its rule for
    length-bounded strings excludes only the quote, backslash, CR and LF, so it lets other
    control characters through, which JSON forbids unescaped (parsers reject them)."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
    text = str(grammar)
    fixed = text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)
    return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)


def build(xgr: Any, compiler: Any, kind: str, text: str, any_whitespace: bool) -> Any:
    """Compile one constraint (``kind`` and ``spec_text`` of its StructuredOutputsParams);
    raises StructuredOutputError for one that is malformed, xgrammar's error otherwise."""
    if kind == "json":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise StructuredOutputError("the JSON schema must be an object")
        map_schema_refs(schema, _local_ref)
        return compiler.compile_grammar(_json_schema_grammar(xgr, text, any_whitespace))
    if kind == "json_object":  # an object (xgrammar's built-in JSON also takes arrays)
        return compiler.compile_grammar(
            _json_schema_grammar(xgr, '{"type": "object"}', any_whitespace)
        )
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(text)))
    return compiler.compile_grammar(text)


def probe_matching(xgr: Any, compiled: Any, seed: int) -> float:
    """The CPU seconds of the costliest step (bitmask fill, then one token) on a seeded random
    walk of ``PROBE_STEPS`` tokens the grammar allows (not its stop tokens); it stops early
    past ``MAX_PROBE_STEP_SECONDS`` or where the grammar can only end. A trial, not a proof:
    a path it does not take may cost more, which the engine's matching budget then bounds."""
    from pagellm.sampling.sampler import bitmask_allowed

    info = compiled.tokenizer_info
    vocab, stops = info.vocab_size, set(info.stop_token_ids)
    matcher, mask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, info.vocab_size)
    rng, worst = random.Random(seed), 0.0
    for _ in range(PROBE_STEPS):
        start = time.thread_time()
        matcher.fill_next_token_bitmask(mask)
        filled = time.thread_time() - start
        allowed = bitmask_allowed(mask[0], vocab).nonzero().flatten().tolist()
        choices = [t for t in allowed if t not in stops]
        start = time.thread_time()
        accepted = bool(choices) and matcher.accept_token(rng.choice(choices))
        worst = max(worst, filled + time.thread_time() - start)
        if not accepted or worst > MAX_PROBE_STEP_SECONDS:
            break
    return worst


def _answer(xgr: Any, compiler: Any, request: tuple, max_reply: int) -> bytes:
    """``ok:`` and the serialized grammar, ``big`` (compiled, too big to send), or ``er:``
    and the client's message (UTF-8)."""
    kind, text, any_ws = request
    try:
        compiled = build(xgr, compiler, kind, text, any_ws)
        worst = probe_matching(xgr, compiled, zlib.crc32(text.encode("utf-8", "replace")))
        if worst > MAX_PROBE_STEP_SECONDS:
            return _error(f"the {kind} constraint is too expensive to match: one step took "
                          f"{worst:.2f} s in a trial (at most {MAX_PROBE_STEP_SECONDS:g} s)")  # fmt: skip
        data = compiled.serialize_json().encode()
        return b"ok:" + data if len(data) <= max_reply else b"big"
    except StructuredOutputError as exc:
        return _error(str(exc))
    except MemoryError:
        return _error(_too_much_memory(kind))
    except RecursionError:
        return _error(f"the {kind} constraint nests too deeply to compile")
    except Exception as exc:  # noqa: BLE001 - xgrammar's errors are RuntimeErrors
        if "bad_alloc" in str(exc):  # C++ allocation failed: the address space cap
            return _error(_too_much_memory(kind))
        return _error(f"the {kind} constraint cannot be compiled: {_clean(exc)}")


def _error(message: str) -> bytes:
    return b"er:" + message.encode("utf-8", "backslashreplace")


def _too_much_memory(kind: str) -> str:
    return f"the {kind} constraint needs too much memory to compile"


def _cap_address_space(extra: int) -> None:
    """Let this process grow by ``extra`` bytes of address space and no more (Linux; within
    a hard limit already set, which a process cannot raise)."""
    import resource  # Unix only

    statm = Path("/proc/self/statm")
    if not extra or not statm.exists():
        return
    limit = int(statm.read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE") + extra
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _die_with_parent(parent: int) -> None:
    """Linux: this process is killed when the thread that started it ends (a pool thread of
    the compiler, which lives until its shutdown), so a compile that runs for minutes does not
    outlive the server; and it ends now if that already happened. Ctrl-C in the server's
    terminal is the server's to handle, not this process's. It runs at a lower priority, so
    that a compile burning toward its deadline takes CPU the engine leaves idle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError):  # the engine's threads before a compile's
        os.nice(WORKER_NICENESS)
    with contextlib.suppress(OSError, AttributeError):  # elsewhere: at its next read
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        sys.exit(0)


def serve(conn: Connection, extra_memory: int, max_reply: int) -> None:
    """The worker's loop: xgrammar's TokenizerInfo as JSON first, then ``(kind, text,
    any_whitespace)`` in and an answer out, until the parent closes its end."""
    import xgrammar as xgr

    conn.send_bytes(b"started")
    info = xgr.TokenizerInfo.deserialize_json(conn.recv_bytes().decode())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _cap_address_space(extra_memory)
    conn.send_bytes(b"ready")
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        conn.send_bytes(_answer(xgr, compiler, request, max_reply))


def main() -> None:
    """``python -c`` entry: the socket's fd, the memory cap, the reply cap, the parent's pid."""
    fd, extra_memory, max_reply, parent = (int(arg) for arg in sys.argv[1:5])
    _die_with_parent(parent)
    serve(Connection(fd), extra_memory, max_reply)


_ENTRY = (
    "import sys; sys.path.append(sys.argv.pop(1)); "
    "from pagellm.structured.compile_worker import main; main()"
)
"""Run with ``python -P``: no working directory on the path (a ``pagellm/`` or ``json.py``
there would stand in for the real one); this package's root is searched last, for a server
run from a source tree."""


def _expect(conn: Connection, word: bytes) -> None:
    """Wait (bounded) for the worker to say ``word``; EOFError if it does not."""
    if not conn.poll(START_SECONDS) or conn.recv_bytes(64) != word:
        raise EOFError


class CompileWorker:
    """The parent's handle on one worker process: started on first use, asked one constraint
    at a time, killed when it misses the deadline and started again later. Its lock is held
    through a start or a compile; ``close`` may come from any thread."""

    def __init__(
        self,
        tokenizer_info: str,
        extra_memory: int = MAX_COMPILE_MEMORY,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> None:
        """``tokenizer_info``: xgrammar's TokenizerInfo as JSON (the worker's compiler's)."""
        self._info = tokenizer_info.encode()
        self._extra_memory = extra_memory
        self._max_reply = max_reply_bytes
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The running worker's process id (None before it starts or after it is stopped)."""
        process = self._process
        return process.pid if process is not None else None

    def compile(self, kind: str, text: str, any_whitespace: bool, timeout: float) -> str | None:
        """The compiled grammar serialized (``TOO_BIG_TO_SEND``: it compiled within the bounds
        but is larger than ``MAX_REPLY_BYTES``), or StructuredOutputError: the compiler's
        message, a refusal once ``timeout`` seconds pass (the worker is killed), or
        CompileAborted."""
        with self._lock:
            conn = self._start()
            try:
                reply = self._ask(conn, (kind, text, any_whitespace), timeout)
            except StructuredOutputError:
                raise
            except (EOFError, OSError):
                code = self._stop()
                _LOG.warning("grammar compile worker failed on a %s constraint (exit code %s)",
                             kind, code)  # fmt: skip
                raise CompileAborted(
                    f"the {kind} constraint cannot be compiled: the compiler failed on it "
                    f"(exit code {code})"
                ) from None
            except BaseException:  # the conversation is out of step: start afresh
                self._stop()
                raise
        if reply.startswith(b"ok:"):
            return reply[3:].decode()
        if reply == b"big":
            return TOO_BIG_TO_SEND
        raise StructuredOutputError(reply[3:].decode())

    def _ask(self, conn: Connection, request: tuple, timeout: float) -> bytes:
        conn.send(request)
        if not conn.poll(timeout):
            self._stop()
            _LOG.warning("grammar compile worker stopped: a %s constraint took over %g s",
                         request[0], timeout)  # fmt: skip
            raise CompileDeadline(
                f"the {request[0]} constraint is too expensive to compile: it took more than "
                f"{timeout:g} s"
            )
        return conn.recv_bytes(self._max_reply + 3)

    def start(self) -> None:
        """Start the worker unless it runs, and wait until it is ready (bounded)."""
        with self._lock:
            self._start()

    def _start(self) -> Connection:
        if self._conn is not None and self._process.poll() is None:
            return self._conn
        self._stop()  # one that died while idle is not blamed on the next constraint
        if self._closed:
            raise CompileAborted("the grammar compiler is shut down")
        try:
            self._conn, theirs = multiprocessing.Pipe()
            root = str(Path(__file__).resolve().parents[2])
            limits = [self._extra_memory, self._max_reply, os.getpid()]
            args = [root, str(theirs.fileno()), *map(str, limits)]
            with theirs:
                self._process = subprocess.Popen(
                    [sys.executable, "-P", "-c", _ENTRY, *args],
                    stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()],
                )  # fmt: skip
            if self._closed:  # close() came while this started: it may not have seen it
                raise EOFError
            _expect(self._conn, b"started")  # then it reads what follows at once
            self._conn.send_bytes(self._info)
            _expect(self._conn, b"ready")
        except (EOFError, OSError) as exc:
            code = self._stop()
            _LOG.warning("grammar compile worker did not start (exit code %s): %r", code, exc)
            raise CompileAborted(f"the grammar compiler did not start (exit code {code})") from None
        return self._conn

    def close(self) -> None:
        """Kill the worker for good: a compile in progress fails (it sees the worker die),
        then the handle is released."""
        self._closed = True
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
        with self._lock:
            self._stop()

    def _stop(self) -> int | None:
        """Kill the worker (a later compile starts another); its exit code."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if conn is not None:
            conn.close()
        if process is None:
            return None
        if process.poll() is None:
            process.kill()
        try:
            return process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return None
