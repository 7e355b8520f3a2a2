"""The grammar compile worker: a child process that compiles constraints one at a time.

xgrammar's compile time is not bounded by a constraint's size (a 100-byte schema pattern such
as ``(.{0,10}){0,10}`` compiles for minutes) and a thread cannot be stopped, so the server
compiles in a child process it can kill (``worker_handle.CompileWorker`` starts and drives
it). Here is the child's side: build and compile the grammar within an address-space cap, walk
a trial path through it (``probe_matching``), and answer with the grammar serialized.

Replies are bytes: ``ok:`` + the grammar's JSON, ``big`` (compiled, but its JSON is larger than
the reply cap: the server compiles it itself), or ``er:`` + the client's message.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import re
import signal
import sys
import time
import zlib
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pagellm.structured.params import StructuredOutputError, map_schema_refs

MAX_COMPILE_MEMORY = 2 << 30
"""Address space a compile may add to the worker's own, in bytes (its allocations fail past it)."""
MAX_REPLY_BYTES = 16 << 20
"""A compiled grammar is sent back serialized up to this size (3,000 regex alternatives take
~0.6 MB, ``.{0,1000}`` ~12 MB); past it the worker only says it compiled, and the server
compiles it again itself: a deserialized grammar holds about its serialized size in memory
(800 chained rules: 89 MB of JSON, ~80 MB once read, against 1.8 MB compiled in place)."""
MAX_GRAMMAR_BYTES = 64 << 20
"""A compiled grammar larger than this (xgrammar's ``memory_size_bytes``) is refused."""
WORKER_NICENESS = 10
"""Added to a worker's nice value: on a busy server a slow compile takes only idle CPU."""
PROBE_STEPS = 16
"""Tokens of the trial walk through a compiled grammar (``probe_matching``)."""
MAX_PROBE_STEP_SECONDS = 0.05
"""A grammar one of whose trial steps (a bitmask fill and a token) takes more CPU than this
is refused: the engine fills a request's bitmasks on its one thread, each step, for every
copy (ordinary grammars take under 1 ms; the regex ``(.{0,5}){0,5}`` 0.7 s, ``(.{0,10}){0,10}``
2.5 s, though both compile in 0.05 s)."""

_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


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


def probe_matching(
    xgr: Any, compiled: Any, seed: int, clock: Callable[[], float] = time.thread_time
) -> float:
    """The CPU seconds (``clock``) of the costliest step (bitmask fill, then one token) on a
    seeded random walk of ``PROBE_STEPS`` tokens the grammar allows (not its stop tokens); it
    stops early past ``MAX_PROBE_STEP_SECONDS`` or where the grammar can only end. A trial, not
    a proof: a path it does not take may cost more, which the engine's matching budget then
    bounds. Choosing a token is not timed (tensor ops over the vocabulary, no Python lists)."""
    from pagellm.sampling.sampler import bitmask_allowed

    info = compiled.tokenizer_info
    stops = list(info.stop_token_ids)
    matcher, mask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, info.vocab_size)
    rng, worst = random.Random(seed), 0.0
    for _ in range(PROBE_STEPS):
        start = clock()
        matcher.fill_next_token_bitmask(mask)
        filled = clock() - start
        allowed = bitmask_allowed(mask[0], info.vocab_size)
        allowed[stops] = False
        count = int(allowed.sum())
        if count == 0:
            return max(worst, filled)
        token = int(allowed.nonzero()[rng.randrange(count)])
        start = clock()
        accepted = matcher.accept_token(token)
        worst = max(worst, filled + clock() - start)
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
        if (size := int(compiled.memory_size_bytes)) > MAX_GRAMMAR_BYTES:
            return _error(f"the {kind} constraint compiles to {size >> 20} MiB of grammar (at "
                          f"most {MAX_GRAMMAR_BYTES >> 20} MiB)")  # fmt: skip
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

    import pagellm.sampling.sampler  # noqa: F401 - loaded before the memory cap and deadlines

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
