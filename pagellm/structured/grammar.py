"""Grammars for structured outputs: compiled by xgrammar off the step loop, matched per sequence.

``GrammarCompiler`` compiles a request's constraint off the caller's thread, in a worker process
with a deadline (``compile_worker``), and caches the result by the constraint's key, so one
schema compiles once however many requests use it; a constraint that does not compile, or not
within the deadline, fails with a message that says why. ``StructuredOutputManager`` is what
the engine drives: a matcher per sequence, advanced with each accepted token; the token bitmask of a step's sampling rows (one row per speculative
proposal plus one, computed by advancing through the proposals and rolling back); how many of a
proposal the grammar allows.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from pagellm.sampling.sampler import bitmask_allowed
from pagellm.structured.compile_worker import MAX_COMPILE_MEMORY, MAX_REPLY_BYTES, build
from pagellm.structured.fill_thread import FillThread, FillTimeout
from pagellm.structured.params import (
    CompileAborted,
    CompileCrashed,
    CompileDeadline,
    CompileQueueFull,
    StructuredOutputError,
    StructuredOutputsParams,
)
from pagellm.structured.worker_handle import MAX_COMPILE_SECONDS, TOO_BIG_TO_SEND, CompileWorker


@dataclass(frozen=True, slots=True)
class CompiledConstraint:
    grammar: Any
    """xgrammar's CompiledGrammar."""
    nbytes: int
    """What it holds in memory, as the cache counts it (a grammar read from its serialized
    form holds about that form's size, more than xgrammar's ``memory_size_bytes`` says)."""


