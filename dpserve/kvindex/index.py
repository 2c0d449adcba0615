"""Which replica holds which KV blocks, from the replicas' own KV-cache events.

Blocks are keyed by the router's own chained hash of their token ids (parent key + tokens), never by
the engine's hash: vLLM's hash depends on its version and PYTHONHASHSEED, so the router could not
compute it for a new request. Each replica's map from engine hash to router key lets `BlockRemoved`
(which names engine hashes only) find its block. The index is bounded: past `max_entries` it forgets
the oldest stored blocks of the replica holding the most.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from dpserve.kvindex.events import (
    ROUTABLE_MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    KvEvent,
)
from dpserve.kvindex.matching import deepest_holders, leading_matches

ROOT_KEY = 0


def chain_key(parent: int, token_ids: Sequence[int], extra: object = None) -> int:
    """The router's key of one block: 64 bits of blake2b over the parent's key, the tokens (4 bytes each) and
    the repr of any extras."""
    return _chain_step(parent, array("I", token_ids).tobytes(), _extra_bytes(extra))


def _chain_step(parent: int, block: bytes | memoryview, extra: bytes) -> int:
    digest = hashlib.blake2b(parent.to_bytes(8, "big"), digest_size=8)
    digest.update(block)
    if extra:
        digest.update(extra)
    return int.from_bytes(digest.digest(), "big")


def _extra_bytes(extra: object) -> bytes:
    return b"" if extra is None else repr(extra).encode()


def block_keys(token_ids: Sequence[int], block_size: int, adapter: str | None = None) -> list[int]:
    """Keys of a prompt's full blocks, in order (a partial last block is never cached): `chain_key` of each,
    over the ids' bytes taken once. With a LoRA adapter, every block's key includes its name, as vLLM's hash
    does and its events say (`extra_keys` `(name,)` per block): the same tokens under two adapters are two
    different blocks."""
    return chained_keys(id_bytes(token_ids), block_size, adapter)


def id_bytes(token_ids: Sequence[int]) -> memoryview:
    """Token ids as the 4-byte words `chain_key` hashes."""
    ids = token_ids if isinstance(token_ids, array) and token_ids.typecode == "I" else array("I", token_ids)
    return memoryview(ids).cast("B")


def chained_keys(
    data: memoryview, block_size: int, adapter: str | None, parent: int = ROOT_KEY, first_block: int = 0
) -> list[int]:
    """`block_keys` of the blocks from `first_block` on, the key of the block before it being `parent`."""
    step = block_size * 4
    extra = _extra_bytes((adapter,) if adapter is not None else None)
    keys: list[int] = []
    for start in range(first_block * step, len(data) - step + 1, step):
        parent = _chain_step(parent, data[start : start + step], extra)
        keys.append(parent)
    return keys


@dataclass
class IndexStats:
    stored: int = 0
    removed: int = 0
    duplicate_stores: int = 0
    """Stores of an engine hash the replica already holds (vLLM may cache one hash in several blocks)."""
    orphan_blocks: int = 0
    """Stored blocks whose parent the index does not know (events missed before subscribing or in a gap)."""
    unknown_removals: int = 0
    evicted: int = 0
    """Entries dropped to stay within `max_entries`."""
    clears: int = 0
    ignored_media: int = 0


class _Entry:
    __slots__ = ("copies", "key")

    def __init__(self, key: int) -> None:
        self.key = key
        self.copies = 1


class KvIndex:
    def __init__(self, max_entries: int = 2_000_000, on_removed: Callable[[str, int], None] | None = None) -> None:
        """`on_removed`: called with (replica, key) when the replica's own events say it evicted a block:
        what the router remembers having just sent there (`RecentRoutes`) no longer holds for it."""
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self.stats = IndexStats()
        self._holders: dict[int, dict[str, int]] = {}
        """Router key -> {replica: how many of its engine hashes map to this key}."""
        self._by_engine: dict[str, OrderedDict[EngineHash, _Entry]] = {}
        self._block_sizes: dict[str, int] = {}
        self._entries = 0
        self.on_removed = on_removed

    # -- events --------------------------------------------------------------------------------------

    def apply(self, replica: str, events: Iterable[KvEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self.store(replica, event)
            elif isinstance(event, BlockRemoved):
                if event.medium in ROUTABLE_MEDIA:
                    self.remove(replica, event.block_hashes)
                else:
                    self.stats.ignored_media += 1
            elif isinstance(event, AllBlocksCleared):
                self.clear(replica)

    def store(self, replica: str, event: BlockStored) -> None:
        if event.medium not in ROUTABLE_MEDIA:
            self.stats.ignored_media += 1
            return
        blocks = self._by_engine.setdefault(replica, OrderedDict())
        self._block_sizes[replica] = event.block_size
        if event.parent_block_hash is None:
            parent = ROOT_KEY
        else:
            parent_entry = blocks.get(event.parent_block_hash)
            if parent_entry is None:
                self.stats.orphan_blocks += len(event.block_hashes)
                return
            parent = parent_entry.key
        step = event.block_size * 4
        data = id_bytes(event.token_ids)
        for position, engine_hash in enumerate(event.block_hashes):
            tokens = data[position * step : (position + 1) * step]
            if len(tokens) < step:
                break  # a malformed event: fewer tokens than its blocks need
            extra = event.extra_keys[position] if event.extra_keys and position < len(event.extra_keys) else None
            key = _chain_step(parent, tokens, _extra_bytes(extra))
            self.stats.stored += 1
            entry = blocks.get(engine_hash)
            if entry is not None:
                self.stats.duplicate_stores += 1
                entry.copies += 1
                blocks.move_to_end(engine_hash)
            else:
                blocks[engine_hash] = _Entry(key)
                holders = self._holders.setdefault(key, {})
                holders[replica] = holders.get(replica, 0) + 1
                self._entries += 1
            parent = key
        self._bound()

    def remove(self, replica: str, engine_hashes: Iterable[EngineHash]) -> None:
        blocks = self._by_engine.get(replica)
        for engine_hash in engine_hashes:
            entry = blocks.get(engine_hash) if blocks is not None else None
            if entry is None:
                self.stats.unknown_removals += 1
                continue
            self.stats.removed += 1
            entry.copies -= 1
            if entry.copies <= 0:
                assert blocks is not None
                del blocks[engine_hash]
                self._drop_holder(entry.key, replica)
                if self.on_removed is not None:
                    self.on_removed(replica, entry.key)

    def clear(self, replica: str) -> None:
        """Forget everything about one replica (AllBlocksCleared, a sequence gap, a restart)."""
        self.stats.clears += 1
        blocks = self._by_engine.pop(replica, None)
        if not blocks:
            return
        for entry in blocks.values():
            self._drop_holder(entry.key, replica)

    def _drop_holder(self, key: int, replica: str) -> None:
        self._entries -= 1
        holders = self._holders[key]
        left = holders[replica] - 1
        if left:
            holders[replica] = left
        else:
            del holders[replica]
            if not holders:
                del self._holders[key]

    def _bound(self) -> None:
        while self._entries > self.max_entries:
            fullest = max(self._by_engine, key=lambda rid: len(self._by_engine[rid]))
            _, entry = self._by_engine[fullest].popitem(last=False)
            self._drop_holder(entry.key, fullest)
            self.stats.evicted += 1

    # -- snapshots (a peer router's warm start) --------------------------------------------------------

    def export(self, replica: str) -> tuple[int | None, list[tuple[EngineHash, int, int]]]:
        """One replica's blocks, oldest first, as (engine hash, router key, copies), with its block size:
        what a starting peer router loads so it routes as this one does before its own events arrive."""
        blocks = self._by_engine.get(replica)
        entries = [(engine_hash, entry.key, entry.copies) for engine_hash, entry in (blocks or {}).items()]
        return self._block_sizes.get(replica), entries

    def load(self, replica: str, block_size: int | None, entries: Iterable[tuple[EngineHash, int, int]]) -> int:
        """Adds a peer's export of one replica (see `export`): blocks already known are kept as they are,
        so events applied meanwhile win. Returns how many blocks were added."""
        blocks = self._by_engine.setdefault(replica, OrderedDict())
        if block_size is not None:
            self._block_sizes.setdefault(replica, block_size)
        added = 0
        # Newest first, each put before what is there: the oldest imported block ends up first in line
        # for `_bound`, and this router's own blocks stay the newest.
        for engine_hash, key, copies in reversed(list(entries)):
            if engine_hash in blocks:
                continue
            entry = blocks[engine_hash] = _Entry(key)
            entry.copies = max(1, copies)
            blocks.move_to_end(engine_hash, last=False)  # older than anything this router saw itself
            holders = self._holders.setdefault(key, {})
            holders[replica] = holders.get(replica, 0) + 1
            self._entries += 1
            added += 1
        if not blocks:
            del self._by_engine[replica]
        self._bound()
        return added

    # -- queries -------------------------------------------------------------------------------------

    def match(self, keys: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        """For each replica, how many of the prompt's leading blocks (`keys`, in order) it holds."""
        return leading_matches(keys, replicas, self._holders.get)

    def likely_best(self, keys: Sequence[int], limit: int) -> list[str]:
        """Up to `limit` replicas likely to hold the longest run of `keys` (see `deepest_holders`)."""
        return deepest_holders(keys, self._holders.get, limit)

    def block_size(self, replica: str) -> int | None:
        """The block size the replica's events carry (None until its first store)."""
        return self._block_sizes.get(replica)

    def blocks(self, replica: str) -> int:
        blocks = self._by_engine.get(replica)
        return len(blocks) if blocks else 0

    @property
    def entries(self) -> int:
        return self._entries

    def approx_bytes(self) -> int:
        """An estimate of the index's memory: its containers plus each entry's objects (O(replicas))."""
        containers = sys.getsizeof(self._holders) + sum(sys.getsizeof(b) for b in self._by_engine.values())
        # Per entry: an _Entry, its key int, a holders dict and its engine-hash int.
        per_entry = sys.getsizeof(_Entry(2**63)) + 2 * sys.getsizeof(2**63) + sys.getsizeof({"r0": 1})
        return containers + self._entries * per_entry
