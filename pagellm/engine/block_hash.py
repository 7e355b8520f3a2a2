"""Content hashes of full KV blocks, chained so that a hash names a block's whole prefix.

``hash(block i) = sha256(hash(block i-1) || its token ids)``, starting from a root that carries
the request's extra keys (content that differs for the same tokens, such as a future adapter id).
Two requests share a block's hash only if they share every token up to the end of that block and
their extra keys. SHA-256 (not Python's ``hash``) so a collision, which would hand one request
another's KV, is not a practical concern.
"""

from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes

_ROOT = hashlib.sha256(b"pagellm-prefix-root").digest()


def root_hash(extra_keys: tuple = ()) -> BlockHash:
    if not extra_keys:
        return _ROOT
    return hashlib.sha256(_ROOT + repr(extra_keys).encode()).digest()


def hash_block(parent: BlockHash, token_ids: list[int]) -> BlockHash:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: list[int],
    block_size: int,
    num_blocks: int,
    extra_keys: tuple = (),
) -> list[BlockHash]:
    """Grow ``hashes`` (in place) to the first ``num_blocks`` full blocks of ``token_ids``."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    parent = hashes[-1] if hashes else root_hash(extra_keys)
    for i in range(len(hashes), num_blocks):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
