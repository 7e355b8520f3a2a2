"""A picture of one engine's state for the console, taken on the engine's own thread between
steps (``AsyncLLMEngine.snapshot``): every KV block's state and owner, the queues with each
request's progress, and the counters the rates are computed from. Plain Python; O(blocks +
requests), bounded lists.
"""

from __future__ import annotations

from typing import Any

from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.request import Request

MAX_LISTED = 200
"""Requests listed per queue (the counts are always exact)."""

FREE, CACHED_FREE, IN_USE, SHARED = "0", "1", "2", "3"
"""A block's state, one character each: free, free but holding reusable prefix KV, in use by
one request, shared by several (prefix-cache hits, the n copies of a request)."""


def engine_snapshot(engine: LLMEngine) -> dict[str, Any]:
    sched, kv = engine.scheduler, engine.kv_manager
    listed = {
        "running": sched.running[:MAX_LISTED],
        "waiting": sched.waiting[:MAX_LISTED],
        "swapped": sched.swapped[:MAX_LISTED],
    }
    owners = _owners(kv.block_tables, [r.request_id for r in sched.running])
    states = "".join(_state(b.ref_cnt, b.block_hash is not None) for b in kv.pool.blocks)
    s = engine.stats
    return {
        "kind": "server",
        "blocks": {
            "num": kv.pool.num_blocks,
            "block_size": kv.block_size,
            "states": states,
            "owners": owners,
            "in_use": kv.pool.num_used,
            "cached_free": kv.pool.num_cached_free,
        },
        "queues": {name: len(getattr(sched, name)) for name in listed},
        "requests": {name: [_progress(r) for r in reqs] for name, reqs in listed.items()},
        "counters": {
            "prompt_tokens": s.prompt_tokens,
            "generation_tokens": s.generation_tokens,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "num_preemptions": s.num_preemptions,
            "steps": s.num_steps,
        },
        "kv_usage": kv.usage(),
    }


def _state(ref_cnt: int, hashed: bool) -> str:
    if ref_cnt == 0:
        return CACHED_FREE if hashed else FREE
    return SHARED if ref_cnt > 1 else IN_USE


def _owners(tables: dict[str, list[int]], running: list[str]) -> dict[str, int]:
    """Block id -> index of the first running request holding it (the color of its owner)."""
    owners: dict[str, int] = {}
    for index, request_id in enumerate(running):
        for block in tables.get(request_id, ()):
            owners.setdefault(str(block), index)
    return owners


def _progress(req: Request) -> dict[str, Any]:
    return {
        "id": req.request_id,
        "status": req.status.value,
        "prompt_tokens": req.num_prompt_tokens,
        "computed_tokens": req.num_computed_tokens,
        "output_tokens": req.num_output_tokens,
        "max_tokens": req.params.max_tokens,
        "preemptions": req.num_preemptions,
    }
