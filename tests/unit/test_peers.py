"""What routers tell each other (peers/wire.py) and what one router makes of it (peers/board.py), without
sockets: updates round-trip, anything malformed is refused, stale or foreign updates change nothing, and
nothing a peer sends grows this router's memory past its bounds."""

from __future__ import annotations

import dataclasses
import random

import msgspec
import pytest

from dpserve.kvindex.events import BlockStored
from dpserve.kvindex.index import KvIndex, block_keys
from dpserve.kvindex.recent import RecentRoutes
from dpserve.policies.bindings import SessionBindings
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.flow.quotas import Quota, QuotaBook
from dpserve.router.peers.board import PeerBoard
from dpserve.router.peers.wire import (
    LENGTH,
    MAX_FRAME_BYTES,
    MAX_MODELS,
    MAX_ROUTES,
    MAX_USAGE,
    PeerUpdate,
    PeerWireError,
    decode_snapshot,
    decode_update,
    encode_snapshot,
    encode_update,
    frame_length,
)
from dpserve.router.scale.held import Held

URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def healthy_registry(urls: list[str]) -> ReplicaRegistry:
    registry = ReplicaRegistry([f"r{index}={url}" for index, url in enumerate(urls)])
    catalog = ModelCatalog(registry)
    for replica in registry:
        catalog.set_model_cards(replica.id, ({"id": "m"},))
        registry.probe_succeeded(replica.id)
    return registry


def board_for(urls: list[str], clock: Clock, **kwargs: object) -> tuple[PeerBoard, ReplicaRegistry, RecentRoutes]:
    registry = healthy_registry(urls)
    recent = RecentRoutes(clock, ttl_s=10.0)
    bindings = SessionBindings(clock)
    board = PeerBoard(registry, "me", recent, bindings, KvIndex(), clock=clock, wall=clock, **kwargs)  # type: ignore[arg-type]
    return board, registry, recent


def payload(data: bytes) -> bytes:
    """A frame's payload (after its 4-byte length)."""
    assert frame_length(data[:4]) == len(data) - 4
    return data[4:]


def test_an_update_round_trips_through_the_wire() -> None:
    update = PeerUpdate(
        origin="peer-a",
        seq=7,
        sent_at=1000.5,
        in_flight={URLS[0]: 3},
        unhealthy=(URLS[1],),
        routes=[(URLS[0], [1, 2, (1 << 64) - 1])],
        bindings=[("session-1", URLS[1])],
    )
    decoded = decode_update(payload(encode_update(update)))
    assert decoded == update


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1garbage",
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"v": 2, "o": "a", "s": 1, "t": 1.0}),
        msgspec.msgpack.encode({"v": 1, "o": "", "s": 1, "t": 1.0}),
        msgspec.msgpack.encode({"v": 1, "o": "a", "s": -1, "t": 1.0}),
        msgspec.msgpack.encode({"v": 1, "o": "a", "s": 1, "t": "soon"}),
        msgspec.msgpack.encode({"v": 1, "o": "a", "s": 1, "t": 1.0, "f": {URLS[0]: 10**9}}),
        msgspec.msgpack.encode({"v": 1, "o": "a", "s": 1, "t": 1.0, "f": {URLS[0]: True}}),
        msgspec.msgpack.encode({"v": 1, "o": "a", "s": 1, "t": 1.0, "r": [[URLS[0], [-5]]]}),
        msgspec.msgpack.encode({"v": 1, "o": "a", "s": 1, "t": 1.0, "r": [[URLS[0]]]}),
        msgspec.msgpack.encode({"v": 1, "o": "a", "s": 1, "t": 1.0, "r": [["u", [1]]] * (MAX_ROUTES + 1)}),
        msgspec.msgpack.encode({"v": 1, "o": "a", "s": 1, "t": 1.0, "b": [["k", 5]]}),
        msgspec.msgpack.encode({"v": 1, "o": "a" * 600, "s": 1, "t": 1.0}),
        msgspec.msgpack.encode({"v": 1, "o": "a", "s": 1, "t": 1.0, "x": "yes"}),
    ],
)
def test_malformed_updates_are_refused(body: bytes) -> None:
    with pytest.raises(PeerWireError):
        decode_update(body)


def test_a_frame_longer_than_the_limit_is_refused_before_it_is_read() -> None:
    with pytest.raises(PeerWireError):
        frame_length(LENGTH.pack(MAX_FRAME_BYTES + 1))


