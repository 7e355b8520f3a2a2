"""The pool of KV blocks: reference counts, the free queue, and the prefix cache.

A block with ``ref_cnt == 0`` is free. A free block may still hold the KV of a full block that
some request computed (it keeps its ``block_hash`` and stays in ``cached``): a later request with
the same prefix takes it back (``touch``) instead of recomputing. Allocation takes the free
block at the head of the queue and evicts its hash then, so cached blocks are evicted least
recently freed first, and only when the pool needs the space.

Invariants (checked by ``check_integrity`` and by the property tests):
- a block is in the free queue iff its ref_cnt is 0;
- num_free + num_used == num_blocks;
- ref_cnt never goes below 0;
- ``cached[h]`` is a block whose ``block_hash`` is ``h``, and every hashed block is cached.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagellm.engine.block_hash import BlockHash


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Fixed set of ``num_blocks`` blocks handed out with reference counts."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        """Free block ids, least recently freed first."""
        self.cached: dict[BlockHash, int] = {}
        """Hash of a full block's content (with its prefix) -> the block holding that KV."""
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold reusable KV."""
        return sum(1 for b in self._free if self.blocks[b].block_hash is not None)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks (ref_cnt 1 each), evicting their cached content."""
        if count > len(self._free):
            raise MemoryError(f"asked for {count} KV blocks, {len(self._free)} free")
        ids = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def share(self, block_ids: list[int]) -> None:
        """Add one owner to each block (copies of a request sharing its prompt)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, "cannot share a free block"
            block.ref_cnt += 1

    def touch(self, block_ids: list[int]) -> None:
        """Add one owner to each cached block, taking free ones out of the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.block_hash is not None, "only cached blocks are reused"
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one owner from each block; blocks nobody owns go to the tail of the free queue
        (cached ones keep their content until allocation evicts it)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise AssertionError(f"block {block_id} released more often than owned")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Record that ``block_id`` (owned, full) holds the KV named by ``block_hash``.

        When another block already holds that content (two requests computed the same prefix at
        once) the first stays the cached one and this block remains an ordinary block.
        """
        block = self.blocks[block_id]
        assert block.ref_cnt > 0, "only owned blocks are filled"
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block_id

    def reset_cache(self) -> int:
        """Forget every free cached block's content (owned blocks keep theirs); returns how many."""
        dropped = 0
        for block_id in self._free:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
                dropped += 1
        return dropped

    def check_integrity(self) -> None:
        assert len(self._free) + sum(1 for b in self.blocks if b.ref_cnt > 0) == self.num_blocks
        for block in self.blocks:
            assert block.ref_cnt >= 0
            assert (block.ref_cnt == 0) == (block.block_id in self._free)
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) == block.block_id
        assert all(self.blocks[b].block_hash == h for h, b in self.cached.items())
