"""Typed records that cross layers: scheduler -> runner -> scheduler -> user."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagellm.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute ``token_ids`` at positions ``start_pos...``."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    """True when this chunk reaches the end of the known tokens, so a next token is sampled."""
    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None
    spec_token_ids: list[int] = field(default_factory=list)
    """Proposed tokens (speculative decoding), the tail of ``token_ids``: the runner verifies
    them with the logits at their positions and the one before."""
    num_draft_slots: int = 0
    """Draft-model speculation: how many tokens the runner's draft model may propose after
    ``token_ids`` (their KV slots are allocated); it appends them before the target's forward."""
    token_bitmask: Any = None
    """Structured outputs: the allowed tokens of each sampling row (int32 bitmask rows, one per
    proposal plus one; row j as if the first j proposals were accepted), None if unconstrained."""
    layer_parts: int = 1
    """A long prompt's deep chunk beside decoding streams: the runner may spread its layers
    over this many steps (layered prefill); the scheduler schedules the same chunk again until
    the runner reports it whole (``RunnerOutput.unfinished``)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests that ended since the last step: the runner drops their per-request state."""
    preempted_request_ids: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(device block, host block) copies to make before this step's forward."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(host block, device block) copies to make after the swap-outs, before the forward."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of the sampled token and the ``top`` alternatives, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, list[int]]
    """Request id -> its new tokens: one, or (speculative decoding) the accepted proposals and
    the token sampled after them."""
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    """Requests whose own preparation or sampling raised -> why; they fail, the step stands."""
    num_proposed: dict[str, int] = field(default_factory=dict)
    """Draft-model speculation: request id -> tokens its draft proposed and the target
    verified this step."""
    unfinished: set[str] = field(default_factory=set)
    """Chunks that went through only some of the model's layers this step (``layer_parts``):
    their tokens are not computed yet, and the chunk is scheduled again."""


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    """What the user sees of a request (all ``n`` completions); ``delta`` fields for streaming."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    """Set (with ``finished``) when this request failed on its own fault; others run on."""
    error_is_bad_request: bool = False
    """The error is in what the request asked (settings no output can meet, a constraint
    that does not compile): a client error, not a failure to serve it."""


@dataclass(slots=True)
class EngineStats:
    """Engine-wide counters for benchmarks and metrics."""

    num_steps: int = 0
    busy_seconds: float = 0.0
    """Wall time spent inside ``LLMEngine.step`` (scheduling, model, bookkeeping)."""
    execute_seconds: float = 0.0
    """Of that, wall time inside the executor (input preparation, forward, sampling)."""
    num_preemptions: int = 0
    num_preemptions_swap: int = 0
    """Of those, preemptions that swapped the request's blocks out (the rest recompute)."""
    num_swapped: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    peak_kv_usage: float = 0.0
    kv_waste_at_peak: float = 0.0
    """Allocated-but-unfilled slots / allocated slots, at the step of peak KV usage."""
    prompt_tokens: int = 0
    generation_tokens: int = 0
    tenants: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Tenant -> (running, waiting) sequences."""
    prefix_cache_queries: int = 0
    """Tokens of admitted requests looked up in the prefix cache."""
    prefix_cache_hits: int = 0
    """Of those, tokens whose KV was found cached (not computed again)."""
    finished: dict[str, int] = field(default_factory=dict)
    """Finished requests (sequences) by finish reason: stop, length, abort."""
    spec_num_drafts: int = 0
    """Speculative decoding: verify steps of a sequence that had proposals."""
    spec_num_draft_tokens: int = 0
    """Proposed tokens verified."""
    spec_num_accepted_tokens: int = 0
    """Of those, tokens the target accepted."""
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    """Accepted tokens by position in the proposal (index 0: the first proposed token)."""
    structured_output_requests: dict[str, int] = field(default_factory=dict)
    """Requests with structured outputs by kind: json, regex, choice, grammar, json_object."""
    structured_mask_seconds: float = 0.0
    """Time spent filling grammar token bitmasks before steps."""
    structured_mask_steps: int = 0
    """Steps that filled at least one grammar bitmask."""
