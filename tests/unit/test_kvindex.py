"""The KV index and its event decoding: both wire formats, store/remove/clear, duplicates, bounds."""

from __future__ import annotations

import random

import msgspec
import pytest

from dpserve.kvindex.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_message,
)
from dpserve.kvindex.index import KvIndex, block_keys
from dpserve.sim import cache as sim_cache
from dpserve.sim.kv_publisher import encode_batch

BS = 4


def stored(hashes: list[int], parent: int | None, tokens: list[int], medium: str | None = "GPU") -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), BS, None, medium)


def message(events: list[object], seq: int = 0) -> list[bytes]:
    return [b"kv-events", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.5, events, 0])]


def test_decodes_vllm_032_map_events() -> None:
    frames = message(
        [
            {
                "type": "BlockStored",
                "block_hashes": [11, 12],
                "parent_block_hash": None,
                "token_ids": list(range(8)),
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": [None, None],
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            },
            {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU", "group_idx": 0},
            {"type": "AllBlocksCleared"},
        ],
        seq=7,
    )
    batch = decode_message(frames)
    assert batch.sequence == 7
    assert batch.timestamp == 1.5
    first, second, third = batch.events
    assert first == BlockStored((11, 12), None, tuple(range(8)), 4, (None, None), "GPU")
    assert second == BlockRemoved((12,), "GPU")
    assert third == AllBlocksCleared()


def test_decodes_older_positional_events() -> None:
    batch = decode_message(
        message(
            [
                ["BlockStored", [b"\x01" * 32], 5, [1, 2, 3, 4], 4, None],
                ["BlockStored", [9], None, [1, 2, 3, 4], 4, None, "CPU"],
                ["BlockRemoved", [9]],
                ["AllBlocksCleared"],
            ]
        )
    )
    assert batch.events[0] == BlockStored((b"\x01" * 32,), 5, (1, 2, 3, 4), 4, None, None)
    assert batch.events[1].medium == "CPU"  # type: ignore[union-attr]
    assert batch.events[2] == BlockRemoved((9,), None)
    assert batch.events[3] == AllBlocksCleared()


def test_topicless_two_frame_messages_decode() -> None:
    _, seq, payload = message([{"type": "AllBlocksCleared"}], seq=3)
    assert decode_message([seq, payload]).sequence == 3


@pytest.mark.parametrize(
    "frames",
    [
        [b"only one"],
        [b"t", b"\x00" * 3, msgspec.msgpack.encode([0, []])],
        [b"t", b"\x00" * 8, b"\xc1not msgpack"],
        [b"t", b"\x00" * 8, msgspec.msgpack.encode({"not": "a batch"})],
        message([{"type": "Mystery"}]),
        message([{"type": "BlockStored", "block_hashes": [1]}]),
        message([{"type": "BlockStored", "block_hashes": ["x"], "token_ids": [], "block_size": 4}]),
        message([42]),
    ],
)
def test_malformed_messages_raise_decode_errors(frames: list[bytes]) -> None:
    with pytest.raises(EventDecodeError):
        decode_message(frames)


def test_the_simulators_wire_format_decodes_to_its_own_events() -> None:
    cache = sim_cache.PrefixCache(capacity_blocks=8, block_size=BS)
    allocation = cache.allocate(list(range(10)), max_new_tokens=1)
    cache.free(allocation)
    events = cache.take_events()
    batch = decode_message([b"kv-events", (0).to_bytes(8, "big"), encode_batch(events, 2.0)])
    assert len(batch.events) == len(events)
    assert isinstance(batch.events[0], BlockStored)
    assert batch.events[0].token_ids == tuple(range(8))


def test_stored_blocks_match_the_requests_own_keys() -> None:
    index = KvIndex()
    index.store("r0", stored([101, 102], None, [1, 2, 3, 4, 5, 6, 7, 8]))
    index.store("r0", stored([103], 102, [9, 10, 11, 12]))
    index.store("r1", stored([201], None, [1, 2, 3, 4]))
    keys = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], BS)
    assert len(keys) == 3
    assert index.match(keys, ["r0", "r1", "r2"]) == {"r0": 3, "r1": 1, "r2": 0}
    # A different second block: only the first is shared.
    other = block_keys([1, 2, 3, 4, 0, 0, 0, 0], BS)
    assert index.match(other, ["r0", "r1"]) == {"r0": 1, "r1": 1}
    # Same tokens at another position are another block (chained keys).
    shifted = block_keys([5, 6, 7, 8], BS)
    assert index.match(shifted, ["r0"]) == {"r0": 0}
    assert index.block_size("r0") == BS
    assert index.blocks("r0") == 3 and index.entries == 4


def test_removal_by_engine_hash_and_prefix_breaks() -> None:
    index = KvIndex()
    index.store("r0", stored([1, 2, 3], None, list(range(12))))
    keys = block_keys(list(range(12)), BS)
    index.remove("r0", [2])
    assert index.match(keys, ["r0"]) == {"r0": 1}  # block 3 is still cached but no longer reachable
    index.remove("r0", [99])
    assert index.stats.unknown_removals == 1
    index.remove("r0", [1, 3])
    assert index.entries == 0 and index.match(keys, ["r0"]) == {"r0": 0}


