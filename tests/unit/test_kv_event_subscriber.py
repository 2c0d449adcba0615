"""KV-event subscribers: sequence gaps and restarts clear a replica's entries; a real PUB/SUB pair on
loopback feeds the index."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq.asyncio

from dpserve.kvindex.index import KvIndex, block_keys
from dpserve.replicas.kv_events import (
    KvEventSubscriber,
    SequenceCheck,
    SequenceTracker,
    parse_kv_event_source,
    subscriber_socket,
)
from dpserve.sim.cache import BlockStored
from dpserve.sim.kv_publisher import KvEventPublisher, encode_batch
from tests.conftest import free_port


def frames(seq: int, tokens: list[int], hashes: list[int], parent: int | None = None) -> list[bytes]:
    event = BlockStored(tuple(hashes), parent, tuple(tokens), 4)
    return [b"kv-events", seq.to_bytes(8, "big"), encode_batch([event], 0.0)]


def test_sequence_tracker() -> None:
    tracker = SequenceTracker()
    checks = [tracker.observe(seq) for seq in (5, 6, 7, 10, 11, 0, 1)]
    assert checks == [
        SequenceCheck.FIRST,
        SequenceCheck.NEXT,
        SequenceCheck.NEXT,
        SequenceCheck.GAP,
        SequenceCheck.NEXT,
        SequenceCheck.RESTART,
        SequenceCheck.NEXT,
    ]
    assert tracker.missed == 2


def test_parse_kv_event_source() -> None:
    assert parse_kv_event_source("http://h:8100/=tcp://h:5557") == ("http://h:8100", "tcp://h:5557")
    for bad in ("http://h:8100", "=tcp://h:1", "http://h:8100=udp://h:1"):
        with pytest.raises(ValueError):
            parse_kv_event_source(bad)


def test_a_gap_or_a_restart_clears_the_replicas_entries() -> None:
    index = KvIndex()
    context = zmq.asyncio.Context()
    sub = KvEventSubscriber(index, "r0", "tcp://127.0.0.1:1", context, time.monotonic)
    try:
        sub.handle(frames(0, [1, 2, 3, 4], [1]))
        sub.handle(frames(1, [5, 6, 7, 8], [2], parent=1))
        assert index.match(block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4), ["r0"]) == {"r0": 2}
        # Batch 2 lost: what it said (a removal, say) is unknown, so nothing of r0 is trusted.
        sub.handle(frames(3, [9, 9, 9, 9], [3]))
        assert sub.stats.gaps == 1 and sub.missed_batches == 1
        assert index.match(block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4), ["r0"]) == {"r0": 0}
        assert index.match(block_keys([9, 9, 9, 9], 4), ["r0"]) == {"r0": 1}
        sub.handle(frames(0, [1, 2, 3, 4], [1]))  # the replica restarted
        assert sub.stats.restarts == 1 and index.blocks("r0") == 1
        sub.handle([b"kv-events", b"\0" * 8, msgspec.msgpack.encode("garbage")])
        assert sub.stats.decode_errors == 1 and index.blocks("r0") == 1
        assert sub.stats.by_type == {"BlockStored": 4}
    finally:
        context.destroy(linger=0)


async def test_subscriber_receives_a_publishers_events_over_loopback() -> None:
    port = free_port()
    publisher = KvEventPublisher(f"tcp://127.0.0.1:{port}")
    context = zmq.asyncio.Context()
    index = KvIndex()
    sub = KvEventSubscriber(index, "r0", f"tcp://127.0.0.1:{port}", context, time.monotonic)
    sub.start()
    try:
        keys = block_keys([1, 2, 3, 4], 4)
        deadline = time.monotonic() + 10
        # PUB drops what it sends before the subscription reaches it (the slow-joiner): resend.
        while index.match(keys, ["r0"])["r0"] == 0:
            assert time.monotonic() < deadline, "no event arrived"
            publisher.publish([BlockStored((1,), None, (1, 2, 3, 4), 4)])
            await asyncio.sleep(0.05)
        assert sub.stats.batches >= 1 and sub.stats.last_event_at is not None
    finally:
        await sub.stop()
        publisher.close()
        context.destroy(linger=0)


class Watcher:
    def __init__(self) -> None:
        self.seen: list[str] = []
        self.links: list[tuple[str, bool]] = []

    def events_seen(self, replica_id: str) -> None:
        self.seen.append(replica_id)

    def events_link(self, replica_id: str, up: bool) -> None:
        self.links.append((replica_id, up))


async def test_the_watcher_hears_of_events_and_of_the_stream_connecting_and_dropping() -> None:
    port = free_port()
    publisher = KvEventPublisher(f"tcp://127.0.0.1:{port}")
    context = zmq.asyncio.Context()
    watcher = Watcher()
    sub = KvEventSubscriber(KvIndex(), "r0", f"tcp://127.0.0.1:{port}", context, time.monotonic, watcher)
    sub.start()
    try:
        deadline = time.monotonic() + 10
        while not watcher.seen:
            assert time.monotonic() < deadline, "no event arrived"
            publisher.publish([BlockStored((1,), None, (1, 2, 3, 4), 4)])
            await asyncio.sleep(0.05)
        assert watcher.links == [("r0", True)] and sub.linked
        publisher.close()  # the replica dies: its end of the stream closes
        while sub.linked:
            assert time.monotonic() < deadline, "the drop was not heard"
            await asyncio.sleep(0.05)
        assert watcher.links == [("r0", True), ("r0", False)]
    finally:
        await sub.stop()
        context.destroy(linger=0)


async def test_a_subscriber_without_an_index_watches_the_link_and_is_sent_no_batch() -> None:
    """A policy that reads no blocks: the stream's link is still watched, but its batches are never sent (the
    subscriber asks for none), while a subscriber with an index on the same publisher gets them."""
    port = free_port()
    publisher = KvEventPublisher(f"tcp://127.0.0.1:{port}")
    context = zmq.asyncio.Context()
    watcher, index = Watcher(), KvIndex()
    linked_only = KvEventSubscriber(None, "r0", f"tcp://127.0.0.1:{port}", context, time.monotonic, watcher)
    indexing = KvEventSubscriber(index, "r1", f"tcp://127.0.0.1:{port}", context, time.monotonic)
    linked_only.start()
    indexing.start()
    try:
        deadline = time.monotonic() + 10
        while indexing.stats.batches < 3 or not linked_only.linked:
            assert time.monotonic() < deadline, "no event arrived"
            publisher.publish([BlockStored((1,), None, (1, 2, 3, 4), 4)])
            await asyncio.sleep(0.05)
        assert watcher.links == [("r0", True)] and not watcher.seen
        assert linked_only.stats.batches == 0 and linked_only.stats.last_event_at is None
    finally:
        await linked_only.stop()
        await indexing.stop()
        publisher.close()
        context.destroy(linger=0)


def test_a_streams_liveness_is_kept_by_tcp_keepalives_not_zmtp_heartbeats() -> None:
    """A silent host (no FIN, no RST) shows as a dropped stream within about 4 s, through keepalives the
    kernel sends; ZMTP heartbeats would cost libzmq a scan of every stream's timers per beat (6% of a core
    idle at 1024 streams, docs/benchmarks/scale.md)."""
    context = zmq.asyncio.Context()
    for subscribe in (True, False):
        socket = subscriber_socket(context, subscribe)
        try:
            assert socket.getsockopt(zmq.TCP_KEEPALIVE) == 1
            found_within = socket.getsockopt(zmq.TCP_KEEPALIVE_IDLE) + socket.getsockopt(
                zmq.TCP_KEEPALIVE_INTVL
            ) * socket.getsockopt(zmq.TCP_KEEPALIVE_CNT)
            assert 0 < found_within <= 5
            assert socket.getsockopt(zmq.HEARTBEAT_IVL) == 0
        finally:
            socket.close(linger=0)
    context.term()