def test_peer_in_flight_counts_add_up_and_count_in_load() -> None:
    clock = Clock()
    board, registry, _ = board_for(URLS, clock)
    board.apply(PeerUpdate("a", 1, clock.now, in_flight={URLS[0]: 3}), "link-a")
    board.apply(PeerUpdate("b", 1, clock.now, in_flight={URLS[0]: 2, URLS[1]: 1}), "link-b")
    r0, r1 = registry.get("r0"), registry.get("r1")
    assert (r0.peer_in_flight, r1.peer_in_flight) == (5, 1)
    assert r0.load == 5
    # Each update replaces its origin's last counts.
    board.apply(PeerUpdate("a", 2, clock.now, in_flight={}), "link-a")
    assert (r0.peer_in_flight, r1.peer_in_flight) == (2, 1)


def test_a_fall_in_peers_counts_is_believed_after_a_random_pause_and_a_rise_is_believed_at_once() -> None:
    """Every router hears of the same freed slots at once; each waits its own random pause before counting
    them free, so the first to take them can tell the others before their pauses end."""
    clock = Clock()
    board, registry, _ = board_for(URLS, clock, fall_spread_s=0.1, rng=random.Random(7))
    r0 = registry.get("r0")
    woken = []
    registry.on_change(lambda: woken.append(clock.now))
    board.apply(PeerUpdate("a", 1, clock.now, in_flight={URLS[0]: 2}), "link-a")
    assert r0.peer_in_flight == 2 and board.next_fall_at() is None and not board.contested()
    board.apply(PeerUpdate("a", 2, clock.now, in_flight={URLS[0]: 1}), "link-a")
    due = board.next_fall_at()
    assert due is not None and clock.now <= due <= clock.now + 0.1
    assert r0.peer_in_flight == 2 and board.contested() and not woken  # still the older count
    board.apply(PeerUpdate("a", 3, clock.now, in_flight={}), "link-a")
    assert board.next_fall_at() == due and r0.peer_in_flight == 2  # one pause for the fall, however it goes on
    clock.now = due - 1e-6
    board.believe_falls()
    assert r0.peer_in_flight == 2
    clock.now = due
    board.believe_falls()
    assert r0.peer_in_flight == 0 and board.next_fall_at() is None and woken == [due]  # waiters told of the room
    assert board.contested()  # other routers' pauses may not have ended: a take now is news to them
    clock.now += 0.2
    assert not board.contested()


def test_a_rise_during_the_pause_ends_it_and_a_forgotten_peers_count_is_held_alike() -> None:
    clock = Clock()
    board, registry, _ = board_for(URLS, clock, fall_spread_s=0.1, rng=random.Random(1))
    r0 = registry.get("r0")
    board.apply(PeerUpdate("a", 1, clock.now, in_flight={URLS[0]: 2}), "link-a")
    board.apply(PeerUpdate("a", 2, clock.now, in_flight={URLS[0]: 1}), "link-a")
    board.apply(PeerUpdate("b", 1, clock.now, in_flight={URLS[0]: 1}), "link-b")  # another router took it
    assert r0.peer_in_flight == 2 and board.next_fall_at() is None
    board.link_lost("link-b")
    assert r0.peer_in_flight == 2 and board.next_fall_at() is not None
    clock.now += 0.1
    board.believe_falls()
    assert r0.peer_in_flight == 1


def test_without_a_spread_falls_count_at_once() -> None:
    clock = Clock()
    board, registry, _ = board_for(URLS, clock)
    board.apply(PeerUpdate("a", 1, clock.now, in_flight={URLS[0]: 2}), "link-a")
    board.apply(PeerUpdate("a", 2, clock.now, in_flight={}), "link-a")
    assert registry.get("r0").peer_in_flight == 0 and board.next_fall_at() is None and not board.contested()


def test_a_scrape_does_not_count_peers_requests_twice() -> None:
    clock = Clock()
    board, registry, _ = board_for(URLS, clock)
    board.apply(PeerUpdate("a", 1, clock.now, in_flight={URLS[0]: 4}), "link-a")
    registry.acquire("r0")
    # The replica runs the 4 requests of the peer and 1 of ours: no one else's.
    registry.record_scrape(
        "r0", running=5, waiting=0, kv_usage=0.0, prefix_cache_queries=0, prefix_cache_hits=0, block_size=None
    )
    assert registry.get("r0").load == 5


