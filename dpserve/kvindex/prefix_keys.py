"""Block keys of prompts that begin alike (a shared system prompt, a conversation's earlier turns), the
shared beginning hashed once.

A prompt's keys are a chain: each block's key hashes its parent's. Computing them costs a blake2b call per
block (~2 µs: 120 µs for a 1k-token prompt of 16-token blocks), and prompts of one group share most of
them. So the keys up to every `STRIDE`-th block are remembered under Python's own hash of the ids before
that point (with the block size and adapter), and a new prompt looks up the longest remembered beginning
(a binary search over its strides: the entries of one prompt's beginnings are made together) and chains
only the blocks after it. Python's bytes hash is keyed per process: the remembered keys never leave it,
and the router keys they stand for are `index.block_keys`'s, the same in every router. Two different
beginnings with one 64-bit hash would give a prompt another's keys: a missed cache hit, nothing worse.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

from dpserve.kvindex.index import ROOT_KEY, chained_keys, id_bytes

STRIDE = 8
"""Blocks between remembered beginnings."""


class PrefixKeys:
    def __init__(self, max_entries: int = 32_768) -> None:
        """`max_entries`: remembered beginnings (each a prompt's keys up to a stride: ~1 KB per prompt)."""
        self.max_entries = max_entries
        self._known: OrderedDict[int, array[int]] = OrderedDict()
        """hash of a beginning -> the keys of the prompt it was taken from (at least as long)."""
        self.reused_blocks = 0
        self.hashed_blocks = 0

    def keys(self, token_ids: Sequence[int], block_size: int, adapter: str | None = None) -> list[int]:
        """`index.block_keys(token_ids, block_size, adapter)`."""
        data = id_bytes(token_ids)
        stride_bytes = STRIDE * block_size * 4
        strides = len(data) // stride_bytes
        low, high, found, found_at = 0, strides, None, 0
        while low < high:  # the most strides whose beginning is remembered
            middle = (low + high + 1) // 2
            at = hash((block_size, adapter, data[: middle * stride_bytes].tobytes()))
            known = self._known.get(at)
            if known is not None:
                low, found, found_at = middle, known, at
            else:
                high = middle - 1
        reused = low * STRIDE
        keys = found[:reused].tolist() if found is not None else []
        parent = keys[-1] if keys else ROOT_KEY
        keys += chained_keys(data, block_size, adapter, parent, reused)
        self.reused_blocks += reused
        self.hashed_blocks += len(keys) - reused
        if found is not None:
            self._known.move_to_end(found_at)  # a shared beginning in use stays
        if low < strides:
            self._remember(data, block_size, adapter, low + 1, strides, array("Q", keys))
        return keys

    def _remember(
        self, data: memoryview, block_size: int, adapter: str | None, first: int, last: int, keys: array[int]
    ) -> None:
        stride_bytes = STRIDE * block_size * 4
        known = self._known
        for strides in range(first, last + 1):
            known[hash((block_size, adapter, data[: strides * stride_bytes].tobytes()))] = keys
        while len(known) > self.max_entries:
            known.popitem(last=False)

    def __len__(self) -> int:
        return len(self._known)
