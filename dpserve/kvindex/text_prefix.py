"""The approximate prefix index: what text the router itself sent where, for engines without KV events.

Prompts are cut into fixed-size character chunks with chained keys (a chunk's key covers everything
before it), so a lookup finds the longest leading run of chunks each replica was sent. The router never
hears of the replicas' evictions here, so the index is an LRU with a fixed number of chunks: old
prefixes fade out instead of growing without limit (the unbounded trie is a known peer failure).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from dpserve.kvindex.matching import deepest_holders, leading_matches

CHUNK_CHARS = 64
CHARS_PER_TOKEN = 4
"""A common rough ratio for English text, used only to report predicted cached tokens."""


def text_keys(text: str, chunk_chars: int = CHUNK_CHARS) -> list[int]:
    """Chained keys of the text's full chunks."""
    data = text.encode("utf-8", "surrogatepass")
    keys: list[int] = []
    parent = b"\0" * 8
    for start in range(0, len(data) - chunk_chars + 1, chunk_chars):
        parent = hashlib.blake2b(parent + data[start : start + chunk_chars], digest_size=8).digest()
        keys.append(int.from_bytes(parent, "big"))
    return keys


class TextPrefixIndex:
    def __init__(self, max_chunks: int = 500_000) -> None:
        if max_chunks < 1:
            raise ValueError("max_chunks must be at least 1")
        self.max_chunks = max_chunks
        self.evicted = 0
        self._chunks: OrderedDict[int, set[str]] = OrderedDict()

    def record(self, keys: Sequence[int], replica: str) -> None:
        """The router sent a prompt with these chunk keys to `replica`."""
        chunks = self._chunks
        for key in keys:
            holders = chunks.get(key)
            if holders is None:
                chunks[key] = {replica}
            else:
                holders.add(replica)
                chunks.move_to_end(key)
        while len(chunks) > self.max_chunks:
            chunks.popitem(last=False)
            self.evicted += 1

    def match(self, keys: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        return leading_matches(keys, replicas, self._chunks.get)

    def likely_best(self, keys: Sequence[int], limit: int) -> list[str]:
        """Up to `limit` replicas likely to hold the longest run of `keys` (see `deepest_holders`)."""
        return deepest_holders(keys, self._chunks.get, limit)

    def __len__(self) -> int:
        return len(self._chunks)
