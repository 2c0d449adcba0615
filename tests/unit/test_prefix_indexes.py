"""The approximate text index, the recent-routes record and the benchmark's oracles."""

from __future__ import annotations

import random

from benchmarks.policy_workloads import (
    multi_turn,
    oracle_partitioned,
    oracle_unbounded,
    shared_prefix,
)
from dpserve.kvindex.events import BlockRemoved, BlockStored
from dpserve.kvindex.index import KvIndex, block_keys
from dpserve.kvindex.matching import leading_matches
from dpserve.kvindex.recent import RecentRoutes
from dpserve.kvindex.text_prefix import CHUNK_CHARS, TextPrefixIndex, text_keys


def test_text_keys_chain_full_chunks() -> None:
    text = "x" * (3 * CHUNK_CHARS + 5)
    keys = text_keys(text)
    assert len(keys) == 3 and len(set(keys)) == 3  # same chunk text, different positions
    assert text_keys(text + "more")[:3] == keys
    assert text_keys("y" + text[1:])[0] != keys[0]


def test_text_index_matches_what_was_routed_and_stays_bounded() -> None:
    index = TextPrefixIndex(max_chunks=5)
    a = text_keys("a" * 4 * CHUNK_CHARS)
    index.record(a, "r0")
    index.record(a[:2], "r1")
    assert index.match(a, ["r0", "r1", "r2"]) == {"r0": 4, "r1": 2, "r2": 0}
    index.record(text_keys("b" * 3 * CHUNK_CHARS), "r2")
    assert len(index) == 5 and index.evicted == 2
    # The two least recently used chunks were a's first two (a[:2] was refreshed, a[2:] was not):
    # a's third and fourth went, so r0 now matches only the first two.
    assert index.match(a, ["r0", "r1"]) == {"r0": 2, "r1": 2}


def test_recent_routes_expire() -> None:
    now = [100.0]
    recent = RecentRoutes(lambda: now[0], ttl_s=5, max_keys=10)
    recent.record([1, 2, 3], "r0")
    now[0] += 3
    recent.record([1, 2], "r1")
    assert recent.match([1, 2, 3], ["r0", "r1"]) == {"r0": 3, "r1": 2}
    now[0] += 3  # r0's record is 6 s old now, r1's 3 s
    assert recent.match([1, 2, 3], ["r0", "r1"]) == {"r0": 0, "r1": 2}
    recent.record(list(range(10, 30)), "r2")
    assert len(recent) == 10


def test_a_replicas_eviction_overrides_what_was_just_routed_there() -> None:
    """The replica's events are the truth about what it evicted: a route sent there moments before no
    longer counts its blocks as cached (they did, for the routes' whole ttl, until receipts showed it)."""
    now = [100.0]
    recent = RecentRoutes(lambda: now[0], ttl_s=10)
    index = KvIndex()
    index.on_removed = recent.forget
    tokens = list(range(12))
    keys = block_keys(tokens, 4)
    index.apply("r0", [BlockStored((1, 2, 3), None, tuple(tokens), 4, None, "GPU")])
    recent.record(keys, "r0")
    recent.record(keys[:1], "r1")
    assert recent.match(keys, ["r0", "r1"]) == {"r0": 3, "r1": 1}
    index.apply("r0", [BlockRemoved((3, 2), "GPU")])  # r0 evicts the prompt's tail, last block first
    assert index.match(keys, ["r0"]) == {"r0": 1}
    assert recent.match(keys, ["r0", "r1"]) == {"r0": 1, "r1": 1}  # r1's route is r1's own


def test_workloads_have_the_promised_shape() -> None:
    work = shared_prefix(groups=3, prompts=4, prefix_words=50, question_words=5, seed=1)
    assert len(work.requests) == 12 and work.groups == 3 and work.threads == 12
    # Each round holds every group once.
    for start in range(0, 12, 3):
        assert sorted(r.group for r in work.requests[start : start + 3]) == [0, 1, 2]
    systems = {r.group: r.messages[0]["content"] for r in work.requests}
    assert all(r.messages[0]["content"] == systems[r.group] for r in work.requests)
    chat = multi_turn(conversations=2, turns=3, opening_words=20, turn_words=4, seed=1)
    turns = [r for r in chat.requests if r.thread == 0]
    assert [len(r.messages) for r in turns] == [2, 4, 6]
    assert turns[2].messages[:4] == turns[1].messages  # the history is resent as it was