class GrammarCompiler:
    """Compiles constraints for one tokenizer; ``compile`` never blocks the caller."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        max_workers: int = 2,
        cache_size: int = 512,
        cache_bytes: int = 512 << 20,
        on_compiled: Callable[[float], None] | None = None,
        disable_any_whitespace: bool = False,
        max_compile_seconds: float = MAX_COMPILE_SECONDS,
        max_compile_memory: int = MAX_COMPILE_MEMORY,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> None:
        """``on_compiled``: called with the seconds of every compilation that ran (cache hits
        are not compilations); ``disable_any_whitespace``: for every request's JSON. The cache
        keeps at most ``cache_size`` grammars and ``cache_bytes`` of them (one constraint of the
        64 KiB allowed can compile to tens of MB: 3,000 regex alternatives took 21 MB).
        ``max_workers`` worker processes compile, each started on first need; a compile past
        ``max_compile_seconds`` of CPU or ``max_compile_memory`` bytes is refused; one that
        serializes to more than ``max_reply_bytes`` is compiled again here."""
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self._xgr = xgr
        self._info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        """For grammars too big to send back: compiled again here, one at a time."""
        self._here_lock = threading.Lock()
        self._workers: queue.LifoQueue[CompileWorker] = queue.LifoQueue()  # started ones first
        text = info.serialize_json()
        workers = [
            CompileWorker(text, max_compile_memory, max_reply_bytes) for _ in range(max_workers)
        ]
        for worker in workers:
            self._workers.put(worker)
        self._all_workers = tuple(workers)
        self._stop_workers = weakref.finalize(self, _stop_all, self._all_workers)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="pagellm-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self.on_compiled = on_compiled
        self.on_failed: Callable[[str], None] | None = None
        """Called with why a compilation failed: invalid, deadline, crashed or aborted."""
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.disable_any_whitespace = disable_any_whitespace
        self.max_compile_seconds = max_compile_seconds
        self._pending = 0
        """Compiles submitted and not yet ended (queued or running)."""

    def compile(self, params: StructuredOutputsParams, max_pending: int | None = None) -> Future:
        """A future of the compiled grammar (done at once on a cache hit); its exception is a
        StructuredOutputError naming the problem. With ``max_pending``: CompileQueueFull
        instead of a new compile while that many are queued or running."""
        with self._lock:
            future = self._cache.get(params.key)
            if future is not None:
                self._cache.move_to_end(params.key)
                return future
            if max_pending is not None and self._pending >= max_pending:
                raise CompileQueueFull(f"{self._pending} grammars are waiting to compile")
            future = self._pool.submit(self._build, params)
            self._cache[params.key] = future
            self._pending += 1
            self._evict()
        future.add_done_callback(lambda done: self._finished(params.key, done))
        return future

    def _finished(self, key: tuple, future: Future) -> None:
        """A compile ended. One the worker did not finish (or cancelled before it ran, so
        never counted off by ``_build``) is not remembered: the next request with the
        constraint tries again."""
        cancelled = future.cancelled()
        if not cancelled and not isinstance(future.exception(), _NOT_CACHED):
            return
        with self._lock:
            if cancelled:
                self._pending -= 1
            if self._cache.get(key) is future:
                del self._cache[key]

    def _evict(self) -> None:
        """Drop the least recently used grammars past the count or the bytes (the newest one
        stays; a grammar still compiling counts 0 bytes until it is done)."""
        sizes = {key: _compiled_bytes(f) for key, f in self._cache.items()}
        total = sum(sizes.values())
        while len(self._cache) > 1 and (
            len(self._cache) > self._cache_size or total > self._cache_bytes
        ):
            key, _ = self._cache.popitem(last=False)
            total -= sizes[key]

    def compile_now(self, params: StructuredOutputsParams) -> Any:
        """Compile (or take from the cache) and wait; raises StructuredOutputError."""
        return self.compile(params).result()

    def _build(self, params: StructuredOutputsParams) -> Any:
        """On a pool thread: compile; no longer pending once it ends (before its waiters wake,
        so a caller that saw it end finds room for another)."""
        try:
            return self._compile_in_worker(params)
        except StructuredOutputError as exc:
            if self.on_failed is not None:
                self.on_failed(_failure_reason(exc))
            raise
        finally:
            with self._lock:
                self._pending -= 1

    def _compile_in_worker(self, params: StructuredOutputsParams) -> Any:
        """One worker (there are as many as pool threads) compiles, this thread deserializes
        its answer. The seconds reported leave out a worker's start."""
        any_ws = not (params.disable_any_whitespace or self.disable_any_whitespace)
        worker = self._workers.get()
        try:
            worker.start()
            start = time.perf_counter()
            text = worker.compile(params.kind, params.spec_text, any_ws, self.max_compile_seconds)
        finally:
            self._workers.put(worker)
        if text is TOO_BIG_TO_SEND:  # it compiled within the bounds there (not killable here)
            with self._here_lock:  # one at a time: not a second worker's worth of CPU and memory
                grammar = self._build_here(params, any_ws)
            nbytes = int(grammar.memory_size_bytes)
        else:
            try:
                grammar = self._xgr.CompiledGrammar.deserialize_json(text, self._info)
            except Exception as exc:  # noqa: BLE001 - xgrammar's Deserialize*Errors
                raise CompileAborted(f"the compiled grammar could not be read: {exc}") from None
            nbytes = max(len(text), int(grammar.memory_size_bytes))  # read: ~its JSON's size
        if self.on_compiled is not None:
            self.on_compiled(time.perf_counter() - start)
        return CompiledConstraint(grammar, nbytes)

    def _build_here(self, params: StructuredOutputsParams, any_ws: bool) -> Any:
        try:
            return build(self._xgr, self._compiler, params.kind, params.spec_text, any_ws)
        except StructuredOutputError:
            raise
        except Exception as exc:  # noqa: BLE001 - it compiled in the worker: not the client's
            raise CompileAborted(f"the {params.kind} constraint failed to compile: {exc}") from None

    def matcher(self, compiled: CompiledConstraint) -> Any:
        return self._xgr.GrammarMatcher(compiled.grammar)

    def worker_pids(self) -> list[int]:
        """The process ids of the compile workers running now."""
        return [w.pid for w in self._all_workers if w.pid is not None]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._stop_workers()


_NOT_CACHED = (CompileAborted, CompileCrashed)
"""Failures that say nothing certain of the constraint: the next request compiles again."""
_REASONS = ((CompileDeadline, "deadline"), (CompileCrashed, "crashed"), (CompileAborted, "aborted"))


def _failure_reason(exc: StructuredOutputError) -> str:
    return next((reason for kind, reason in _REASONS if isinstance(exc, kind)), "invalid")


def _stop_all(workers: tuple[CompileWorker, ...]) -> None:
    """Kill the workers for good (on shutdown, or when the compiler is collected)."""
    for worker in workers:
        worker.close()


def _succeeded(future: Future) -> bool:
    """Compiled: not pending, cancelled or failed."""
    return future.done() and not future.cancelled() and future.exception() is None


def _compiled_bytes(future: Future) -> int:
    return future.result().nbytes if _succeeded(future) else 0


@dataclass(frozen=True, slots=True)
class GrammarOptions:
    tokens: int
    """How many tokens the grammar admits next (0: it cannot go on)."""
    only_end: bool
    """It admits only its stop token: the output is complete."""