def test_duplicate_stores_need_as_many_removals() -> None:
    index = KvIndex()
    index.store("r0", stored([1], None, [1, 2, 3, 4]))
    index.store("r0", stored([1], None, [1, 2, 3, 4]))
    assert index.stats.duplicate_stores == 1
    keys = block_keys([1, 2, 3, 4], BS)
    index.remove("r0", [1])
    assert index.match(keys, ["r0"]) == {"r0": 1}
    index.remove("r0", [1])
    assert index.match(keys, ["r0"]) == {"r0": 0}
    assert index.entries == 0


def test_clear_forgets_one_replica_only() -> None:
    index = KvIndex()
    for rid in ("r0", "r1"):
        index.store(rid, stored([1, 2], None, list(range(8))))
    keys = block_keys(list(range(8)), BS)
    index.apply("r0", [AllBlocksCleared()])
    assert index.match(keys, ["r0", "r1"]) == {"r0": 0, "r1": 2}
    assert index.entries == 2


def test_orphans_and_other_media_are_not_indexed() -> None:
    index = KvIndex()
    index.store("r0", stored([5], 4, [1, 2, 3, 4]))  # parent 4 never seen
    index.store("r0", stored([6], None, [1, 2, 3, 4], medium="CPU"))
    index.apply("r0", [BlockRemoved((6,), "CPU")])
    assert index.entries == 0
    assert index.stats.orphan_blocks == 1 and index.stats.ignored_media == 2


def test_extra_keys_make_a_different_block() -> None:
    index = KvIndex()
    index.store("r0", BlockStored((1,), None, (1, 2, 3, 4), BS, (("lora-a",),), "GPU"))
    assert index.match(block_keys([1, 2, 3, 4], BS), ["r0"]) == {"r0": 0}


def test_an_adapters_blocks_match_only_that_adapters_prompts() -> None:
    """vLLM 0.32 sends a LoRA block's extra keys as `[name]` per block (msgpack has no tuples); the
    router's keys of a prompt under that adapter must find them, and the base model's or another
    adapter's keys of the same tokens must not."""
    tokens = list(range(8))
    event = {
        "type": "BlockStored",
        "block_hashes": [21, 22],
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": 1,
        "medium": "GPU",
        "lora_name": "tiny-lora-0",
        "extra_keys": [["tiny-lora-0"], ["tiny-lora-0"]],
    }
    index = KvIndex()
    index.apply("r0", decode_message(message([event])).events)
    index.store("r1", stored([31, 32], None, tokens))  # the base model's blocks of the same tokens
    assert index.match(block_keys(tokens, BS, "tiny-lora-0"), ["r0", "r1"]) == {"r0": 2, "r1": 0}
    assert index.match(block_keys(tokens, BS), ["r0", "r1"]) == {"r0": 0, "r1": 2}
    assert index.match(block_keys(tokens, BS, "tiny-lora-1"), ["r0", "r1"]) == {"r0": 0, "r1": 0}


def test_memory_is_bounded_by_evicting_the_fullest_replicas_oldest_blocks() -> None:
    index = KvIndex(max_entries=10)
    index.store("r0", stored(list(range(1, 9)), None, list(range(32))))
    index.store("r1", stored([100, 101, 102, 103], None, list(range(100, 116))))
    assert index.entries == 10
    assert index.stats.evicted == 2
    assert index.blocks("r0") == 6 and index.blocks("r1") == 4
    # r0's two oldest (leading) blocks went, so its prefix no longer matches from the start.
    assert index.match(block_keys(list(range(32)), BS), ["r0"]) == {"r0": 0}
    assert index.approx_bytes() > 0


def test_random_events_agree_with_a_replay_of_the_simulators_cache() -> None:
    """The sim's cache is a faithful KV cache; the index fed its events must predict its hits."""
    rng = random.Random(3)
    cache = sim_cache.PrefixCache(capacity_blocks=40, block_size=BS)
    index = KvIndex()
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(5)]
    live = []
    hits = 0
    for step in range(400):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
        predicted = index.match(block_keys(prompt, BS), ["sim"])["sim"]
        try:
            allocation = cache.allocate(prompt, max_new_tokens=2)
        except sim_cache.NoRoom:
            allocation = None
        if allocation is not None:
            # vLLM never counts the block holding the last prompt token as a hit.
            assert allocation.hit_tokens == min(predicted, (len(prompt) - 1) // BS) * BS, step
            hits += allocation.hit_tokens > 0
            live.append(allocation)
        if live and (allocation is None or rng.random() < 0.6):
            cache.free(live.pop(rng.randrange(len(live))))
        if step == 200:
            while live:
                cache.free(live.pop())
            assert cache.reset()
        wire = encode_batch(cache.take_events(), float(step))
        index.apply("sim", decode_message([b"kv-events", step.to_bytes(8, "big"), wire]).events)
    assert hits > 100
    assert index.stats.removed > 0 and index.stats.clears == 1
