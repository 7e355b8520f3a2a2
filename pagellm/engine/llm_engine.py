"""The synchronous engine: add_request / step / abort over scheduler, runner and detokenizer.

The runner and tokenizer are injected (anything with ``execute(SchedulerOutput)`` and
``decode(ids, skip_special_tokens)``), so this module stays free of torch. A request with
``n > 1`` becomes n sequences; copies 2..n reuse the first copy's prompt blocks.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pagellm.config import EngineConfig
from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.engine.errors import ContextLengthExceeded, RequestRejected
from pagellm.engine.kv_cache_manager import KVCacheManager, cdiv
from pagellm.engine.outputs import (
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    RunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from pagellm.engine.request import FinishReason, Request, RequestStatus
from pagellm.engine.sampling_params import ParamError, SamplingParams
from pagellm.engine.scheduler import Scheduler
from pagellm.spec.settings import spec_settings
from pagellm.structured.params import StructuredOutputError

_SEED_MASK = (1 << 64) - 1
"""Per-sequence seeds (a request's seed + its copy's index) wrap to 64 bits, what torch takes."""


class Executor(Protocol):
    """Runs steps. May also have ``num_host_blocks`` (swap), ``healthy()`` (False once a part
    of it died) and ``shutdown()`` (stop what it started)."""

    num_blocks: int

    def execute(self, sched: SchedulerOutput) -> RunnerOutput: ...


class StructuredOutputs(Protocol):
    """Grammar state per sequence (``pagellm.structured.grammar.StructuredOutputManager``)."""

    def start(self, seq_ids: list[str], params: object) -> None: ...
    def new_step(self) -> None: ...
    def has(self, seq_id: str) -> bool: ...
    def active(self) -> bool: ...
    def error(self, seq_id: str) -> str | None: ...
    def ready(self, seq_id: str) -> bool: ...
    def wait_any(self, seq_ids: list[str], timeout: float) -> None: ...
    def forget(self, seq_id: str) -> None: ...
    def allowed_proposal(self, seq_id: str, proposal: list[int]) -> int: ...
    def bitmasks(self, wanted: list[tuple[str, list[int]]]) -> dict[str, object]: ...
    def accept(self, seq_id: str, tokens: list[int]) -> bool: ...
    def is_terminated(self, seq_id: str) -> bool: ...
    def over_budget(self, seq_id: str) -> str | None: ...
    def shutdown(self) -> None: ...


class TokenizerLike(Protocol):
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(slots=True)
class _Sequence:
    request: Request
    detok: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None


@dataclass(slots=True)
class _Group:
    """The n sequences of one user request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        tokenizer: TokenizerLike,
        max_model_len: int,
        vocab_size: int,
        clock: Callable[[], float] = time.monotonic,
        attention_crossover: float | None = None,
        structured: StructuredOutputs | None = None,
    ) -> None:
        """``structured``: grammar state for requests with ``structured_outputs`` (without
        it such requests are refused)."""
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.clock = clock
        block_size = config.cache.block_size
        if cdiv(max_model_len, block_size) > executor.num_blocks:
            raise ValueError(
                f"the KV cache holds {executor.num_blocks * block_size} tokens, fewer than "
                f"max_model_len={max_model_len}: raise --kv-cache-memory or lower --max-model-len"
            )
        swap = config.scheduler.preemption_mode == "swap"
        self.kv_manager = KVCacheManager(
            executor.num_blocks,
            block_size,
            config.cache.enable_prefix_caching,
            getattr(executor, "num_host_blocks", 0) if swap else 0,
        )
        self.spec = spec_settings(config.speculative)
        if self.spec is not None and config.model.batch_invariant:
            # whether a step speculates must not depend on what shares the batch: a seeded
            # request draws differently in the speculative and the plain sampler
            self.spec = dataclasses.replace(self.spec, disable_by_batch_size=1 << 30)
        draft_len = getattr(executor, "draft_max_model_len", None)
        if self.spec is not None and draft_len is not None:
            limit = min(draft_len, self.spec.max_model_len or draft_len)
            self.spec = dataclasses.replace(self.spec, max_model_len=limit)
        self.scheduler = Scheduler(
            config.scheduler, self.kv_manager, clock, attention_crossover, self.spec,
            chunk_quantum=getattr(executor, "prefill_chunk_quantum", 1),
            layered_rows=getattr(executor, "layered_prefill_rows", 0),
        )  # fmt: skip
        self.structured = structured
        if structured is not None:
            self.scheduler.allowed_proposal = self._allowed_proposal
        self._groups: dict[str, _Group] = {}
        self._seq_to_group: dict[str, _Group] = {}
        self._compiling: dict[str, _Group] = {}
        """Requests whose grammar is still compiling: they join the scheduler once it is."""
        self._rng = random.Random(config.model.seed)

    # ----- requests ---------------------------------------------------------------------

    def executor_healthy(self) -> bool:
        healthy = getattr(self.executor, "healthy", None)
        return healthy() if healthy is not None else True

    def shutdown(self) -> None:
        """Stop the executor's processes, if it has any, and the grammar compiler's (queued
        compiles are dropped: they would hold the process's exit)."""
        stop = getattr(self.executor, "shutdown", None)
        if stop is not None:
            stop()
        if self.structured is not None:
            self.structured.shutdown()

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        prompt_text: str | None = None,
        tenant: str = "default",
    ) -> None:
        """Queue a request; raises RequestRejected if it can never run.

        ``prompt_text`` names the text of a prompt given as token ids (for the outputs);
        ``tenant`` is whom it is for (fair scheduling).
        """
        params = params or SamplingParams()
        if request_id in self._groups:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        self.check_priority(priority)
        self.check_params(params)
        text, ids = self.prepare_prompt(prompt)
        group = _Group(request_id, text if text is not None else prompt_text, ids)
        arrival = self.clock() if arrival_time is None else arrival_time
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        for i in range(params.n):
            req = Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=ids,
                params=params,
                eos_token_id=self.tokenizer.eos_token_id,
                arrival_time=arrival,
                max_model_len=self.max_model_len,
                priority=priority,
                tenant=tenant,
                seed=(base_seed + i) & _SEED_MASK,
                parent_id=None if i == 0 else group.seqs[0].request.request_id,
            )
            detok = IncrementalDetokenizer.for_prompt(
                self.tokenizer.decode, ids, params.skip_special_tokens, params.stop
            )
            group.seqs.append(_Sequence(req, detok, [] if params.logprobs is not None else None))
        if params.structured_outputs is not None:
            self._start_grammars(group, params.structured_outputs)
            if self._grammars_ready(group) and (why := self._admits_no_output(group)):
                for seq in group.seqs:
                    self._forget_grammar(seq.request.request_id)
                raise RequestRejected(why)
        self._groups[request_id] = group
        for seq in group.seqs:
            self._seq_to_group[seq.request.request_id] = group
        if params.structured_outputs is None or self._grammars_ready(group):
            self._schedule_group(group)
        else:
            self._compiling[request_id] = group
        self.scheduler.stats.prompt_tokens += len(ids)
        if params.structured_outputs is not None:
            kinds = self.scheduler.stats.structured_output_requests
            kind = params.structured_outputs.kind
            kinds[kind] = kinds.get(kind, 0) + 1

    def _schedule_group(self, group: _Group) -> None:
        for seq in group.seqs:
            self.scheduler.add_request(seq.request)

    # ----- structured outputs -----------------------------------------------------------

    def _start_grammars(self, group: _Group, constraint: object) -> None:
        """Start compiling (a cached grammar is ready at once); one that is known not to
        compile rejects the request here."""
        if self.structured is None:
            raise RequestRejected(
                "structured outputs are not available on this engine", param="structured_outputs"
            )
        seq_ids = [s.request.request_id for s in group.seqs]
        self.structured.start(seq_ids, constraint)
        why = self.structured.error(seq_ids[0])
        if why is not None:
            for seq_id in seq_ids:
                self.structured.forget(seq_id)
            raise StructuredOutputError(why)

    def _grammars_ready(self, group: _Group) -> bool:
        assert self.structured is not None
        return all(self.structured.ready(s.request.request_id) for s in group.seqs)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammars finished compiling join the scheduler; those whose grammar
        failed end with the compiler's error. With nothing else to run, wait a little for a
        compilation instead of spinning."""
        if not self._compiling:
            return []
        assert self.structured is not None
        if not self.scheduler.has_unfinished():
            seq_ids = [s.request.request_id for g in self._compiling.values() for s in g.seqs]
            self.structured.wait_any(seq_ids, timeout=0.05)
        outputs = []
        for request_id, group in list(self._compiling.items()):
            why = self.structured.error(group.seqs[0].request.request_id)
            if why is not None:
                del self._compiling[request_id]
                outputs.append(self._fail(request_id, why, bad_request=True))
            elif self._grammars_ready(group):
                del self._compiling[request_id]
                if why := self._admits_no_output(group):
                    outputs.append(self._fail(request_id, why, bad_request=True))
                else:
                    self._schedule_group(group)
        return outputs

    def _admits_no_output(self, group: _Group) -> str | None:
        """Why no output can satisfy the group's constraint (its grammar admits no first
        token), or None."""
        assert self.structured is not None
        if self.structured.admitted(group.seqs[0].request.request_id).tokens:
            return None
        return (
            "the structured output constraint admits no output at all "
            "(a regex or grammar whose language is empty?)"
        )

    def _conflict(self, req: Request, produced: int) -> str:
        """Why the grammar rejected a token sampled after ``produced`` output tokens: only
        when every token it admits was excluded by the request's other settings (the sampler
        applies its bitmask)."""
        assert self.structured is not None
        options = self.structured.admitted(req.request_id)
        params = req.params
        if options.tokens == 0:
            return "the structured output constraint admits no token here: it cannot be completed"
        if options.only_end and produced < params.min_tokens:
            return (
                f"the structured output is complete after fewer than min_tokens="
                f"{params.min_tokens} tokens, and min_tokens keeps it from ending"
            )
        if params.allowed_token_ids is not None:
            return (
                f"none of the {options.tokens} tokens the structured output constraint admits "
                "here is in allowed_token_ids"
            )
        return (
            "no token satisfies both the structured output constraint and the request's "
            "other sampling settings"
        )

    def _allowed_proposal(self, seq_id: str, proposal: list[int] | None) -> int | None:
        """How many proposed tokens a constrained sequence may verify (None: unconstrained;
        a draft model's proposals, not known yet, get 0)."""
        if self.structured is None or not self.structured.has(seq_id):
            return None
        if not proposal or self.structured.over_budget(seq_id) is not None:
            return 0  # a copy of a request past its budget: no more checks this step
        return self.structured.allowed_proposal(seq_id, proposal)

    def _attach_bitmasks(self, sched: SchedulerOutput) -> tuple[dict[str, str], dict[str, str]]:
        """Each constrained sampling row's bitmask, filled in one handoff a step. Returns the
        sequences whose grammar failed to give one (seq id -> why): they fail alone after the
        step, and their row samples unconstrained meanwhile (its tokens are dropped with the
        request); and those whose request is past its matching budget (a fill that overran, or
        a copy's fill or a proposal check before it this step), failed as bad requests: a
        sequence found past it gets no fill, since ``n`` costly fills would stall the step ``n``
        times."""
        structured = self.structured
        if structured is None or not structured.active():
            return {}, {}
        start, failed, over_budget = self.clock(), {}, {}
        wanted = {}
        for item in sched.scheduled:
            if item.sample and structured.has(item.request_id):
                if (why := structured.over_budget(item.request_id)) is not None:
                    over_budget[item.request_id] = why  # past it already (a proposal check)
                else:
                    wanted[item.request_id] = item
        if not wanted:
            return failed, over_budget
        filled = structured.bitmasks([(s, item.spec_token_ids) for s, item in wanted.items()])
        rows_filled = 0
        for seq_id, rows in filled.items():
            if rows is not None and not isinstance(rows, BaseException):
                wanted[seq_id].token_bitmask = rows
                rows_filled += 1
            elif (why := structured.over_budget(seq_id)) is not None:
                over_budget[seq_id] = why  # skipped, or its fill overran: the client's grammar
            else:
                failed[seq_id] = f"structured output failed: {rows}"
        if rows_filled:
            self.stats.structured_mask_seconds += self.clock() - start
            self.stats.structured_mask_steps += 1
        return failed, over_budget

    def _advance_grammars(
        self,
        touched: list[tuple[Request, int]],
        failed: dict[str, str],
        bad_requests: set[str],
    ) -> None:
        """Feed each constrained sequence its new tokens; one the grammar rejects, or whose
        matching takes too long (it would stall every step), fails its request; one whose
        grammar is complete stops. Both failures are the request's own (``bad_requests``: a
        client error): a rejected token means its settings left no token the grammar admits,
        and a grammar too costly to match is the one it sent."""
        structured = self.structured
        if structured is None or not structured.active():
            return
        for req, num_new in touched:
            seq_id = req.request_id
            if not structured.has(seq_id):
                continue
            group = self._seq_to_group.get(seq_id)
            if group is None or group.request_id in failed:
                continue
            new = req.output_token_ids[len(req.output_token_ids) - num_new :]
            try:
                accepted = structured.accept(seq_id, new)
            except Exception as exc:  # noqa: BLE001 - this request's grammar: it fails alone
                failed[group.request_id] = f"structured output failed: {exc}"
                continue
            why = structured.over_budget(seq_id)
            if not accepted or why is not None:
                if why is None:
                    why = self._conflict(req, len(req.output_token_ids) - num_new)
                bad_requests.add(group.request_id)
                failed[group.request_id] = why
            elif structured.is_terminated(seq_id) and not req.is_finished:
                self.scheduler.finish_request(seq_id, FinishReason.STOP)

    def check_params(self, params: SamplingParams) -> None:
        """What a request's parameters must meet for this model (its vocabulary); raises
        ParamError. ``SamplingParams`` checked the rest when it was made (not again here: this
        runs in the engine thread for every request)."""
        params.check_vocab(self.vocab_size)
        if params.allowed_token_ids and params.min_tokens > 0:
            # min_tokens bans the stop tokens and EOS until it is reached; were those all the
            # allowed tokens, no token would be left to sample (the row all -inf)
            stops = {*params.stop_token_ids, self.tokenizer.eos_token_id}
            if stops.issuperset(params.allowed_token_ids):
                raise ParamError(
                    "allowed_token_ids",
                    f"holds only stop tokens (stop_token_ids or end-of-sequence), which "
                    f"min_tokens={params.min_tokens} keeps from being sampled",
                )

    def check_priority(self, priority: int) -> None:
        """As vLLM: a non-zero priority is an error unless the policy uses it."""
        policy = self.config.scheduler.scheduling_policy
        if priority != 0 and policy != "priority":
            raise RequestRejected(
                f"priority {priority} given but the scheduling policy is {policy!r}: "
                "start the engine with --scheduling-policy priority",
                param="priority",
            )

    def prepare_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """Tokenize and validate a prompt; raises RequestRejected. Reads only immutable state,
        so a front end may call it from another thread than the one stepping the engine."""
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt))
        text, ids = (
            (prompt, self.tokenizer.encode(prompt))
            if isinstance(prompt, str)
            else (
                None,
                list(prompt),
            )
        )
        self._validate(ids)
        return text, ids

    def check_prompt_chars(self, chars: int) -> None:
        """Refuse a prompt of ``chars`` characters that cannot fit even if every token took
        the most characters one can (``max_token_chars``, where the tokenizer has it): a
        body of megabytes is then not tokenized (and its token list held) only to be
        refused. Raises ContextLengthExceeded."""
        per_token = getattr(self.tokenizer, "max_token_chars", None)
        if per_token and chars > per_token * (self.max_model_len - 1):
            least = -(-chars // per_token)
            raise ContextLengthExceeded(least, None, self.max_model_len, at_least=True)

    def _validate(self, ids: list[int]) -> None:
        if not ids:
            raise RequestRejected("the prompt is empty", param="prompt")
        if any(not isinstance(t, int) or t < 0 or t >= self.vocab_size for t in ids):
            raise RequestRejected(
                f"prompt token ids must be integers in [0, {self.vocab_size})", param="prompt"
            )
        if len(ids) >= self.max_model_len:
            raise ContextLengthExceeded(len(ids), None, self.max_model_len)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is unknown or done."""
        return self._end_group(request_id, FinishReason.ABORT) is not None

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort many at once: their blocks are freed now, and the scheduler's queues and
        statistics are updated in one pass for all of them."""
        for request_id in request_ids:
            self._end_group(request_id, FinishReason.ABORT)
        self.scheduler.refresh_queue_stats()

    def _end_group(self, request_id: str, reason: FinishReason) -> _Group | None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        self._compiling.pop(request_id, None)
        for seq in group.seqs:
            self._seq_to_group.pop(seq.request.request_id, None)
            self.scheduler.finish_request(seq.request.request_id, reason)
            if seq.request.finish_reason is None:  # never reached the scheduler
                seq.request.finish_reason = reason
                seq.request.status = RequestStatus.FINISHED
            self._forget_grammar(seq.request.request_id)
        return group

    def _forget_grammar(self, seq_id: str) -> None:
        if self.structured is not None:
            self.structured.forget(seq_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats

    # ----- stepping ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch step; returns an output for every request that advanced."""
        start = self.clock()
        admitted = self._admit_compiled()
        if self.structured is not None:
            self.structured.new_step()  # the schedule's proposals count toward this step
        sched = self.scheduler.schedule()
        mask_failed, over_budget = self._attach_bitmasks(sched)
        before_execute = self.clock()
        result = self.executor.execute(sched)
        self.stats.execute_seconds += self.clock() - before_execute
        bad_requests = set(self._groups_of(over_budget))
        failed = self._groups_of({**over_budget, **result.failed, **mask_failed})
        touched = self.scheduler.update(sched, result)
        self._advance_grammars(touched, failed, bad_requests)
        self._drop_unseen_tokens(touched, failed)
        groups: dict[str, _Group] = {}
        for req, num_new in touched:
            group = self._seq_to_group.get(req.request_id)
            if group is None or group.request_id in failed:
                continue
            try:
                self._process_tokens(group, req, num_new, result)
            except Exception as exc:  # noqa: BLE001 - this request's own fault: it fails alone
                failed[group.request_id] = f"{type(exc).__name__}: {exc}"
                continue
            groups[group.request_id] = group
        outputs = [
            self._finish_or_snapshot(g) for g in groups.values() if g.request_id not in failed
        ]
        outputs += [
            self._fail(request_id, why, bad_request=request_id in bad_requests)
            for request_id, why in failed.items()
        ]
        outputs += admitted
        self.stats.busy_seconds += self.clock() - start
        return outputs

    def _drop_unseen_tokens(
        self, touched: list[tuple[Request, int]], failed: dict[str, str]
    ) -> None:
        """A request failing in this step ends with the tokens it had before it: this step's
        were neither detokenized nor, for a grammar's refusal, its own (a token sampled from a
        row the grammar left empty)."""
        if not failed:
            return
        for req, num_new in touched:
            group = self._seq_to_group.get(req.request_id)
            if group is not None and group.request_id in failed:
                req.truncate_output(len(req.output_token_ids) - num_new)

    def _groups_of(self, failed_seqs: dict[str, str]) -> dict[str, str]:
        """Request id -> why, for the user requests that own the failed sequences."""
        out: dict[str, str] = {}
        for seq_id, why in failed_seqs.items():
            group = self._seq_to_group.get(seq_id)
            if group is not None:
                out.setdefault(group.request_id, why)
        return out

    def _fail(self, request_id: str, why: str, bad_request: bool = False) -> RequestOutput:
        """End a whole request (all n sequences) for a fault of its own; its output carries
        the error (``bad_request``: what it asked cannot be done), and nothing else in the
        batch is touched."""
        group = self._end_group(request_id, FinishReason.ERROR)
        assert group is not None
        out = make_output(group, True, error=why)
        out.error_is_bad_request = bad_request
        return out

    def _process_tokens(
        self, group: _Group, req: Request, num_new: int, result: RunnerOutput
    ) -> None:
        """Detokenize the request's ``num_new`` new tokens one by one (stop strings are
        checked after each); tokens after a stop string are dropped, as if never generated."""
        seq = next(s for s in group.seqs if s.request is req)
        first = len(req.output_token_ids) - num_new
        logprobs = result.logprobs.get(req.request_id, [])
        for i, token in enumerate(req.output_token_ids[first:]):
            if seq.logprobs is not None and i < len(logprobs):
                seq.logprobs.append(logprobs[i])
            # as vLLM, stop strings count once the output is longer than min_tokens
            stop = seq.detok.add_tokens([token], first + i + 1 > req.params.min_tokens)
            if stop is None:
                continue
            if not req.is_finished:
                self.scheduler.finish_request(req.request_id, FinishReason.STOP)
            req.finish_reason = FinishReason.STOP
            req.stop_reason = stop
            req.truncate_output(first + i + 1)
            return

    def _finish_or_snapshot(self, group: _Group) -> RequestOutput:
        finished = group.finished
        if finished:
            self._groups.pop(group.request_id, None)
            for seq in group.seqs:
                self._seq_to_group.pop(seq.request.request_id, None)
                self._forget_grammar(seq.request.request_id)
        return make_output(group, finished)


def make_output(group: _Group, finished: bool, error: str | None = None) -> RequestOutput:
    outputs = []
    for i, seq in enumerate(group.seqs):
        req = seq.request
        outputs.append(
            CompletionOutput(
                index=i,
                text=seq.detok.visible_text(req.is_finished),
                token_ids=list(req.output_token_ids),
                finish_reason=req.finish_reason.value if req.finish_reason else None,
                stop_reason=req.stop_reason,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            )
        )
    first = group.seqs[0].request
    metrics = RequestMetrics(
        arrival_time=first.arrival_time,
        first_scheduled_time=first.first_scheduled_time,
        first_token_time=min(
            (s.request.first_token_time for s in group.seqs if s.request.first_token_time),
            default=None,
        ),
        finish_time=max((s.request.finish_time or 0.0 for s in group.seqs), default=None)
        if finished
        else None,
        num_preemptions=sum(s.request.num_preemptions for s in group.seqs),
    )
    return RequestOutput(
        group.request_id, group.prompt, group.prompt_token_ids, outputs, finished, metrics, error
    )
