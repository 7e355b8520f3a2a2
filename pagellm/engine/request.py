"""A request's lifecycle state: its tokens, how many have KV in the cache, status and timings.

Invariant: ``num_computed_tokens <= len(all_token_ids)``. The difference is what the next step has
to compute (a prompt chunk, or the one token sampled last step). Preemption by recompute resets
``num_computed_tokens`` to 0; the tokens themselves are never lost.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagellm.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    """A fault while preparing or sampling this request alone."""


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated (each of ``n`` completions is its own Request)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    max_model_len: int
    priority: int = 0
    seed: int = 0
    parent_id: str | None = None
    """Set on copies 2..n: they reuse the prompt blocks of ``parent_id`` once it has prefilled."""
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    arrival_seq: int = 0
    """Order of arrival, for FCFS and for choosing preemption victims."""
    tenant: str = "default"
    """Who the request is for (the API's ``user``), for fair scheduling."""
    cache_extra_keys: tuple = ()
    """What else, besides the tokens, decides the KV (e.g. an adapter id): enters block hashes."""

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past the first ``num_output_tokens`` (a finished request's tokens
        after its stop string, when one step gave it several)."""
        drop = len(self.output_token_ids) - num_output_tokens
        if drop > 0:
            del self.output_token_ids[num_output_tokens:]
            del self.all_token_ids[len(self.all_token_ids) - drop :]

    def check_stop(self) -> FinishReason | None:
        """Stop conditions that depend only on token ids (stop strings are checked on text)."""
        params = self.params
        n_out = len(self.output_token_ids)
        if n_out == 0:
            return None
        last = self.output_token_ids[-1]
        if n_out >= params.min_tokens:
            if not params.ignore_eos and last == self.eos_token_id:
                self.stop_reason = None
                return FinishReason.STOP
            if last in params.stop_token_ids:
                self.stop_reason = last
                return FinishReason.STOP
        if params.max_tokens is not None and n_out >= params.max_tokens:
            return FinishReason.LENGTH
        if len(self.all_token_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None
