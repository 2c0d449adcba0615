"""The longest leading run of a prompt's blocks that each replica holds: shared by both indexes."""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterable, Sequence
from itertools import islice


def leading_matches(
    keys: Sequence[int], replicas: Iterable[str], holders_of: Callable[[int], Container[str] | None]
) -> dict[str, int]:
    """Per replica, how many of `keys` (chained, in prompt order) it holds from the first on.

    Stops as soon as no replica holds the next block, so the cost follows the best match, not the
    prompt's length times the number of replicas."""
    depth = dict.fromkeys(replicas, 0)
    active = list(depth)
    if not active:
        return depth
    position = 0
    for position, key in enumerate(keys):
        holders = holders_of(key)
        if not holders:
            break
        for rid in active:
            if rid not in holders:
                break
        else:
            continue  # every replica still in the race holds this block too: the common case, no new list
        for rid in active:
            if rid not in holders:
                depth[rid] = position
        active = [rid for rid in active if rid in holders]
        if not active:
            break
    else:
        position = len(keys)
    for rid in active:
        depth[rid] = position
    return depth


def deepest_holders(keys: Sequence[int], holders_of: Callable[[int], Collection[str] | None], limit: int) -> list[str]:
    """Up to `limit` replicas holding the deepest of `keys` that any replica holds: the likeliest best
    matches, found in O(log len(keys)) lookups. A binary search is fair here: a replica holding a block
    nearly always holds the blocks before it (engines evict from the tail of a prefix)."""
    if not keys or not holders_of(keys[0]):
        return []
    low, high = 0, len(keys) - 1
    while low < high:
        middle = (low + high + 1) // 2
        if holders_of(keys[middle]):
            low = middle
        else:
            high = middle - 1
    return list(islice(holders_of(keys[low]) or (), limit))
