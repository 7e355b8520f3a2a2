"""Per-request block tables over the block pool, with automatic prefix caching.

A request owns ``ceil(tokens_in_cache / block_size)`` blocks: a new block is taken only when the
last one is full, and all of a request's blocks are released the moment it finishes, is aborted
or preempted. Copies of one prompt (``n > 1``) share its full blocks through reference counts.

With prefix caching, every block that becomes full is registered under the chained hash of its
tokens (``block_hash``). A request admitted with nothing computed first looks up the longest run
of its full blocks already cached and starts from there; at least one token is always left to
compute, so the request has logits to sample from. Released blocks keep their content until the
pool evicts them (least recently freed first).
"""

from __future__ import annotations

from pagellm.engine.block_hash import BlockHash, extend_block_hashes
from pagellm.engine.block_pool import BlockPool
from pagellm.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = False,
        num_host_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks > 0 else None
        """Host blocks that swapped-out requests' KV is copied to."""
        self.block_tables: dict[str, list[int]] = {}
        self.host_tables: dict[str, list[int]] = {}
        """Swapped-out request id -> its host blocks, in block-table order."""
        self._num_cached: dict[str, int] = {}
        """Request id -> how many of its leading blocks are registered in the prefix cache."""
        self._hashes: dict[str, list[BlockHash]] = {}
        """Request id -> hashes of its full blocks so far (kept across preemption)."""

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

    # ----- prefix cache -----------------------------------------------------------------

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.request_id, [])
        return extend_block_hashes(
            hashes, request.all_token_ids, self.block_size, num_blocks, request.cache_extra_keys
        )

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached run of ``request``'s leading full blocks, never
        covering its last token. Takes nothing: pass them to ``allocate_slots``."""
        if not self.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in self.block_hashes(request, max_blocks):
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks whose KV is now complete."""
        if not self.enable_caching:
            return
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_cached.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request, num_full)
        for i in range(start, num_full):
            self.pool.cache_block(table[i], hashes[i])
        self._num_cached[request.request_id] = num_full

    # ----- allocation -------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` more KV entries after the computed ones (and after
        ``cached_blocks``, reused from the prefix cache for a request that has no blocks yet).
        False, with nothing taken, if the pool cannot hold them."""
        cached_blocks = cached_blocks or []
        table = self.block_tables.setdefault(request.request_id, [])
        assert not (cached_blocks and table), "cached blocks start an empty table"
        have = request.num_computed_tokens + len(cached_blocks) * self.block_size
        needed = cdiv(have + num_new_tokens, self.block_size) - len(table) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_cnt == 0)
        if max(needed, 0) + revived > self.pool.num_free:
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            table.extend(cached_blocks)
            self._num_cached[request.request_id] = len(cached_blocks)
        if needed > 0:
            table.extend(self.pool.allocate(needed))
        return True

    def trim(self, request: Request) -> None:
        """Release the blocks past the request's computed tokens: the slots of proposed tokens
        that were rejected (never registered in the prefix cache, never shared)."""
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if len(table) > keep:
            extra = table[keep:]
            del table[keep:]
            self.pool.release(extra[::-1])

    def share_prefix(self, child: Request, parent: Request, num_tokens: int) -> int:
        """Give ``child`` the parent's full blocks covering up to ``num_tokens`` tokens.

        Returns how many tokens' KV the child now has (a whole number of blocks).
        """
        assert child.request_id not in self.block_tables or not self.block_tables[child.request_id]
        num_full = min(num_tokens, parent.num_computed_tokens) // self.block_size
        shared = self.block_tables.get(parent.request_id, [])[:num_full]
        self.pool.share(shared)
        self.block_tables[child.request_id] = list(shared)
        self._num_cached[child.request_id] = min(
            num_full, self._num_cached.get(parent.request_id, 0)
        )
        return len(shared) * self.block_size

    def free(self, request: Request) -> None:
        """Release the request's blocks (preempted or done); cached content stays reusable."""
        table = self.block_tables.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        if table:
            # Release in reverse so a request's tail blocks are evicted first.
            self.pool.release(table[::-1])
        host = self.host_tables.pop(request.request_id, None)
        if host:
            self.host_pool.release(host)

    # ----- swapping ---------------------------------------------------------------------

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's KV to host blocks: returns the (device, host) copies to make, or
        None (nothing changed) when there is no host pool or it lacks room."""
        table = self.block_tables.get(request.request_id, [])
        if self.host_pool is None or len(table) > self.host_pool.num_free:
            return None
        host = self.host_pool.allocate(len(table))
        mapping = list(zip(table, host, strict=True))
        self.free(request)  # device blocks go back (their cached content stays reusable)
        self.host_tables[request.request_id] = host
        return mapping

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the request's blocks and room for ``num_new_tokens`` more fit the device."""
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        host = self.host_tables.get(request.request_id, [])
        return max(total, len(host)) <= self.pool.num_free

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped-out request's KV back: returns the (host, device) copies to make."""
        host = self.host_tables.pop(request.request_id)
        device = self.pool.allocate(len(host))
        self.block_tables[request.request_id] = device
        self.host_pool.release(host)  # the copy happens before any later allocation writes it
        return list(zip(host, device, strict=True))

    def forget(self, request: Request) -> None:
        """Drop what is kept across preemption once the request is gone for good."""
        self._hashes.pop(request.request_id, None)

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
