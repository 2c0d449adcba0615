"""A model of what replicas' KV caches hold, for estimates the live index cannot give: what a shadow policy
would have hit (`router/quality/shadows.py`), what other weights would have (`dpserve tune`). Per replica, an LRU of
block keys; vLLM's rules for a hit (leading full blocks, not the one holding the prompt's last token)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class ModelledCaches:
    """What each replica would hold: an LRU of block keys per replica."""

    def __init__(self) -> None:
        self._caches: dict[str, OrderedDict[int, None]] = {}

    def leading(self, replica: str, keys: Sequence[int]) -> int:
        """How many of `keys`, from the first, the replica holds."""
        cache = self._caches.get(replica)
        if not cache:
            return 0
        count = 0
        for key in keys:
            if key not in cache:
                break
            count += 1
        return count

    def blocks(self, replica: str) -> int:
        cache = self._caches.get(replica)
        return len(cache) if cache else 0

    def add(self, replica: str, keys: Sequence[int], capacity: int) -> None:
        """The prompt's blocks are computed (or hit) there: most recently used now, the last block first, as
        vLLM frees them (so a shared front outlives the tails it was shared by). `capacity` 0: unbounded."""
        cache = self._caches.setdefault(replica, OrderedDict())
        for key in reversed(keys):
            if key in cache:
                cache.move_to_end(key)
            else:
                cache[key] = None
        if capacity > 0:
            while len(cache) > capacity:
                cache.popitem(last=False)


def cacheable_blocks(total_blocks: int, prompt_tokens: int, block_tokens: int) -> int:
    """Blocks vLLM can hit of a prompt: all full blocks but the one holding its last token."""
    if prompt_tokens and block_tokens:
        return min(total_blocks, (prompt_tokens - 1) // block_tokens)
    return total_blocks
