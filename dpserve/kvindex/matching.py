"""The longest leading run of a prompt's blocks that each replica holds: shared by both indexes."""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence


def leading_matches(
    keys: Sequence[int], replicas: Iterable[str], holders_of: Callable[[int], Container[str] | None]
) -> dict[str, int]:
    """Per replica, how many of `keys` (chained, in prompt order) it holds from the first on.

    Stops as soon as no replica holds the next block, so the cost follows the best match, not the
    prompt's length times the number of replicas."""
    depth = dict.fromkeys(replicas, 0)
    active = list(depth)
    for position, key in enumerate(keys):
        holders = holders_of(key)
        if not holders:
            break
        active = [rid for rid in active if rid in holders]
        if not active:
            break
        for rid in active:
            depth[rid] = position + 1
    return depth