@dataclass(slots=True)
class _Budget:
    """A request's matching time, shared by its sequences: n copies of one grammar cost the
    engine thread n times one, so the bounds hold for the request, not for each copy."""

    seconds: float = 0.0
    """Time its matchers have taken so far (bitmasks and accepted tokens)."""
    step: int = -1
    step_seconds: float = 0.0
    """Time taken in step ``step``."""
    slowest_step: float = 0.0
    overran: float = 0.0
    """A bitmask call's bound that one of its calls ran past (0: none did); its matcher was
    left to the thread still running it."""


@dataclass(slots=True)
class _Entry:
    future: Future
    budget: _Budget
    matcher: Any = None


MAX_MATCH_STEP_SECONDS = 0.25
"""One step's bitmask fills and token accepts of one request's sequences may take this long;
a grammar that takes longer (an ambiguous EBNF can grow superlinearly with the output) fails
its request alone, before it stalls every other request's steps on the engine thread."""
MAX_MATCH_SECONDS = 10.0
"""A request's matchers may take this long in all."""


class StructuredOutputManager:
    """Per-sequence grammar state for the engine. The engine calls it from its one thread;
    ``bitmasks`` runs its jobs (``_fill_in_budget``: budget checks and charges) on the fill
    thread while the engine thread waits, and a job left behind there charges only its own
    request's budget, a request already failed."""

    def __init__(
        self,
        compiler: GrammarCompiler,
        max_rollback: int = 16,
        max_step_seconds: float = MAX_MATCH_STEP_SECONDS,
        max_seconds: float = MAX_MATCH_SECONDS,
        clock: Callable[[], float] = time.perf_counter,
        fill_timeout: float = MAX_MATCH_STEP_SECONDS,
    ) -> None:
        """``fill_timeout``: real seconds the engine waits for one sequence's bitmask rows
        (``fill_thread``); past them its request fails and the thread is left behind."""
        self.compiler = compiler
        self.clock = clock
        self.fill_timeout = fill_timeout
        self.fills = FillThread()
        self.max_step_seconds = max_step_seconds
        self.max_seconds = max_seconds
        self.max_rollback = max_rollback
        """Proposals longer than this are cut (bounds the matcher's work per step)."""
        self._entries: dict[str, _Entry] = {}
        self._words = (compiler.vocab_size + 31) // 32
        self._step = 0

    def start(self, seq_ids: list[str], params: StructuredOutputsParams) -> None:
        """Constrain one request's sequences (its ``n`` copies), which share one budget."""
        future, budget = self.compiler.compile(params), _Budget()
        for seq_id in seq_ids:
            self._entries[seq_id] = _Entry(future, budget)

    def new_step(self) -> None:
        """A step begins: what its bitmasks and accepts take counts toward the step bound."""
        self._step += 1

    def has(self, seq_id: str) -> bool:
        return seq_id in self._entries

    def active(self) -> bool:
        """Whether any sequence is constrained (else a step has no grammar work at all)."""
        return bool(self._entries)

    def error(self, seq_id: str) -> str | None:
        """Why the sequence's grammar failed to compile (None while pending or once ready)."""
        future = self._entries[seq_id].future
        if not future.done():
            return None
        if future.cancelled():  # the compiler was shut down
            return "the grammar compiler was shut down before compiling it"
        return None if future.exception() is None else str(future.exception())

    def ready(self, seq_id: str) -> bool:
        """Compiled, with its matcher made; False while compiling or after a failure."""
        entry = self._entries[seq_id]
        if entry.matcher is None:
            if not _succeeded(entry.future):
                return False
            entry.matcher = self.compiler.matcher(entry.future.result())
        return True

    def wait_any(self, seq_ids: list[str], timeout: float) -> None:
        """Block until one of these sequences' grammars is compiled (or ``timeout``)."""
        futures = [self._entries[s].future for s in seq_ids if s in self._entries]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def forget(self, seq_id: str) -> None:
        self._entries.pop(seq_id, None)

    def allowed_proposal(self, seq_id: str, proposal: list[int]) -> int:
        """How many leading tokens of ``proposal`` the grammar accepts, up to and not including
        its stop token: no bitmask row can follow that token, and the row before it offers it
        anyway (the matcher is left as it was)."""
        entry = self._entries[seq_id]
        start, matcher = self.clock(), entry.matcher
        n, ends = 0, False
        for token in proposal[: self.max_rollback]:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            n += 1
            if matcher.is_terminated():
                ends = True
                break
        if n:
            matcher.rollback(n)
        self._charge(entry, self.clock() - start)
        return n - ends

    def bitmasks(self, wanted: list[tuple[str, list[int]]]) -> dict[str, Any]:
        """Bitmask rows for ``(seq_id, proposal)`` pairs, filled on the fill thread in one
        handoff (another after each overrun). Per sequence: the allowed tokens of its next
        ``1 + len(proposal)`` rows, as int32 bitmask rows (bit ``t % 32`` of word ``t // 32``
        set when token t is allowed; row j as if the first j proposed tokens were accepted;
        the proposal must be one ``allowed_proposal`` passed); or the exception its fill
        raised (FillTimeout past ``fill_timeout``: its request is then over budget, and its
        matcher stays with the thread left behind); or None when its request was already past
        its matching budget (no fill: n copies of a costly grammar would stall the step n
        times)."""
        filled: dict[str, Any] = {}
        while wanted:
            jobs = [functools.partial(self._fill_in_budget, *pair) for pair in wanted]
            results = self.fills.run_each(jobs, self.fill_timeout)
            for (seq_id, _), result in zip(wanted, results, strict=False):
                filled[seq_id] = result
                if isinstance(result, FillTimeout):
                    self._entries[seq_id].budget.overran = self.fill_timeout
            wanted = wanted[len(results) :]
        return filled

    def _fill_in_budget(self, seq_id: str, proposal: list[int]) -> torch.Tensor | None:
        """On the fill thread: one sequence's rows, charged to its request's budget; None
        when the request is already past it (not filled)."""
        entry, clock = self._entries[seq_id], self.clock  # the clock it began with, to the end
        if self.over_budget(seq_id) is not None:
            return None
        start = clock()
        try:
            return self._fill(entry.matcher, proposal)
        finally:
            self._charge(entry, clock() - start)

    def _fill(self, matcher: Any, proposal: list[int]) -> torch.Tensor:
        rows = torch.empty((1 + len(proposal), self._words), dtype=torch.int32)
        accepted = 0
        for j in range(len(proposal) + 1):
            matcher.fill_next_token_bitmask(rows, j)
            if j < len(proposal):
                ok = matcher.accept_token(proposal[j])
                assert ok, "the scheduler kept only proposals the grammar accepts"
                accepted += 1
        if accepted:
            matcher.rollback(accepted)
        return rows

    def accept(self, seq_id: str, tokens: list[int]) -> bool:
        """Advance with the sequence's new tokens; False if the grammar rejects one."""
        entry = self._entries[seq_id]
        start = self.clock()
        ok = all(entry.matcher.accept_token(t) for t in tokens)
        self._charge(entry, self.clock() - start)
        return ok

    def _charge(self, entry: _Entry, seconds: float) -> None:
        budget = entry.budget
        if budget.step != self._step:
            budget.step, budget.step_seconds = self._step, 0.0
        budget.step_seconds += seconds
        budget.slowest_step = max(budget.slowest_step, budget.step_seconds)
        budget.seconds += seconds

    def over_budget(self, seq_id: str) -> str | None:
        """Why the grammar of this sequence's request costs too much to go on matching, or
        None."""
        budget = self._entries[seq_id].budget
        if budget.overran:
            return (
                f"the grammar is too expensive to match: a bitmask took more than "
                f"{budget.overran:g} s"
            )
        if budget.slowest_step > self.max_step_seconds:
            return (
                f"the grammar is too expensive to match: one step took "
                f"{budget.slowest_step:.2f} s (at most {self.max_step_seconds:g} s; an "
                "ambiguous grammar?)"
            )
        if budget.seconds > self.max_seconds:
            return (
                f"the grammar is too expensive to match: {budget.seconds:.1f} s in all "
                f"(at most {self.max_seconds:g} s)"
            )
        return None

    def shutdown(self) -> None:
        """Stop compiling (queued compiles are cancelled, workers killed) and filling."""
        self.compiler.shutdown()
        self.fills.close()

    def admitted(self, seq_id: str) -> GrammarOptions:
        """What the grammar admits as the sequence's next token, in its present state."""
        row = torch.empty((1, self._words), dtype=torch.int32)
        self._entries[seq_id].matcher.fill_next_token_bitmask(row, 0)
        allowed = bitmask_allowed(row[0], self.compiler.vocab_size).nonzero().flatten().tolist()
        stops = set(self.compiler.stop_token_ids)
        return GrammarOptions(
            tokens=len(allowed), only_end=bool(allowed) and all(t in stops for t in allowed)
        )

    def is_terminated(self, seq_id: str) -> bool:
        """The grammar is complete and its stop token accepted: nothing more may follow."""
        return self._entries[seq_id].matcher.is_terminated()