def test_old_and_out_of_order_updates_change_nothing() -> None:
    clock = Clock()
    board, registry, _ = board_for(URLS, clock, stale_s=5.0)
    board.apply(PeerUpdate("a", 5, clock.now, in_flight={URLS[0]: 3}), "link")
    board.apply(PeerUpdate("a", 4, clock.now, in_flight={URLS[0]: 9}), "link")  # replayed
    board.apply(PeerUpdate("b", 1, clock.now - 60, in_flight={URLS[0]: 9}), "link")  # sent a minute ago
    assert registry.get("r0").peer_in_flight == 3
    assert board.stats.stale == 2


def test_own_updates_relayed_back_and_unknown_replicas_are_ignored() -> None:
    clock = Clock()
    board, registry, recent = board_for(URLS, clock)
    board.apply(PeerUpdate("me", 1, clock.now, in_flight={URLS[0]: 3}), "link")
    unknown = "http://10.9.9.9:8000"
    board.apply(PeerUpdate("a", 1, clock.now, in_flight={unknown: 50}, routes=[(unknown, [1, 2])]), "link")
    assert [r.peer_in_flight for r in registry] == [0, 0]
    assert len(recent) == 0
    assert board.stats.unknown_replicas == 1


def test_a_peer_is_forgotten_when_it_leaves_its_link_drops_or_it_goes_silent() -> None:
    clock = Clock()
    board, registry, recent = board_for(URLS, clock, timeout_s=2.0)
    for origin, link in (("a", "la"), ("b", "lb"), ("c", "lc")):
        board.apply(PeerUpdate(origin, 1, clock.now, in_flight={URLS[0]: 1}), link)
    assert registry.get("r0").peer_in_flight == 3 and recent.peers == 3
    board.apply(PeerUpdate("a", 2, clock.now, leaving=True), "la")
    assert registry.get("r0").peer_in_flight == 2 and recent.peers == 2
    board.link_lost("lb")
    assert registry.get("r0").peer_in_flight == 1
    clock.now += 1.0
    board.expire()
    assert registry.get("r0").peer_in_flight == 1
    clock.now += 1.5
    board.expire()
    # Alone again: kv_aware places new prefixes as a router alone does (PrefixMatch.peers).
    assert registry.get("r0").peer_in_flight == 0 and recent.peers == 0
    assert board.stats.forgotten == {"left": 1, "link_lost": 1, "silent": 1}


def test_origins_are_bounded_however_many_a_peer_invents() -> None:
    clock = Clock()
    board, registry, _ = board_for(URLS, clock, max_origins=16)
    for index in range(1000):
        clock.now += 0.001
        board.apply(PeerUpdate(f"invented-{index}", 1, clock.now, in_flight={URLS[0]: 1}), "link")
    assert len(board.origins) == 16
    assert registry.get("r0").peer_in_flight == 16
    assert board.stats.forgotten == {"crowded": 1000 - 16}


def test_routes_and_bindings_from_a_peer_steer_this_router() -> None:
    clock = Clock()
    board, _registry, recent = board_for(URLS, clock)
    keys = block_keys(list(range(64)), 16)
    board.apply(PeerUpdate("a", 1, clock.now, routes=[(URLS[1], keys)], bindings=[("s1", URLS[1])]), "link")
    assert recent.match(keys, ["r0", "r1"]) == {"r0": 0, "r1": 4}
    assert recent.pending_blocks("r1") == 4  # a peer's route counts in the held blocks, as this router's own
    assert board._bindings is not None and board._bindings.get("s1") == "r1"


def test_a_peer_verdict_is_reported_once_while_this_router_still_routes_there() -> None:
    clock = Clock()
    board, _registry, _ = board_for(URLS, clock)
    assert board.apply(PeerUpdate("a", 1, clock.now, unhealthy=(URLS[1],)), "link") == ["r1"]
    assert board.apply(PeerUpdate("a", 2, clock.now, unhealthy=(URLS[1],)), "link") == []


def test_own_update_carries_routes_once_and_uses_urls() -> None:
    clock = Clock()
    registry = healthy_registry(URLS)
    recent = RecentRoutes(clock, max_outbox=100)
    board = PeerBoard(registry, "me", recent, clock=clock, wall=clock)
    registry.acquire("r1")
    recent.record([11, 12], "r1")
    first = board.update()
    assert first.in_flight == {URLS[1]: 1}
    assert first.routes == [(URLS[1], [11, 12])]
    assert board.update().routes == []


