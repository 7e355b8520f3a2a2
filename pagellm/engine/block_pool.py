"""The pool of KV blocks: reference counts and the free queue.

Invariants (checked by ``check_integrity`` and by the property tests):
- a block is in the free queue iff its ref_cnt is 0;
- num_free + num_used == num_blocks;
- ref_cnt never goes below 0.
Freed blocks go to the tail of the queue and allocation takes from the head, so the queue is in
least-recently-freed order: the seam where prefix caching will keep hashed blocks for reuse.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    """Fixed set of ``num_blocks`` blocks handed out with reference counts."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks (ref_cnt 1 each); raises if fewer are free."""
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(count)]
        for block_id in ids:
            self.blocks[block_id].ref_cnt = 1
        return ids

    def share(self, block_ids: list[int]) -> None:
        """Add one owner to each block (copies of a request sharing its prompt)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, "cannot share a free block"
            block.ref_cnt += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one owner from each block; blocks nobody owns go back to the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise AssertionError(f"block {block_id} released more often than owned")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free.append(block_id)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is queued twice"
        for block in self.blocks:
            assert block.ref_cnt >= 0
            assert (block.ref_cnt == 0) == (block.block_id in free)
