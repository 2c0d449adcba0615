"""Subscribing to each replica's KV-cache events (ZMQ SUB) and feeding them into the KV index.

ZMQ reconnects on its own when a replica restarts. Every batch carries a sequence number; a jump means
batches were lost (a slow subscriber, a reconnect), and a restart shows as the numbers going back: in
both cases the index forgets that replica's blocks, since it can no longer know which are still cached.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import zmq
import zmq.asyncio
import zmq.utils.monitor

from dpserve.background import CpuMeter, cancel_and_wait
from dpserve.kvindex.events import EventDecodeError, decode_message
from dpserve.kvindex.index import KvIndex

log = logging.getLogger("dpserve.kv_events")

RECONNECT_MIN_MS = 100
RECONNECT_MAX_MS = 2000
RECEIVE_HWM = 100_000
KEEPALIVE_IDLE_S = 2
KEEPALIVE_INTERVAL_S = 1
KEEPALIVE_PROBES = 2
"""TCP keepalives, answered by the replica's kernel: a replica whose host went silent (no FIN, no RST) shows as a
dropped stream within about 4 s of its last packet. Not ZMTP heartbeats: libzmq cancels a heartbeat's timeout
with a scan of every timer of its I/O thread, so 1024 streams beating each second took 6% of a core idle."""
LINK_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
POLLIN = int(zmq.POLLIN)


SOCKETS_PER_STREAM = 3
"""A subscriber's SUB socket and its monitor's pair (`_run`)."""
SPARE_SOCKETS = 16384
"""Room for replicas added at run time (discovery, the admin API) over those known at start."""


def events_context(streams: int) -> zmq.asyncio.Context:
    """The router's ZMQ context, sized for `streams` KV-event streams and more added later: libzmq's
    default of 1023 sockets could not open the 1024th replica's subscriber, and each stream takes
    SOCKETS_PER_STREAM. The soft limit on open files is raised as far as the hard one allows (a socket
    is an eventfd, a stream's connection one more)."""
    context = zmq.asyncio.Context()
    context.set(zmq.MAX_SOCKETS, SOCKETS_PER_STREAM * streams + SPARE_SOCKETS)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 5 * streams + 1024  # the streams' sockets and connections, the probes', the clients'
    if soft != resource.RLIM_INFINITY and soft < wanted:
        ceiling = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
        if ceiling < wanted:
            log.warning(
                "%d open files may be needed for %d KV-event streams; the hard limit is %d", wanted, streams, hard
            )
    return context


def subscriber_socket(context: zmq.asyncio.Context, subscribe: bool) -> zmq.asyncio.Socket:
    """A SUB socket for one stream, not yet connected. Without `subscribe` the publisher sends nothing on it
    (ZMQ filters at its end): only its link is watched."""
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
    socket.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MIN_MS)
    socket.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
    socket.setsockopt(zmq.TCP_KEEPALIVE, 1)
    socket.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    socket.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
    socket.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)
    if subscribe:
        socket.setsockopt(zmq.SUBSCRIBE, b"")
    return socket


class EventWatcher(Protocol):
    """Who hears, besides the index, of a replica's stream: that events came (work on it), and that the
    connection came up or dropped (a replica that dies drops it at once)."""

    def events_seen(self, replica_id: str) -> None: ...

    def events_link(self, replica_id: str, up: bool) -> None: ...


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
    """One replica's event stream, applied to the shared index on the event loop (no locks needed). With no
    index (a policy that reads no blocks), only the stream's link is watched: no batch is sent to it."""

    def __init__(
        self,
        index: KvIndex | None,
        replica_id: str,
        endpoint: str,
        context: zmq.asyncio.Context,
        clock: Callable[[], float],
        watcher: EventWatcher | None = None,
        cpu: CpuMeter | None = None,
    ) -> None:
        """`cpu`: what reading and applying the events costs (all the router's subscribers share one)."""
        self.replica_id = replica_id
        self.linked = False
        self.endpoint = endpoint
        self.stats = SubscriberStats()
        self._index = index
        self._context = context
        self._clock = clock
        self._tracker = SequenceTracker()
        self._watcher = watcher
        self._cpu = cpu or CpuMeter()
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
            if self._index is not None:
                self._index.clear(self.replica_id)
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        for event in batch.events:
            name = type(event).__name__
            self.stats.by_type[name] = self.stats.by_type.get(name, 0) + 1
        self.stats.last_event_at = self._clock()
        if self._index is not None:
            self._index.apply(self.replica_id, batch.events)
        if self._watcher is not None:
            self._watcher.events_seen(self.replica_id)

    @property
    def missed_batches(self) -> int:
        return self._tracker.missed

    async def _run(self) -> None:
        socket = subscriber_socket(self._context, subscribe=self._index is not None)
        links = socket.get_monitor_socket(LINK_EVENTS) if self._watcher is not None else None
        watching = asyncio.create_task(self._watch_link(links)) if links is not None else None
        socket.connect(self.endpoint)
        # Read through a plain view of the same socket, woken by its file descriptor: pyzmq's asyncio reads
        # cost a future, an enum flag test and a reader re-armed per message (~100 µs of the router's CPU
        # per message where one comes per request); this reads every waiting message in one call.
        plain: zmq.Socket[bytes] = zmq.Socket.shadow(socket.underlying)
        descriptor = int(plain.getsockopt(zmq.FD))
        loop = asyncio.get_running_loop()
        loop.add_reader(descriptor, self._drain_metered, plain)
        try:
            self._drain(plain)  # what came before the reader was added
            await loop.create_future()  # until cancelled
        finally:
            loop.remove_reader(descriptor)
            await cancel_and_wait(watching)
            if links is not None:
                socket.disable_monitor()
                links.close(linger=0)
            socket.close(linger=0)

    def _drain_metered(self, plain: zmq.Socket[bytes]) -> None:
        with self._cpu.measuring():
            self._drain(plain)

    def _drain(self, plain: zmq.Socket[bytes]) -> None:
        """Every message waiting. The descriptor signals edges only: reading until none is left (EVENTS says
        so) is what lets it signal the next message."""
        while int(plain.getsockopt(zmq.EVENTS)) & POLLIN:
            try:
                frames = plain.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle(frames)

    async def _watch_link(self, links: zmq.asyncio.Socket) -> None:
        """The stream's connection as libzmq reports it: up on connect, down on a close or a missed heartbeat."""
        while True:
            event = zmq.utils.monitor.parse_monitor_message(await links.recv_multipart())
            up = event["event"] == zmq.EVENT_CONNECTED
            if up == self.linked:
                continue
            self.linked = up
            if not up:
                log.info("KV-event stream of replica %s dropped", self.replica_id)
            if self._watcher is not None:
                self._watcher.events_link(self.replica_id, up)