def test_the_outbox_is_bounded_when_no_one_takes_it() -> None:
    recent = RecentRoutes(Clock(), max_outbox=10)
    for index in range(1000):
        recent.record([index], "r0")
    assert len(recent.take_outbox()) == 10


def test_a_snapshot_warms_another_router_with_its_index_and_routes() -> None:
    clock = Clock()
    tokens = list(range(64))
    source, _, source_recent = board_for(URLS, clock)
    assert source._kv_index is not None
    source._kv_index.store(
        "r1", BlockStored(block_hashes=(101, 102), parent_block_hash=None, token_ids=tuple(tokens[:32]), block_size=16)
    )
    source_recent.record([7, 8], "r0")
    # The other router lists the replicas the other way round: URLs, not ids, travel.
    target, target_registry, target_recent = board_for(list(reversed(URLS)), clock)
    snapshot = decode_snapshot(encode_snapshot(source.snapshot()), max_blocks=1000)
    assert target.load(snapshot) == (2, 2)
    assert target._kv_index is not None
    by_url = {r.url: r.id for r in target_registry}
    assert target._kv_index.match(block_keys(tokens[:32], 16), list(by_url.values())) == {
        by_url[URLS[1]]: 2,
        by_url[URLS[0]]: 0,
    }
    assert target_recent.match([7, 8], list(by_url.values()))[by_url[URLS[0]]] == 2


def test_a_snapshot_larger_than_the_index_bound_is_refused() -> None:
    clock = Clock()
    source, _, _ = board_for(URLS, clock)
    assert source._kv_index is not None
    tokens = list(range(16 * 20))
    hashes = tuple(range(1, 21))
    source._kv_index.store(
        "r0", BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tuple(tokens), block_size=16)
    )
    with pytest.raises(PeerWireError):
        decode_snapshot(encode_snapshot(source.snapshot()), max_blocks=10)


def test_a_session_binding_wins_over_the_ring_while_its_replica_has_room() -> None:
    from dpserve.policies.base import ReplicaSnapshot, RequestFeatures
    from dpserve.policies.session import SessionAffinity

    policy = SessionAffinity()
    candidates = [ReplicaSnapshot("r0"), ReplicaSnapshot("r1")]
    ring_choice = policy.choose(RequestFeatures("chat", "m", False, session_key="k"), candidates).id
    other = "r1" if ring_choice == "r0" else "r0"
    bound = RequestFeatures("chat", "m", False, session_key="k", bound=other)
    assert policy.choose(bound, candidates).id == other
    busy = [ReplicaSnapshot(other, in_flight=20), ReplicaSnapshot(ring_choice)]
    assert policy.choose(bound, busy).id == ring_choice


def test_tenants_usage_travels_to_peers_and_counts_in_their_quotas() -> None:
    clock = Clock()
    sender, _, _ = board_for(URLS, clock)
    receiver, _, _ = board_for(URLS, clock)
    sender_quotas, receiver_quotas = QuotaBook(clock), QuotaBook(clock)
    sender.quotas, receiver.quotas = sender_quotas, receiver_quotas
    sender.origin = "peer-a"
    sender_quotas.start("acme")
    sender_quotas.finish("acme", 900)
    update = decode_update(payload(encode_update(sender.update())))
    assert update.usage == [("acme", 1, 900)]
    receiver.apply(update, "link")
    assert receiver_quotas.used("acme") == (1, 900)
    refused = receiver_quotas.check("acme", Quota(tokens_per_min=900))
    assert refused is not None and refused.limit == "tokens_per_min"
    assert sender.update().usage == []  # taken: not sent twice
    receiver.apply(update, "link")  # the same update again (relayed by a sibling): counted once
    assert receiver_quotas.used("acme") == (1, 900)


@pytest.mark.parametrize(
    "usage", [[["acme", 1]], [["acme", -1, 5]], [["", 1, 5]], [["acme", 1, True]], [["t", 1, 1]] * (MAX_USAGE + 1)]
)
def test_malformed_usage_reports_are_refused(usage: list[list[object]]) -> None:
    with pytest.raises(PeerWireError):
        decode_update(msgspec.msgpack.encode({"v": 1, "o": "a", "s": 1, "t": 1.0, "q": usage}))


class HeldBook:
    """A scale advisor's side of the board: what this router holds, and what it heard each peer holds."""

    def __init__(self, own: dict[str, Held]) -> None:
        self.own = own
        self.peers: dict[str, dict[str, Held]] = {}

    def own_held(self) -> dict[str, Held]:
        return self.own

    def peer_held(self, origin: str, held: dict[str, Held]) -> None:
        self.peers[origin] = held


