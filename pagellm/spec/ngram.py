"""Prompt-lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of
the sequence's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that
occurs earlier in its prompt + output.

Each request keeps an index n-gram -> latest end position, extended by the tokens appended since
the last proposal, so a step costs O(new tokens x n sizes) dictionary work, not a scan of the
whole context. Plain Python, run by the scheduler.
"""

from __future__ import annotations


class NgramIndex:
    """Latest end position of every n-gram (lo <= n <= hi) that ends before the last token."""

    def __init__(self, lo: int, hi: int) -> None:
        self.sizes = list(range(hi, lo - 1, -1))
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed_to = 0
        """Grams ending at positions (exclusive ends) 1..indexed_to are in ``ends``."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens following the latest earlier match of the longest suffix."""
        length = len(tokens)
        self._extend(tokens, length - 1)
        for n in self.sizes:
            if length <= n:
                continue
            end = self.ends[n].get(tuple(tokens[length - n :]))
            if end is not None:
                return tokens[end : end + k]
        return []

    def _extend(self, tokens: list[int], last_end: int) -> None:
        for end in range(self.indexed_to + 1, last_end + 1):
            for n in self.sizes:
                if end >= n:
                    self.ends[n][tuple(tokens[end - n : end])] = end
        self.indexed_to = max(self.indexed_to, last_end)


class NgramProposer:
    """One ``NgramIndex`` per request, dropped when the request ends."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = NgramIndex(self.lo, self.hi)
        return index.propose(tokens, k)

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