def test_oracles_count_hits_as_vllm_does() -> None:
    work = shared_prefix(groups=2, prompts=3, prefix_words=1, question_words=1, seed=0)
    # Hand-made ids, block size 2: each group shares 2 blocks; each prompt adds a block and one token.
    for index, request in enumerate(work.requests):
        base = (10, 11, 12, 13) if request.group == 0 else (20, 21, 22, 23)
        request.token_ids = (*base, 100 + index, 200 + index, 7)
    # 7 tokens: hits cap at (7-1)//2 = 3 blocks; later requests of a group hit the 2 shared blocks.
    assert oracle_unbounded(work.requests, 2) == (4 * 2 * 2) / (6 * 7)
    # A perfect partition over two replicas with room for a request (4 blocks) keeps each group's
    # prefix; one replica of 5 blocks cannot hold both groups, so they evict each other.
    assert oracle_partitioned(work.requests, 2, 2, 4, max_tokens=1) == oracle_unbounded(work.requests, 2)
    assert oracle_partitioned(work.requests, 2, 1, 5, max_tokens=1) < oracle_unbounded(work.requests, 2)


def test_leading_matches_is_each_replicas_longest_leading_run() -> None:
    """Against the definition, on random holdings with gaps: a replica's depth is how many keys it holds
    from the first on, whatever the others hold (the common case, all holding the next block, skips work)."""
    rng = random.Random(11)
    for _ in range(500):
        keys = list(range(rng.randrange(0, 12)))
        replicas = [f"r{i}" for i in range(rng.randrange(0, 4))]
        held = {key: {rid for rid in replicas if rng.random() < 0.8} for key in keys}
        expected = {}
        for rid in replicas:
            run = 0
            while run < len(keys) and rid in held[keys[run]]:
                run += 1
            expected[rid] = run
        assert leading_matches(keys, replicas, held.get) == expected


def test_recent_routes_match_counts_only_routes_within_the_ttl() -> None:
    """Against the definition, on random routes of random ages: a replica's depth is how many keys were
    sent there within the TTL, from the first on."""
    rng = random.Random(5)
    for _ in range(300):
        recent = RecentRoutes(lambda: 100.0, ttl_s=10.0)
        keys = list(range(rng.randrange(0, 10)))
        replicas = [f"r{i}" for i in range(rng.randrange(1, 4))]
        sent: dict[tuple[int, str], float] = {}
        for key in keys:
            for rid in replicas:
                if rng.random() < 0.8:
                    age = rng.choice([0.0, 5.0, 15.0])  # fresh, fresh, expired
                    recent.learn([key], rid, age)
                    sent[(key, rid)] = 100.0 - age
        expected = {}
        for rid in replicas:
            run = 0
            while run < len(keys) and sent.get((keys[run], rid), -1e9) >= 100.0 - 10.0:
                run += 1
            expected[rid] = run
        assert recent.match(keys, replicas) == expected


def test_recent_routes_refresh_a_block_only_once_it_has_aged() -> None:
    """A prefix routed again within 5% of the TTL keeps its first time (it expires that much early at most);
    routed again later, its time moves on."""
    now = [0.0]
    recent = RecentRoutes(lambda: now[0], ttl_s=10.0)
    recent.record([1, 2], "r0")
    now[0] = 0.4
    recent.record([1, 2], "r0")
    now[0] = 10.2
    assert recent.match([1, 2], ["r0"]) == {"r0": 0}  # 0.4's route did not refresh it
    now[0] = 20.0
    recent.record([1, 2], "r0")
    now[0] = 20.6
    recent.record([1, 2], "r0")
    now[0] = 30.3
    assert recent.match([1, 2], ["r0"]) == {"r0": 2}  # 20.6's did