def test_requests_held_in_a_router_travel_to_its_peers_on_their_own_clocks() -> None:
    """The scale signal's queue is every router's: a peer's held requests, their oldest wait read on this
    router's clock (the wire carries the sender's wall clock)."""
    sender_clock, receiver_clock = Clock(), Clock()
    own = {"m": Held(queued=2, queued_since=990.0), "": Held(cold=1, cold_since=999.0)}
    sender_share, receiver_share = HeldBook(own), HeldBook({})
    sender_wall, receiver_wall = (lambda: sender_clock.now + 5000.0), (lambda: receiver_clock.now + 5950.0)
    sender = PeerBoard(healthy_registry(URLS), "peer-a", clock=sender_clock, wall=sender_wall, held=sender_share)
    receiver = PeerBoard(healthy_registry(URLS), "me", clock=receiver_clock, wall=receiver_wall, held=receiver_share)
    update = decode_update(payload(encode_update(sender.update())))
    # Waiting for 10 s and 1 s, on the sender's wall clock:
    assert update.held == (("m", Held(2, 5990.0, 0, 0.0)), ("", Held(0, 0.0, 1, 5999.0)))
    receiver_clock.now = 50.0  # the same wall time (6000), another monotonic clock
    receiver.apply(update, "link")
    assert receiver_share.peers["peer-a"] == {"m": Held(2, 40.0), "": Held(cold=1, cold_since=49.0)}  # the same
    receiver.apply(dataclasses.replace(update, seq=update.seq + 1, leaving=True), "link")
    assert receiver_share.peers["peer-a"] == {}  # gone: its requests no longer count


@pytest.mark.parametrize(
    "held",
    [[["m", 1, 1.0]], [["m", -1, 1.0, 0, 0.0]], [["m", 1, float("inf"), 0, 0.0]], [["m", 1, 1.0, 1, float("nan")]],
     [[5, 1, 1.0, 0, 0.0]], [["m", 1, 1.0, 0, 0.0]] * (MAX_MODELS + 1)],
)  # fmt: skip
def test_malformed_held_counts_are_refused(held: list[list[object]]) -> None:
    with pytest.raises(PeerWireError):
        decode_update(msgspec.msgpack.encode({"v": 1, "o": "a", "s": 1, "t": 1.0, "h": held}))


def test_peers_tell_a_data_parallel_servers_engines_apart_by_url_and_rank() -> None:
    clock = Clock()
    mine, registry, _ = board_for(URLS[:1], clock)
    registry.split_engines("r0", [0, 1])
    theirs, their_registry, _ = board_for(URLS[:1], clock)
    their_registry.split_engines("r0", [0, 1])
    their_registry.acquire("r0:dp1")
    update = theirs.update()
    assert update.in_flight == {f"{URLS[0]}#dp1": 1}
    mine.apply(PeerUpdate("b", 1, clock.now, in_flight=dict(update.in_flight)), "link-b")
    assert (registry.get("r0:dp0").peer_in_flight, registry.get("r0:dp1").peer_in_flight) == (0, 1)


def test_own_update_follows_counts_and_verdicts_without_a_scan_of_the_fleet() -> None:
    clock = Clock()
    registry = healthy_registry(URLS)
    board = PeerBoard(registry, "me", clock=clock, wall=clock)
    heard = []
    registry.on_counts(lambda: heard.append(1))
    registry.acquire("r0")
    registry.acquire("r0")
    registry.release("r0")
    assert board.update().in_flight == {URLS[0]: 1} and len(heard) == 3
    registry.release("r0")
    assert board.update().in_flight == {} and registry.busy() == []
    assert board.update().unhealthy == ()
    registry.probe_failed("r1", "down")
    registry.probe_failed("r1", "down")  # ejected: the fleet's shape changed, the verdicts are read again
    assert board.update().unhealthy == (URLS[1],)


def test_peer_counts_are_set_and_cleared_for_the_replicas_they_name() -> None:
    registry = healthy_registry(URLS)
    registry.set_peer_in_flight({"r0": 2})
    registry.set_peer_in_flight({"r1": 1})
    assert [r.peer_in_flight for r in registry] == [0, 1]
    registry.set_peer_in_flight({})
    assert [r.peer_in_flight for r in registry] == [0, 0]
