"""How much of each prompt a step computes: the long-prompt rules on top of the token budget.

vLLM's knobs with vLLM's names: a prompt longer than ``long_prefill_token_threshold`` (by default
the step's token budget: a prompt that needs more than one step) is long; at
most ``max_num_partial_prefills`` requests (``max_long_partial_prefills`` of them long) may end a
step with their prefill unfinished. pagellm adds one rule for the streams already decoding: in a
step that also decodes other requests, a long prompt's chunk is cut to what
``long_prefill_decode_budget`` tokens cost at the start of a sequence, so that the step (and the
decoders' inter-token latency) stays about as long as a decode step. Deeper in a prompt each
token's attention reads more context, so the chunk shrinks as it advances: a token at position
``p`` costs ``1 + p / crossover`` tokens at position 0, ``crossover`` being the context at which
one token's attention costs as much as its linear layers (from the model's shape). The runner's
prefill kernel attends in work items of ``quantum`` tokens, and an item begun costs its whole
attention: the chunk's attention is counted in items, and past the crossover the chunk is whole
items, at least one (13 tokens 2000 deep in an 8000-token prompt were two items: those steps
took ~15% longer than with one item of 10, in process). Deeper still, one item alone costs
more than the budget: the chunk's layers are then spread over ``ceil(cost / budget)`` steps (at
most ``long_prefill_layer_parts``; layered prefill, run by ``runner/captured.py``), each
step a share of them, and the chunk is the number of whole items that gives the most tokens a
step with every share within the budget (7000 deep, budget 20: 1 item over 2 steps). Alone, a
long prompt takes the whole token budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagellm.config import SchedulerConfig
from pagellm.engine.request import Request


@dataclass(frozen=True, slots=True)
class ChunkPolicy:
    long_threshold: int
    """Prompts longer than this are long (0: none is)."""
    max_partial: int
    max_long_partial: int
    decode_budget: int
    """Cost of a long prompt's chunk per step while others decode (0: no cut)."""
    crossover: float
    chunked: bool
    quantum: int = 1
    """Tokens per work item of the runner's prefill kernel (1: no rounding)."""
    max_layer_parts: int = 1
    """Most steps a chunk's layers may be spread over (1: a chunk is one step)."""
    layered_rows: int = 0
    """Most rows of a step whose chunk the runner can spread over steps (0: it cannot)."""

    @classmethod
    def from_config(
        cls,
        config: SchedulerConfig,
        crossover: float | None,
        quantum: int = 1,
        layered_rows: int = 0,
    ) -> ChunkPolicy:
        """``layered_rows``: the runner's ``layered_prefill_rows`` (captured steps' rows)."""
        threshold = config.long_prefill_token_threshold
        if threshold is None:  # vLLM's 4% of max_model_len made ordinary chat prompts long
            threshold = config.max_num_batched_tokens
        # the ranges of these settings are SchedulerConfig's own checks
        return cls(
            long_threshold=threshold,
            max_partial=config.max_num_partial_prefills,
            max_long_partial=min(config.max_long_partial_prefills, config.max_num_partial_prefills),
            decode_budget=config.long_prefill_decode_budget,
            crossover=crossover or float("inf"),
            chunked=config.enable_chunked_prefill,
            quantum=max(1, quantum),
            max_layer_parts=config.long_prefill_layer_parts if quantum > 1 and layered_rows else 1,
            layered_rows=layered_rows,
        )

    def is_long(self, req: Request) -> bool:
        return 0 < self.long_threshold < req.num_prompt_tokens

    def chunk_while_decoding(self, start_pos: int, others: int = 0) -> int:
        """Tokens from ``start_pos`` on whose cost is about ``decode_budget`` (at least 1).

        With work items of ``quantum`` tokens, attention is paid per item begun: ``n`` tokens
        cost ``n`` (their linear layers) plus ``quantum * start_pos / crossover`` for each of
        their ``ceil(n / quantum)`` items. The chunk is the most tokens that fit the budget;
        past the crossover, where attention is most of the cost, whole items (at least one:
        fewer tokens cost an item's attention all the same). ``others``: the rows of the step
        besides the chunk (a layered chunk must leave the step within ``layered_rows``)."""
        depth = start_pos / self.crossover
        if self.quantum == 1:
            return max(1, int(self.decode_budget / (1.0 + depth)))
        q = self.quantum
        best = 0
        for items in range(1, self.decode_budget // q + 2):
            tokens = min(items * q, int(self.decode_budget - items * q * depth))
            if tokens > (items - 1) * q:  # these items are all begun
                best = max(best, tokens)
        if best == 0 or depth >= 1.0:
            return q * max(best // q, self._layered_items(depth, self.layered_rows - others))
        return best

    def _layered_items(self, depth: float, room: int) -> int:
        """Whole items for a chunk that may spread its layers over steps: the most tokens per
        step with every step's share within the budget (fewer steps on a tie; 1 without
        layered steps). 7000 deep in SmolLM2 (items of 10, an item 33 tokens' cost): budget 24,
        2 items over 3 steps (6.7 tokens a step, against 1 item over 2 steps); budget 20, 1
        item over 2 steps (2 over 4 ties)."""
        per_item = self.quantum * (1.0 + depth)
        best, best_rate = 1, 0.0
        for items in range(1, min(4 * self.max_layer_parts, room // self.quantum) + 1):
            parts = math.ceil(items * per_item / self.decode_budget - 1e-9)
            if parts > self.max_layer_parts:
                break
            if items / parts > best_rate + 1e-9:
                best, best_rate = items, items / parts
        return best

    def layer_parts(self, start_pos: int, tokens: int) -> int:
        """Steps to spread a chunk of ``tokens`` from ``start_pos`` over while others decode,
        so that each step's share of its cost is about ``decode_budget`` (1: the chunk fits)."""
        if self.max_layer_parts == 1 or not self.decode_budget:
            return 1
        items = -(-tokens // self.quantum)
        cost = tokens + items * self.quantum * start_pos / self.crossover
        return max(1, min(self.max_layer_parts, math.ceil(cost / self.decode_budget - 1e-9)))


class StepChunks:
    """The partial prefills of one step being scheduled, and the chunk each request gets."""

    def __init__(self, policy: ChunkPolicy, decoding: bool, others: int = 0) -> None:
        self.policy = policy
        self.decoding = decoding
        """Whether other requests decode in this step."""
        self.others = others
        """Rows the step's other requests may take (at most)."""
        self.partial = 0
        self.long_partial = 0

    def size(self, req: Request, start_pos: int, remaining: int, num_new: int) -> int | None:
        """``req``'s chunk (``num_new`` already fits the budget), or None: not this step."""
        if remaining <= 1 or not self.policy.chunked:
            return num_new
        long = self.policy.is_long(req)
        if long and self.decoding and self.policy.decode_budget:
            num_new = min(num_new, self.policy.chunk_while_decoding(start_pos, self.others))
        if num_new >= remaining:
            return num_new
        if self.partial >= self.policy.max_partial or (
            long and self.long_partial >= self.policy.max_long_partial
        ):
            return None
        self.partial += 1
        self.long_partial += long
        return num_new

    def layer_parts(self, req: Request, start_pos: int, num_new: int) -> int:
        """Steps ``req``'s chunk of ``num_new`` tokens may take (see ``ChunkPolicy``)."""
        if not (self.decoding and self.policy.chunked and self.policy.is_long(req)):
            return 1
        return self.policy.layer_parts(start_pos, num_new)
