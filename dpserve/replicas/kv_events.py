"""Subscribing to each replica's KV-cache events (ZMQ SUB) and feeding them into the KV index.

ZMQ reconnects on its own when a replica restarts. Every batch carries a sequence number; a jump means
batches were lost (a slow subscriber, a reconnect), and a restart shows as the numbers going back: in
both cases the index forgets that replica's blocks, since it can no longer know which are still cached.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from dpserve.background import cancel_and_wait
from dpserve.kvindex.events import EventDecodeError, decode_message
from dpserve.kvindex.index import KvIndex

log = logging.getLogger("dpserve.kv_events")

RECONNECT_MIN_MS = 100
RECONNECT_MAX_MS = 2000
RECEIVE_HWM = 100_000


def parse_kv_event_source(text: str) -> tuple[str, str]:
    """`REPLICA_URL=tcp://HOST:PORT` -> (replica URL, ZMQ endpoint)."""
    url, sep, endpoint = text.rpartition("=")
    if not sep or not url or not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"--kv-events wants REPLICA_URL=tcp://HOST:PORT, got {text!r}")
    return url.rstrip("/"), endpoint


def engine_endpoint(endpoint: str, rank: int | None) -> str:
    """Where engine `rank` of a data-parallel server publishes, given the server's `--kv-events-config`
    endpoint: vLLM adds the rank to a TCP port and `_dp{rank}` to an inproc name (rank 0 keeps it)."""
    if not rank:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    base, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit() and int(port):
        return f"{base}:{int(port) + rank}"
    return endpoint


class SequenceCheck(enum.Enum):
    FIRST = "first"
    NEXT = "next"
    GAP = "gap"
    RESTART = "restart"


@dataclass
class SequenceTracker:
    last: int | None = None
    missed: int = 0
    """Batches known lost, over all gaps."""

    def observe(self, sequence: int) -> SequenceCheck:
        previous, self.last = self.last, sequence
        if previous is None:
            return SequenceCheck.FIRST
        if sequence == previous + 1:
            return SequenceCheck.NEXT
        if sequence <= previous:
            return SequenceCheck.RESTART
        self.missed += sequence - previous - 1
        return SequenceCheck.GAP


@dataclass
class SubscriberStats:
    batches: int = 0
    events: int = 0
    gaps: int = 0
    restarts: int = 0
    decode_errors: int = 0
    last_event_at: float | None = None
    by_type: dict[str, int] = field(default_factory=dict)


class KvEventSubscriber:
    """One replica's event stream, applied to the shared index on the event loop (no locks needed)."""

    def __init__(
        self,
        index: KvIndex,
        replica_id: str,
        endpoint: str,
        context: zmq.asyncio.Context,
        clock: Callable[[], float],
    ) -> None:
        self.replica_id = replica_id
        self.endpoint = endpoint
        self.stats = SubscriberStats()
        self._index = index
        self._context = context
        self._clock = clock
        self._tracker = SequenceTracker()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.replica_id}")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    def handle(self, frames: list[bytes]) -> None:
        """Apply one multipart message (public so tests can drive it without a socket)."""
        try:
            batch = decode_message(frames)
        except EventDecodeError as exc:
            self.stats.decode_errors += 1
            log.warning("replica %s sent an undecodable KV-event message: %s", self.replica_id, exc)
            return
        check = self._tracker.observe(batch.sequence)
        if check in (SequenceCheck.GAP, SequenceCheck.RESTART):
            if check is SequenceCheck.GAP:
                self.stats.gaps += 1
            else:
                self.stats.restarts += 1
            log.warning(
                "KV events from replica %s: %s at #%d; forgetting its blocks",
                self.replica_id,
                check.value,
                batch.sequence,
            )
            self._index.clear(self.replica_id)
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        for event in batch.events:
            name = type(event).__name__
            self.stats.by_type[name] = self.stats.by_type.get(name, 0) + 1
        self.stats.last_event_at = self._clock()
        self._index.apply(self.replica_id, batch.events)

    @property
    def missed_batches(self) -> int:
        return self._tracker.missed

    async def _run(self) -> None:
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        socket.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MIN_MS)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(self.endpoint)
        try:
            while True:
                frames = await socket.recv_multipart()
                self.handle(frames)
        finally:
            socket.close(linger=0)
