"""Where each rank sits and what it holds: ranks are numbered stage-major (rank = stage * tp +
tp_rank), so rank 0 is the first TP rank of the first pipeline stage and runs the scheduler.
This module is plain arithmetic (no torch): head, column and vocab ranges per TP rank, and the
layer range per pipeline stage."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Span:
    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


@dataclass(frozen=True, slots=True)
class RankLayout:
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError("tensor and pipeline parallel sizes must be at least 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp_size - 1

    def stage_ranks(self, stage: int) -> list[int]:
        return [stage * self.tp_size + t for t in range(self.tp_size)]

    def peer_in_stage(self, stage: int) -> int:
        """The rank with this rank's TP position in another stage (activations go there)."""
        return stage * self.tp_size + self.tp_rank

    # ----- tensor parallel shards -----------------------------------------------------------

    def split(self, n: int, what: str) -> Span:
        """An even share of ``n`` columns (heads, MLP columns) for this TP rank."""
        if n % self.tp_size:
            raise ValueError(
                f"{what} ({n}) is not divisible by tensor_parallel_size {self.tp_size}"
            )
        share = n // self.tp_size
        return Span(self.tp_rank * share, share)

    def kv_heads(self, num_kv_heads: int) -> Span:
        """This rank's KV heads. With fewer KV heads than ranks each head is replicated on
        ``tp_size / num_kv_heads`` consecutive ranks (as vLLM does)."""
        if num_kv_heads >= self.tp_size:
            return self.split(num_kv_heads, "the number of KV heads")
        if self.tp_size % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size {self.tp_size} is not a multiple of the "
                f"{num_kv_heads} KV heads"
            )
        return Span(self.tp_rank * num_kv_heads // self.tp_size, 1)

    def vocab(self, vocab_size: int) -> Span:
        """This rank's rows of the (padded) vocabulary: ceil(vocab / tp) each; the last rank's
        share may run past the real vocabulary (those rows are padding)."""
        share = -(-vocab_size // self.tp_size)
        return Span(self.tp_rank * share, share)

    # ----- pipeline stages --------------------------------------------------------------------

    def layers(self, num_layers: int) -> Span:
        """This stage's decoder layers: as even as possible, earlier stages taking the extra."""
        if num_layers < self.pp_size:
            raise ValueError(
                f"{num_layers} layers cannot be split into {self.pp_size} pipeline stages"
            )
        base, extra = divmod(num_layers, self.pp_size)
        start = self.stage * base + min(self.stage, extra)
        return Span(start, base + (1 if self.stage < extra else 0))
