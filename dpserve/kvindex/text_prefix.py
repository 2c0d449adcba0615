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
"""A common rough ratio for English text: tokens per chunk until the answers have taught the model's own."""


class ChunkTokens:
    """Tokens per text chunk, per model, learned from answers: each answer's prompt tokens against the
    prompt's chunks. Used only to report what a text match predicts in tokens (receipts, their classes'
    slack of one chunk); the text policy's choices do not read it. A tokenizer far from 4 characters a
    token (the tiny model's, code, most non-English text) otherwise halves or doubles every prediction."""

    def __init__(self, half_life: int = 256) -> None:
        self._keep = 0.5 ** (1.0 / half_life)
        self._sums: dict[str, tuple[float, float]] = {}
        """model -> (chunks, tokens), exponentially weighted."""

    def learn(self, model: str, full_chunks: int, prompt_tokens: int) -> None:
        """An answer's prompt tokens for a prompt of `full_chunks` whole chunks (and a partial one: half a
        chunk on average)."""
        if prompt_tokens <= 0:
            return
        chunks, tokens = self._sums.get(model, (0.0, 0.0))
        keep = self._keep
        self._sums[model] = (chunks * keep + full_chunks + 0.5, tokens * keep + prompt_tokens)

    def per_chunk(self, model: str) -> int:
        sums = self._sums.get(model)
        if sums is None:
            return CHUNK_CHARS // CHARS_PER_TOKEN
        chunks, tokens = sums
        return max(1, round(tokens / chunks))


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
