"""The simulator's prefix cache: hits, capacity, LRU eviction, and events that match its contents."""

from __future__ import annotations

import random

import pytest

from dpserve.sim.cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    NoRoom,
    PrefixCache,
    TooLarge,
    full_block_hashes,
)

BS = 4


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


class Mirror:
    """What a subscriber rebuilds from the events alone."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def apply(self, events: list[KvEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                for index, h in enumerate(event.block_hashes):
                    assert h not in self.blocks, "a block is stored twice without a removal in between"
                    chunk = event.token_ids[index * event.block_size : (index + 1) * event.block_size]
                    self.blocks[h] = (parent, tuple(chunk))
                    parent = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    del self.blocks[h]
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()


def test_repeated_prefix_is_a_hit_except_the_last_block() -> None:
    cache = PrefixCache(capacity_blocks=16, block_size=BS)
    prompt = tokens(0, 12)  # three full blocks
    first = cache.allocate(prompt, max_new_tokens=1)
    assert first.hit_tokens == 0
    cache.free(first)
    again = cache.allocate(prompt, max_new_tokens=1)
    # The block holding the last prompt token is recomputed, as in vLLM.
    assert again.hit_tokens == 8
    longer = cache.allocate(prompt + tokens(100, 6), max_new_tokens=1)
    assert longer.hit_tokens == 12


def test_shared_prefix_hits_up_to_the_divergence() -> None:
    cache = PrefixCache(capacity_blocks=32, block_size=BS)
    system = tokens(0, 8)
    cache.free(cache.allocate(system + tokens(50, 5), 1))
    other = cache.allocate(system + tokens(70, 5), 1)
    assert other.hit_tokens == 8


def test_stored_events_carry_tokens_and_parents() -> None:
    cache = PrefixCache(capacity_blocks=16, block_size=BS)
    prompt = tokens(0, 10)
    cache.allocate(prompt, 1)
    [event] = cache.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == tuple(full_block_hashes(prompt, BS))
    assert event.parent_block_hash is None
    assert event.token_ids == tuple(prompt[:8])
    # A continuation's new blocks name the last cached block as their parent.
    cache.allocate(prompt[:8] + tokens(200, 5), 1)
    [event] = cache.take_events()
    assert isinstance(event, BlockStored)
    assert event.parent_block_hash == full_block_hashes(prompt, BS)[-1]
    assert event.token_ids == tuple(tokens(200, 4))


def test_capacity_is_never_exceeded_and_eviction_is_lru() -> None:
    cache = PrefixCache(capacity_blocks=6, block_size=BS)
    a, b, c = tokens(0, 8), tokens(100, 8), tokens(200, 8)
    for prompt in (a, b):
        cache.free(cache.allocate([*prompt, 999], 0))  # 2 cached blocks + 1 private each
    assert cache.take_events() and cache.cached_blocks == 4
    # Touch `a` again so that `b` is now the least recently freed.
    cache.free(cache.allocate([*a, 998], 0))
    cache.take_events()
    cache.allocate([*c, 997], 3)  # 2 cached + 1 private: one more block than the 2 never used
    events = cache.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    b_hashes = full_block_hashes(b, BS)
    assert removed and set(removed) <= set(b_hashes)
    assert all(cache.contains(h) for h in full_block_hashes(a, BS))
    assert cache.cached_blocks + 1 <= cache.capacity


def test_referenced_blocks_are_never_evicted_and_a_full_cache_makes_requests_wait() -> None:
    cache = PrefixCache(capacity_blocks=4, block_size=BS)
    held = cache.allocate(tokens(0, 8), 7)  # 15 tokens -> 4 blocks: the whole cache
    assert cache.usage == 1.0
    with pytest.raises(NoRoom):
        cache.allocate(tokens(100, 4), 1)
    cache.free(held)
    assert cache.usage == 0.0
    cache.allocate(tokens(100, 4), 1)


def test_a_request_larger_than_the_cache_is_refused() -> None:
    cache = PrefixCache(capacity_blocks=4, block_size=BS)
    with pytest.raises(TooLarge):
        cache.allocate(tokens(0, 16), 1)


def test_reset_clears_only_when_idle() -> None:
    cache = PrefixCache(capacity_blocks=8, block_size=BS)
    allocation = cache.allocate(tokens(0, 9), 1)
    assert not cache.reset()
    cache.free(allocation)
    cache.take_events()
    assert cache.reset()
    assert cache.take_events() == [AllBlocksCleared()]
    assert cache.cached_blocks == 0


def test_events_replayed_by_a_subscriber_match_the_cache_under_random_load() -> None:
    rng = random.Random(7)
    cache = PrefixCache(capacity_blocks=40, block_size=BS)
    mirror = Mirror()
    prefixes = [tokens(1000 * i, 12) for i in range(6)]
    live = []
    for _ in range(500):
        if live and (rng.random() < 0.5 or len(live) > 5):
            cache.free(live.pop(rng.randrange(len(live))))
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(5000) for _ in range(rng.randrange(1, 9))]
            try:
                live.append(cache.allocate(prompt, rng.randrange(1, 6)))
            except NoRoom:
                pass
        mirror.apply(cache.take_events())
        assert set(mirror.blocks) == cache.cached_hashes()
        assert cache.blocks_in_use <= cache.capacity
        assert cache.cached_blocks <= cache.capacity
