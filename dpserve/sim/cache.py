"""The simulator's KV cache: fixed capacity in blocks, prefix caching of full prompt blocks, LRU eviction.

It follows vLLM v1's block manager where the router can see it:
- a block is cached under a hash chained from its parent block's hash and its own token ids;
- a request's cache hit is its longest run of cached leading full blocks, less the block holding its
  last prompt token (vLLM always recomputes at least one token);
- blocks in use are referenced; unreferenced cached blocks stay (and can be hit) until a new block is
  needed and no never-used block is left, then the least recently freed one is evicted;
- a finished request's blocks are freed last-block-first, so a shared prefix outlives its tails;
- every change to the cached set is an event: BlockStored (with token ids and parent), BlockRemoved,
  AllBlocksCleared.

One simplification: a request's decode blocks are reserved when it is admitted (prompt + max tokens),
so the simulator never preempts; generated tokens are not cached.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from dpserve.kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

HASH_SEED = b"dpserve-sim"


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """A 64-bit chained block hash, stable across processes (vLLM's own is sha256-based too)."""
    digest = hashlib.sha256()
    digest.update(HASH_SEED if parent is None else parent.to_bytes(8, "big"))
    digest.update(b"".join(token.to_bytes(4, "big") for token in token_ids))
    return int.from_bytes(digest.digest()[:8], "big")


def full_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class Allocation:
    """The blocks one admitted request holds until it finishes."""

    cached_hashes: list[int]
    """Its full prompt blocks, each referenced once by this request, in prompt order."""
    private_blocks: int
    """Blocks of its own: the partial last prompt block and its reserved decode blocks."""
    hit_tokens: int


class NoRoom(Exception):
    """Not enough free blocks right now; the request waits."""


class TooLarge(ValueError):
    """The request needs more blocks than the whole cache has: it can never run."""


class PrefixCache:
    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        if capacity_blocks < 1 or block_size < 1:
            raise ValueError("capacity and block size must be positive")
        self.capacity = capacity_blocks
        self.block_size = block_size
        self._refs: dict[int, int] = {}
        """Every cached block's hash and how many running requests hold it."""
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Cached blocks no request references, least recently freed first."""
        self._private_in_use = 0
        self._events: list[KvEvent] = []

    # What the metrics read.
    @property
    def blocks_in_use(self) -> int:
        return len(self._refs) - len(self._evictable) + self._private_in_use

    @property
    def usage(self) -> float:
        """vLLM's `kv_cache_usage_perc`: referenced blocks over capacity (cached-but-free blocks are free)."""
        return self.blocks_in_use / self.capacity

    @property
    def cached_blocks(self) -> int:
        return len(self._refs)

    def contains(self, block_hash_value: int) -> bool:
        return block_hash_value in self._refs

    def cached_hashes(self) -> set[int]:
        return set(self._refs)

    def take_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check_fits(self, num_tokens: int) -> int:
        """The blocks `num_tokens` need; TooLarge when that is more than the whole cache."""
        total = self.blocks_needed(num_tokens)
        if total > self.capacity:
            raise TooLarge(
                f"it needs {total} KV-cache blocks of {self.block_size} tokens; the cache holds {self.capacity}"
            )
        return total

    def hit_blocks(self, hashes: Sequence[int], num_prompt_tokens: int) -> int:
        # The block holding the last prompt token is always computed, as in vLLM.
        limit = min(len(hashes), (num_prompt_tokens - 1) // self.block_size)
        count = 0
        while count < limit and hashes[count] in self._refs:
            count += 1
        return count

    def allocate(self, prompt: Sequence[int], max_new_tokens: int) -> Allocation:
        """Reserve blocks for a request, or raise NoRoom (wait) / TooLarge (never fits)."""
        total = self.check_fits(len(prompt) + max_new_tokens)
        hashes = full_block_hashes(prompt, self.block_size)
        hits = self.hit_blocks(hashes, len(prompt))
        present = [h in self._refs for h in hashes]
        revived = sum(1 for h, is_present in zip(hashes, present, strict=True) if is_present and h in self._evictable)
        needed = total - sum(present)
        if needed > self.capacity - self.blocks_in_use - revived:
            raise NoRoom
        # Reference what is cached first, so making room for the new blocks cannot evict them.
        for h, is_present in zip(hashes, present, strict=True):
            if is_present:
                if self._refs[h] == 0:
                    del self._evictable[h]
                self._refs[h] += 1
        allocation = Allocation(list(hashes), total - len(hashes), hits * self.block_size)
        run_start: int | None = None
        for index, is_present in enumerate(present):
            if is_present:
                self._flush_run(run_start, index, hashes, prompt)
                run_start = None
                continue
            self._make_room(1)
            self._refs[hashes[index]] = 1
            run_start = index if run_start is None else run_start
        self._flush_run(run_start, len(hashes), hashes, prompt)
        self._make_room(allocation.private_blocks)
        self._private_in_use += allocation.private_blocks
        return allocation

    def free(self, allocation: Allocation) -> None:
        self._private_in_use -= allocation.private_blocks
        # Last block first: the shared front of a prompt is evicted last.
        for h in reversed(allocation.cached_hashes):
            self._refs[h] -= 1
            if self._refs[h] == 0:
                self._evictable[h] = None
        allocation.cached_hashes = []
        allocation.private_blocks = 0

    def reset(self) -> bool:
        """Drop every unreferenced cached block, as vLLM's /reset_prefix_cache; False while any is in use."""
        if self.blocks_in_use:
            return False
        self._refs.clear()
        self._evictable.clear()
        self._events.append(AllBlocksCleared())
        return True

    def _make_room(self, count: int) -> None:
        """Evict least recently freed cached blocks until `count` more blocks fit."""
        overflow = len(self._refs) + self._private_in_use + count - self.capacity
        evicted: list[int] = []
        while overflow > 0:
            h, _ = self._evictable.popitem(last=False)
            del self._refs[h]
            evicted.append(h)
            overflow -= 1
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))

    def _flush_run(self, start: int | None, end: int, hashes: Sequence[int], prompt: Sequence[int]) -> None:
        """One BlockStored per run of consecutive new blocks, with its parent, as vLLM publishes them."""
        if start is None:
            return
        bs = self.block_size
        self._events.append(
            BlockStored(
                block_hashes=tuple(hashes[start:end]),
                parent_block_hash=hashes[start - 1] if start else None,
                token_ids=tuple(prompt[start * bs : end * bs]),
                block_size=bs,
            )
        )
