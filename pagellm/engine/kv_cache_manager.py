"""Per-request block tables over the block pool.

A request owns ``ceil(tokens_in_cache / block_size)`` blocks: a new block is taken only when the
last one is full, and all of a request's blocks are released the moment it finishes, is aborted
or preempted. Copies of one prompt (``n > 1``) share its full blocks through reference counts.
"""

from __future__ import annotations

from pagellm.engine.block_pool import BlockPool
from pagellm.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` could ever fit the whole cache."""
        return cdiv(num_tokens, self.block_size) <= self.pool.num_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more KV entries; False (nothing taken) if full."""
        table = self.block_tables.setdefault(request.request_id, [])
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free:
            return False
        table.extend(self.pool.allocate(needed))
        return True

    def share_prefix(self, child: Request, parent: Request, num_tokens: int) -> int:
        """Give ``child`` the parent's full blocks covering up to ``num_tokens`` tokens.

        Returns how many tokens' KV the child now has (a whole number of blocks).
        """
        assert child.request_id not in self.block_tables or not self.block_tables[child.request_id]
        num_full = min(num_tokens, parent.num_computed_tokens) // self.block_size
        shared = self.block_tables.get(parent.request_id, [])[:num_full]
        self.pool.share(shared)
        self.block_tables[child.request_id] = list(shared)
        return len(shared) * self.block_size

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request.request_id, None)
        if table:
            # Release in reverse so a request's tail blocks are reused last-in-first-out.
            self.pool.release(table[::-1])

    def unfilled_slots(self, requests: list[Request]) -> int:
        """Allocated-but-unfilled KV slots; only a request's last block can be partly filled."""
        unfilled = 0
        for req in requests:
            table = self.block_tables.get(req.request_id)
            if table:
                unfilled += len(table) * self.block_size - req.num_computed_tokens
        return unfilled

    def allocated_slots(self) -> int:
        return self.pool.num_used * self.block_size
