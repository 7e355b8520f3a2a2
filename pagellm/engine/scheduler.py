"""Continuous batching: which requests compute which tokens in the next step.

There are no prefill/decode phases. Every request has ``num_computed_tokens`` catching up to its
tokens under one token budget per step: running requests first, then waiting ones while the
budget, ``max_num_seqs`` and free blocks allow, both in the order of the scheduling policy
(``engine/policy.py``: fcfs, priority or fair). Long prompts are cut into chunks, and while
others decode a long prompt gets small ones (``engine/chunking.py``). When blocks run
out, the policy's victim (the least important running request, sparing ones preempted
repeatedly) is preempted by recompute: it frees its blocks and returns to the waiting queue, where
its rank puts it ahead of everything that arrived after it. Under the priority policy a more
important arrival that does not fit preempts less important running requests.

Speculative decoding: a decoding request may carry proposed tokens after its last one (n-gram:
proposed here; draft model: ``num_draft_slots`` for the runner's draft to fill), within the token
budget, its max_tokens and max_model_len, and only in steps with at most
``disable_by_batch_size`` running requests. Its slots are reserved for all of them; after the
step only the accepted ones count as computed, and blocks past them go back to the pool.
"""

from __future__ import annotations

from collections.abc import Callable

from pagellm.config import SchedulerConfig
from pagellm.engine.chunking import ChunkPolicy, StepChunks
from pagellm.engine.kv_cache_manager import KVCacheManager, cdiv
from pagellm.engine.outputs import EngineStats, RunnerOutput, ScheduledRequest, SchedulerOutput
from pagellm.engine.policy import make_policy
from pagellm.engine.request import FinishReason, Request, RequestStatus
from pagellm.spec.ngram import NgramProposer
from pagellm.spec.settings import SpecSettings


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        clock: Callable[[], float],
        attention_crossover: float | None = None,
        spec: SpecSettings | None = None,
        chunk_quantum: int = 1,
        layered_rows: int = 0,
    ) -> None:
        """``attention_crossover``, ``chunk_quantum`` and ``layered_rows``: see
        ``ChunkPolicy``."""
        self.config = config
        self.spec = spec
        self.proposer = (
            NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
            if spec is not None and spec.method == "ngram"
            else None
        )
        self.allowed_proposal: Callable[[str, list[int] | None], int | None] | None = None
        """Structured outputs: how many of a request's proposed tokens (None: a draft model's,
        not known yet) its grammar lets it verify; None for an unconstrained request."""
        self.chunking = ChunkPolicy.from_config(
            config, attention_crossover, chunk_quantum, layered_rows
        )
        self.kv = kv_manager
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        """Preempted by swap: their KV is in host blocks; they resume before new admissions."""
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self.policy = make_policy(config.scheduling_policy, config.preemption_protect_after)
        if config.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"unknown preemption mode {config.preemption_mode!r}; choose recompute or swap"
            )
        self.stats = EngineStats()
        self._finished_ids: list[str] = []
        self._arrivals = 0
        self._stale = False
        """Finished requests may still sit in the queues; ``_drop_finished`` takes them out in
        one pass, so many finishes (an abort storm) cost one scan, not one each."""

    # ----- queue management -------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.arrival_seq = self._arrivals
        self._arrivals += 1
        self.policy.on_waiting(req)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def refresh_queue_stats(self) -> None:
        """Queue lengths, KV usage and per-tenant counts; one pass, once per step (or per
        batch of aborts), never per finished request."""
        self._drop_finished()
        self.stats.num_running = len(self.running)
        self.stats.num_waiting = len(self.waiting)
        self.stats.num_swapped = len(self.swapped)
        self.stats.kv_usage = self.kv.usage()
        tenants: dict[str, list[int]] = {}
        for queue, slot in ((self.running, 0), (self.waiting, 1), (self.swapped, 1)):
            for req in queue:
                tenants.setdefault(req.tenant, [0, 0])[slot] += 1
        self.stats.tenants = {t: (r, w) for t, (r, w) in tenants.items()}

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """Finish (stop, length, abort, error) a request and free its blocks at once; it leaves
        its queue at the next pass over the queues."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._stale = True
        self.kv.free(req)
        self.kv.forget(req)
        if self.proposer is not None:
            self.proposer.forget(request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.stats.finished[reason.value] = self.stats.finished.get(reason.value, 0) + 1
        req.finish_time = self.clock()
        self.policy.on_finished(req)
        self._finished_ids.append(request_id)
        return req

    def _drop_finished(self) -> None:
        if not self._stale:
            return
        self._stale = False
        self.waiting = [r for r in self.waiting if not r.is_finished]
        self.running = [r for r in self.running if not r.is_finished]
        self.swapped = [r for r in self.swapped if not r.is_finished]

    # ----- scheduling -------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._drop_finished()
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        self.waiting.sort(key=self.policy.rank)
        self.running.sort(key=self.policy.rank)
        for_arrivals = self._preempt_for_arrivals(budget)
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        others = len(self.running) + len(self.swapped)  # ~a row each (the long one too: margin)
        chunks = StepChunks(self.chunking, decoding, others)
        budget = self._schedule_running(budget, scheduled, preempted, chunks)
        if not preempted:  # blocks ran short for running requests: admit nobody new
            budget = self._schedule_swapped(budget, scheduled)
            if not self.swapped:  # swapped requests resume before new ones are admitted
                self._schedule_waiting(budget, scheduled, chunks)
        preempted = for_arrivals + preempted
        finished, self._finished_ids = self._finished_ids, []
        self.stats.num_steps += 1
        swap_out, self._swap_out = self._swap_out, []
        swap_in, self._swap_in = self._swap_in, []
        return SchedulerOutput(scheduled, finished, preempted, swap_out, swap_in)

    def _schedule_running(
        self,
        budget: int,
        scheduled: list[ScheduledRequest],
        preempted: list[str],
        chunks: StepChunks,
    ) -> int:
        speculate = self.spec is not None and len(self.running) <= self.spec.disable_by_batch_size
        reserve = self._blocks_for_one_token_each() if speculate else 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            reserve -= speculate and self._starts_block(req)
            if speculate and remaining == 1:
                proposal, slots = self._propose(req, budget, reserve)
                if slots:
                    scheduled.append(self._scheduled(req, 1, proposal, slots - len(proposal)))
                    budget -= 1 + slots
                    i += 1
                    continue
            num_new = chunks.size(req, req.num_computed_tokens, remaining, min(remaining, budget))
            if num_new is None:  # a partial-prefill limit: it goes on in a later step
                i += 1
                continue
            if not self._make_room(i, num_new, preempted):
                continue  # req itself was preempted and left ``running``
            item = self._scheduled(req, num_new)
            item.layer_parts = chunks.layer_parts(req, item.start_pos, num_new)
            scheduled.append(item)
            budget -= num_new
            i += 1
        return budget

    def _starts_block(self, req: Request) -> bool:
        return req.num_computed_tokens % self.kv.block_size == 0

    def _blocks_for_one_token_each(self) -> int:
        return sum(1 for r in self.running if self._starts_block(r))

    def _propose(self, req: Request, budget: int, reserve: int) -> tuple[list[int], int]:
        """Proposed tokens for a decoding request (n-gram; a draft model proposes in the
        runner, so none here) and the slots allocated for proposals; 0 slots when there are no
        proposals, they would not fit its limits, or their blocks would leave fewer free blocks
        than ``reserve`` (what the requests still to schedule this step need for one token
        each)."""
        assert self.spec is not None
        k = min(
            self.spec.num_speculative_tokens, budget - 1, req.max_model_len - 1 - req.num_tokens
        )
        if self.spec.max_model_len is not None:
            k = min(k, self.spec.max_model_len - 1 - req.num_tokens)
        if req.params.max_tokens is not None:
            k = min(k, req.params.max_tokens - req.num_output_tokens - 1)
        if k <= 0:
            return [], 0
        proposal = []
        if self.proposer is not None:
            proposal = self.proposer.propose(req.request_id, req.all_token_ids, k)
            k = len(proposal)
        if self.allowed_proposal is not None:
            allowed = self.allowed_proposal(req.request_id, proposal or None)
            if allowed is not None:
                proposal, k = proposal[:allowed], min(k, allowed)
        if k == 0:
            return [], 0
        held = len(self.kv.get_block_ids(req.request_id))
        needed = cdiv(req.num_computed_tokens + 1 + k, self.kv.block_size) - held
        if needed + reserve > self.kv.pool.num_free:
            return [], 0
        allocated = self.kv.allocate_slots(req, 1 + k)
        assert allocated, "the free blocks were counted"
        return proposal, k

    def _make_room(self, index: int, num_new: int, preempted: list[str]) -> bool:
        """Allocate slots for ``running[index]``, preempting the policy's victim among the
        requests not scheduled yet this step (``running[index:]``) as needed."""
        req = self.running[index]
        while not self.kv.allocate_slots(req, num_new):
            victim = self.policy.victim(self.running[index:])
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Swap ``req`` out (swap mode, host room) or free it for recompute."""
        self.running.remove(req)
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        copies = self.kv.swap_out(req) if self.config.preemption_mode == "swap" else None
        if copies is not None:
            self._swap_out.extend(copies)
            req.status = RequestStatus.SWAPPED
            self.stats.num_preemptions_swap += 1
            self.swapped.append(req)
            self.swapped.sort(key=self.policy.rank)
            return
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.append(req)
        self.waiting.sort(key=self.policy.rank)

    def _schedule_swapped(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        """Swap requests back in, in rank order, while seats, blocks and budget allow."""
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.can_swap_in(req, num_new):
                break
            self.swapped.pop(0)
            self._swap_in.extend(self.kv.swap_in(req))
            allocated = self.kv.allocate_slots(req, num_new)
            assert allocated, "can_swap_in checked the room"
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(self._scheduled(req, num_new))
            budget -= num_new
        return budget

    def _preempt_for_arrivals(self, budget: int) -> list[str]:
        """Preempt running requests the policy ranks below the first waiting request that does
        not fit (priority policy only; protected requests are spared)."""
        preempted: list[str] = []
        while self.policy.preempts_for_arrivals and self.waiting and self.running:
            arrival = self.waiting[0]
            victim = self.policy.victim(self.running)
            if not self.policy.may_preempt_for(arrival, victim) or self._fits(arrival, budget):
                break
            self._preempt(victim)
            preempted.append(victim.request_id)
        return preempted

    def _fits(self, req: Request, budget: int) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        first_chunk = min(req.num_tokens - req.num_computed_tokens, budget)
        return cdiv(first_chunk, self.kv.block_size) <= self.kv.pool.num_free

    def _schedule_waiting(
        self, budget: int, scheduled: list[ScheduledRequest], chunks: StepChunks
    ) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self._reuse_parent_prompt(req):
                break
            cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
            num_cached = len(cached) * self.kv.block_size
            remaining = req.num_tokens - req.num_computed_tokens - num_cached
            if remaining > budget and not self.config.enable_chunked_prefill:
                break
            start = req.num_computed_tokens + num_cached
            num_new = chunks.size(req, start, remaining, min(remaining, budget))
            if num_new is None or not self.kv.allocate_slots(req, num_new, cached):
                break
            if self.kv.enable_caching and req.num_computed_tokens == 0:
                self.stats.prefix_cache_queries += req.num_tokens
                self.stats.prefix_cache_hits += num_cached
            req.num_computed_tokens += num_cached
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self.clock()
            self.running.append(req)
            item = self._scheduled(req, num_new)
            item.layer_parts = chunks.layer_parts(req, item.start_pos, num_new)
            scheduled.append(item)
            budget -= num_new

    def _reuse_parent_prompt(self, req: Request) -> bool:
        """Copies 2..n of a prompt wait for the first copy's prefill, then share its blocks.

        Returns False while the child should keep waiting. At least one prompt token is always
        recomputed so that the child has logits to sample its first token from.
        """
        if req.parent_id is None or req.num_computed_tokens > 0:
            return True
        parent = self.requests.get(req.parent_id)
        if parent is None or parent.is_finished:
            req.parent_id = None
            return True
        if parent.status != RequestStatus.RUNNING or parent.num_computed_tokens < (
            req.num_prompt_tokens
        ):
            return False
        req.num_computed_tokens = self.kv.share_prefix(req, parent, req.num_prompt_tokens - 1)
        req.parent_id = None
        return True

    def _scheduled(
        self, req: Request, num_new: int, proposal: list[int] | None = None, draft_slots: int = 0
    ) -> ScheduledRequest:
        start = req.num_computed_tokens
        end = start + num_new
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start:end] + (proposal or []),
            start_pos=start,
            block_ids=self.kv.get_block_ids(req.request_id),
            sample=end == req.num_tokens,
            params=req.params,
            seed=req.seed,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            eos_token_id=req.eos_token_id,
            spec_token_ids=proposal or [],
            num_draft_slots=draft_slots,
        )

    # ----- applying the runner's results ------------------------------------------------

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[tuple[Request, int]]:
        """Advance computed tokens, append sampled ones, finish what stopped.

        Returns the requests that got new tokens this step (finished ones included), each
        with how many it got.
        """
        now = self.clock()
        touched: list[tuple[Request, int]] = []
        for request_id in result.failed:
            self.finish_request(request_id, FinishReason.ERROR)
        for item in sched.scheduled:
            req = self.requests.get(item.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if item.request_id in result.unfinished:
                continue  # some layers of its chunk are still to run: scheduled again
            tokens = result.sampled.get(item.request_id) or []
            num_spec = len(item.spec_token_ids)
            proposed = num_spec or result.num_proposed.get(item.request_id, 0)
            # of the proposals, only the accepted ones (all new tokens but the last) have KV
            accepted = max(len(tokens) - 1, 0) if proposed else 0
            req.num_computed_tokens += item.num_tokens - num_spec + accepted
            self.policy.charge(req, item.num_tokens + proposed - num_spec)
            if proposed:
                self._record_acceptance(proposed, accepted)
            reason = self._append(req, tokens)
            if num_spec or item.num_draft_slots:
                self.kv.trim(req)
            self.kv.cache_full_blocks(req)
            if not tokens:
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            touched.append((req, len(tokens)))
            if reason is not None:
                self.finish_request(req.request_id, reason)
        self._record_stats(sched, sum(n for _, n in touched))
        return touched

    @staticmethod
    def _append(req: Request, tokens: list[int]) -> FinishReason | None:
        """Append the new tokens one by one; the first that stops the request is its last
        (``tokens`` is cut there, so callers see what was kept)."""
        for i, token in enumerate(tokens):
            req.append_token(token)
            reason = req.check_stop()
            if reason is not None:
                del tokens[i + 1 :]
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
                return reason
        return None

    def _record_acceptance(self, num_spec: int, accepted: int) -> None:
        stats = self.stats
        stats.spec_num_drafts += 1
        stats.spec_num_draft_tokens += num_spec
        stats.spec_num_accepted_tokens += accepted
        per_pos = stats.spec_accepted_per_pos
        per_pos.extend([0] * (num_spec - len(per_pos)))
        for pos in range(accepted):
            per_pos[pos] += 1

    def _record_stats(self, sched: SchedulerOutput, num_sampled: int) -> None:
        stats = self.stats
        self.refresh_queue_stats()
        stats.generation_tokens += num_sampled
        if stats.kv_usage >= stats.peak_kv_usage and self.running:
            allocated = self.kv.allocated_slots()
            unfilled = self.kv.unfilled_slots(self.running)
            stats.peak_kv_usage = stats.kv_usage
            stats.kv_waste_at_peak = unfilled / allocated if allocated else 0.0
