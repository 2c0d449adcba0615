"""Carrying updates between routers (`--peer`, `--discover-peers`, `--workers`).

Transport: each router serves `GET /admin/peer/stream`, one long HTTP/1.1 response of length-prefixed
msgpack frames (peers/wire.py), and follows every peer's stream with one such request. It uses the router's
own port and admin key (nothing more to open, secure or route through a load balancer), and it is off the
request path: a request only appends its route to a bounded outbox (recent.py, bindings.py) and wakes one
task, which turns the outboxes and the in-flight counts into one update, encoded once for every follower:
routes and bindings go out at once (at most one update per `NEWS_GAP_S`), changed in-flight counts within
`interval_s`. Without news
an update still goes out every `HEARTBEAT_S`, so a silent link means a dead peer.

Workers of one host (`--workers`) follow each other on private loopback ports. A router on another host
that follows this host's shared port reaches one worker, chosen by the kernel; that worker relays its
siblings' updates to it (`relay=1`), so every worker of every host is heard through one link per router.

A router serving HTTPS (`--ssl-certfile`) follows the peers it discovers over HTTPS: found by address, each is
checked for the name it was found by (the peers' Service: their certificate names it, as it cannot name a pod's
address), against the router's `--ssl-ca-certs` (else the system's CAs), and shown the router's own certificate
should it ask for one. A `--peer https://...` is checked for its URL's host, against the same CAs.

A starting router loads a peer's snapshot (`GET /admin/peer/snapshot`: its KV index and recent routes)
before it serves, so a restart does not scatter prefixes that its peers are keeping together.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dpserve.background import CpuMeter, cancel_and_wait
from dpserve.replicas.discovery import DiscoveryError, DiscoverySource, DnsResolver
from dpserve.replicas.monitor import ReplicaMonitor
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.peers.board import PeerBoard
from dpserve.router.peers.wire import (
    SNAPSHOT_MAX_BYTES,
    PeerWireError,
    decode_snapshot,
    decode_update,
    encode_snapshot,
    encode_update,
    frame,
    frame_length,
)
from dpserve.router.scale.held import Held

log = logging.getLogger("dpserve.peers")

STREAM_PATH = "/admin/peer/stream"
SNAPSHOT_PATH = "/admin/peer/snapshot"
HEARTBEAT_S = 0.5
FOLLOWER_QUEUE = 1024
"""Frames a follower may lag behind; past it the follower is cut off (it reconnects and catches up:
counts are whole in every update, routes lost meanwhile only cost some cache hits)."""
NEWS_GAP_S = 0.002
RETRY_MIN_S = 0.1
RETRY_MAX_S = 2.0


@dataclass
class Follower:
    """A peer following this router's stream."""

    origin: str
    relay: bool
    """Also send it what this router's sibling workers say (it is on another host)."""
    frames: asyncio.Queue[bytes | None] = field(default_factory=lambda: asyncio.Queue(FOLLOWER_QUEUE))
    cut: bool = False

    def offer(self, data: bytes) -> None:
        if self.cut:
            return
        try:
            self.frames.put_nowait(data)
        except asyncio.QueueFull:
            self.end()

    def end(self, last: bytes | None = None) -> None:
        """No more frames: its stream ends, after `last` if given (frames still queued are dropped)."""
        self.cut = True
        while not self.frames.empty():
            self.frames.get_nowait()
        if last is not None:
            self.frames.put_nowait(last)
        self.frames.put_nowait(None)


@dataclass
class Link:
    """This router following one peer's stream."""

    url: str
    sibling: bool
    static: bool
    state: str = "connecting"
    """connecting, up, down, self (the URL is this router: found by DNS)."""
    updates: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    last_error: str | None = None
    task: asyncio.Task[None] | None = None
    server_name: str | None = None
    """The name its certificate is checked for when not its URL's host: the DNS name it was found by."""

    def failed(self, kind: str, detail: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        self.last_error = detail


class PeerLinks:
    def __init__(
        self,
        board: PeerBoard,
        *,
        peers: Sequence[str] = (),
        siblings: Sequence[str] = (),
        sources: Sequence[DiscoverySource] = (),
        resolver: DnsResolver | None = None,
        interval_s: float = 0.05,
        timeout_s: float = 2.0,
        discover_interval_s: float = 5.0,
        admin_key: bytes | None = None,
        on_suspect: Callable[[str], None] = lambda rid: None,
        max_snapshot_blocks: int = 2_000_000,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """`tls`: this router serves HTTPS (peer_tls): discovered peers are followed over HTTPS, and every
        https:// peer is verified with it."""
        self.board = board
        self._tls = tls
        self._session: aiohttp.ClientSession | None = None
        self._draining = False
        self._news = asyncio.Event()
        self._counts = asyncio.Event()
        self._sources = list(sources)
        self._resolver = resolver
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._heartbeat_s = min(HEARTBEAT_S, timeout_s / 4)
        self._discover_interval_s = discover_interval_s
        self._headers = {"authorization": f"Bearer {admin_key.decode()}"} if admin_key else {}
        self.on_suspect = on_suspect
        self._max_snapshot_blocks = max_snapshot_blocks
        self._links: dict[str, Link] = {}
        for url in siblings:
            self._links[url.rstrip("/")] = Link(url.rstrip("/"), sibling=True, static=True)
        for url in peers:
            self._links.setdefault(url.rstrip("/"), Link(url.rstrip("/"), sibling=False, static=True))
        self._followers: list[Follower] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self.warm_start: dict[str, Any] | None = None
        self.frames_sent = 0
        self.followers_cut = 0
        self._falls_timer: asyncio.TimerHandle | None = None
        self._falls_due = 0.0
        self.cpu = CpuMeter()
        """Publishing this router's updates, following the peers' (the streams served to them are requests)."""

    @property
    def enabled(self) -> bool:
        return bool(self._links or self._sources)

    # -- serving followers ---------------------------------------------------------------------------

    def follow(self, origin: str, relay: bool) -> Follower | None:
        """A peer starts following this router; None when `origin` is this router itself."""
        if origin == self.board.origin:
            return None
        follower = Follower(origin, relay)
        self._followers.append(follower)
        return follower

    async def frames(self, follower: Follower) -> AsyncIterator[bytes]:
        """What the follower's stream sends: this router's current update at once, then every update."""
        try:
            yield encode_update(self.board.update(news=False))
            while True:
                data = await follower.frames.get()
                if data is None:
                    if not self._draining:
                        log.warning("peer %s fell behind this router's updates: cut off", follower.origin)
                        self.followers_cut += 1
                    return
                yield data
        finally:
            with contextlib.suppress(ValueError):
                self._followers.remove(follower)

    async def snapshot(self) -> bytes:
        snapshot = self.board.snapshot()
        return await asyncio.to_thread(encode_snapshot, snapshot)

    def _send(self, data: bytes, relayed_from: str | None = None) -> None:
        for follower in self._followers:
            if relayed_from is None:
                follower.offer(data)
            elif follower.relay and follower.origin != relayed_from:
                follower.offer(data)

    # -- lifecycle -----------------------------------------------------------------------------------

    def use_admin_key(self, admin_key: bytes | None) -> None:
        """The key sent to peers from the next connection on (the admin key file changed)."""
        self._headers = {"authorization": f"Bearer {admin_key.decode()}"} if admin_key else {}

    @property
    def tls(self) -> ssl.SSLContext | None:
        return self._tls

    def attach(self, session: aiohttp.ClientSession) -> None:
        """The HTTP client it follows peers and fetches snapshots with (the app's control-plane session)."""
        self._session = session

    def drain(self) -> None:
        """SIGTERM: followers hear goodbye and their streams end, so the server's drain is not held up by
        them (peers then forget this router's in-flight requests while they finish)."""
        self._draining = True
        goodbye = encode_update(self.board.update(leaving=True))
        for follower in list(self._followers):
            follower.end(goodbye)

    def start(self) -> None:
        self._started = True
        self._tasks.append(asyncio.create_task(self.cpu.run(self._publish()), name="peer-updates"))
        for link in self._links.values():
            self._start_link(link)
        if self._sources and self._resolver is not None:
            self._tasks.append(asyncio.create_task(self.cpu.run(self._discover()), name="peer-discovery"))

    async def stop(self) -> None:
        """Says goodbye to followers (they forget this router at once), then stops following."""
        if not self._draining:
            self.drain()
        await asyncio.sleep(0)  # the goodbye frames reach the streams' buffers
        if self._falls_timer is not None:
            self._falls_timer.cancel()
        for task in [*self._tasks, *(link.task for link in self._links.values() if link.task is not None)]:
            await cancel_and_wait(task)

    def news(self) -> None:
        """A route or a binding was just made: peers hear of it at once (a burst of requests for a new
        prefix reaches several routers within milliseconds), not at the next interval."""
        self._news.set()

    def counts_changed(self) -> None:
        """This router's in-flight count of a replica changed: peers hear of it within `interval_s`, or at once
        while they may be taking the same freed slots (the board's `contested`)."""
        if self.board.contested():
            self._news.set()
        elif not self._counts.is_set():
            self._counts.set()

    def _believe_falls_when_due(self) -> None:
        """Wakes the board when the next fall it holds is due (the registry then tells waiters of the room)."""
        due = self.board.next_fall_at()
        if due is None or (self._falls_timer is not None and self._falls_due <= due):
            return
        if self._falls_timer is not None:
            self._falls_timer.cancel()
        self._falls_due = due
        self._falls_timer = asyncio.get_running_loop().call_later(max(0.0, due - self.board.now()), self._falls_due_now)

    def _falls_due_now(self) -> None:
        self._falls_timer = None
        self.board.believe_falls()
        self._believe_falls_when_due()

    async def _wake(self) -> None:
        """Until news (at once), a changed count (then `interval_s` more, to batch them) or the heartbeat is
        due: an idle router wakes twice a second, not every interval, whatever the fleet's size."""
        news, counts = asyncio.ensure_future(self._news.wait()), asyncio.ensure_future(self._counts.wait())
        try:
            await asyncio.wait((news, counts), timeout=self._heartbeat_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            news.cancel()
            counts.cancel()
        if self._counts.is_set() and not self._news.is_set():
            await asyncio.sleep(self._interval_s)

    async def _publish(self) -> None:
        last: tuple[dict[str, int], tuple[str, ...], tuple[tuple[str, Held], ...]] | None = None
        last_sent = 0.0
        while True:
            await self._wake()
            # Decisions made in this turn of the loop join this update. At most one update per NEWS_GAP_S:
            # a quiet router's news goes at once (a group's next prompt may reach a peer a millisecond
            # later), a busy one's is batched, so the cost per request stays an append to the outbox.
            await asyncio.sleep(max(0.0, NEWS_GAP_S - (time.monotonic() - last_sent)))
            self._news.clear()
            self._counts.clear()
            self.board.expire()
            self._believe_falls_when_due()
            update = self.board.update()
            shape = (update.in_flight, update.unhealthy, update.held)
            now = time.monotonic()
            news = update.routes or update.bindings or update.usage or shape != last
            if self._draining or not self._followers or (not news and now - last_sent < self._heartbeat_s):
                continue
            last, last_sent = shape, now
            self._send(encode_update(update))
            self.frames_sent += 1

    # -- following peers -----------------------------------------------------------------------------

    def _start_link(self, link: Link) -> None:
        link.task = asyncio.create_task(self.cpu.run(self._follow(link)), name=f"peer-{link.url}")

    async def _follow(self, link: Link) -> None:
        delay = RETRY_MIN_S
        params = {"origin": self.board.origin, "relay": "0" if link.sibling else "1"}
        timeout = aiohttp.ClientTimeout(total=None, connect=self._timeout_s, sock_read=self._timeout_s)
        assert self._session is not None
        while True:
            try:
                async with self._session.get(
                    link.url + STREAM_PATH,
                    params=params,
                    headers=self._headers,
                    timeout=timeout,
                    **self._tls_options(link.url, link.server_name),
                ) as resp:
                    if resp.status == 409:
                        link.state = "self"
                        log.info("peer %s is this router: not followed", link.url)
                        return
                    if resp.status != 200:
                        raise PeerWireError(f"{STREAM_PATH} answered {resp.status}")
                    link.state = "up"
                    delay = RETRY_MIN_S
                    await self._read(link, resp.content)
            except PeerWireError as exc:
                link.failed("protocol", str(exc))
                log.warning("peer %s: %s; following it again later", link.url, exc)
            except (aiohttp.ClientError, TimeoutError, asyncio.IncompleteReadError, OSError) as exc:
                link.failed("silent" if isinstance(exc, TimeoutError) else "connection", _describe(exc))
            finally:
                if link.state != "self":
                    link.state = "down"
                self.board.link_lost(link.url)
                self._believe_falls_when_due()
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    async def _read(self, link: Link, content: aiohttp.StreamReader) -> None:
        while True:
            prefix = await content.readexactly(4)
            payload = await content.readexactly(frame_length(prefix))
            update = decode_update(payload)
            link.updates += 1
            for replica_id in self.board.apply(update, link.url):
                self.on_suspect(replica_id)
            self._believe_falls_when_due()
            if link.sibling:
                self._send(frame(payload), relayed_from=update.origin)

    async def _discover(self) -> None:
        assert self._resolver is not None
        while True:
            found: dict[str, str] = {}
            for source in self._sources:
                try:
                    found |= await self._discovered(source)
                except DiscoveryError as exc:
                    log.warning("peer discovery %s: %s", source, exc)
                    # Keep what we had.
                    found |= {url: link.server_name or "" for url, link in self._links.items() if not link.static}
            for url in found.keys() - set(self._links):
                link = self._links[url] = Link(url, sibling=False, static=False, server_name=found[url] or None)
                self._start_link(link)
            for url in [u for u, link in self._links.items() if not link.static and u not in found]:
                link = self._links.pop(url)
                await cancel_and_wait(link.task)
            await asyncio.sleep(self._discover_interval_s)

    async def _discovered(self, source: DiscoverySource) -> dict[str, str]:
        """The peers `source` names now, by URL, each with the name its certificate is checked for: over
        HTTPS when this router serves it (its peers, run alike, do too)."""
        assert self._resolver is not None
        urls = await self._resolver.replica_urls(source)
        if self._tls is None:
            return dict.fromkeys(urls, "")
        return {"https://" + url.removeprefix("http://"): source.name for url in urls}

    def _tls_options(self, url: str, server_name: str | None) -> dict[str, Any]:
        """aiohttp's options for a request to a peer: this router's context for an https:// one, checked
        for `server_name` where given."""
        if self._tls is None or not url.startswith("https://"):
            return {}
        return {"ssl": self._tls, **({"server_hostname": server_name} if server_name else {})}

    # -- warm start ----------------------------------------------------------------------------------

    async def load_from_a_peer(self, timeout_s: float) -> dict[str, Any] | None:
        """Before serving: the first peer's snapshot that arrives in time is loaded. None when no peer
        answered (this router is the first, or alone): it starts cold, as a router without peers does."""
        urls = {url: link.server_name for url, link in self._links.items()}
        for source in self._sources:
            if self._resolver is not None:
                with contextlib.suppress(DiscoveryError):
                    urls = {**await self._discovered(source), **urls}
        if not urls:
            return None
        started = time.monotonic()
        tries = [asyncio.create_task(self._fetch_snapshot(url, name, timeout_s)) for url, name in urls.items()]
        try:
            for next_done in asyncio.as_completed(tries, timeout=timeout_s):
                with contextlib.suppress(Exception):
                    url, payload = await next_done
                    snapshot = await asyncio.to_thread(decode_snapshot, payload, self._max_snapshot_blocks)
                    blocks, routes = self.board.load(snapshot)
                    self.warm_start = {
                        "from": url,
                        "kv_blocks": blocks,
                        "recent_routes": routes,
                        "seconds": round(time.monotonic() - started, 3),
                    }
                    log.info("warm start from peer %s: %d KV blocks, %d recent routes", url, blocks, routes)
                    return self.warm_start
        except TimeoutError:
            log.warning("warm start: no peer's snapshot within %.1f s; starting cold", timeout_s)
        finally:
            for task in tries:
                task.cancel()
        return None

    async def _fetch_snapshot(self, url: str, server_name: str | None, timeout_s: float) -> tuple[str, bytes]:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        params = {"origin": self.board.origin}
        tls = self._tls_options(url, server_name)
        async with self._session.get(
            url + SNAPSHOT_PATH, params=params, headers=self._headers, timeout=timeout, **tls
        ) as resp:
            if resp.status != 200:
                raise PeerWireError(f"{SNAPSHOT_PATH} answered {resp.status}")
            if (resp.content_length or 0) > SNAPSHOT_MAX_BYTES:
                raise PeerWireError("snapshot too large")
            return url, await resp.content.read(SNAPSHOT_MAX_BYTES + 1)

    # -- what /status and /metrics show --------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            **self.board.status(),
            "links": [
                {
                    "url": link.url,
                    "sibling": link.sibling,
                    "state": link.state,
                    "updates": link.updates,
                    "errors": dict(link.errors),
                    "last_error": link.last_error,
                }
                for link in self._links.values()
            ],
            "followers": len(self._followers),
            "warm_start": self.warm_start,
        }

    @property
    def links(self) -> list[Link]:
        return list(self._links.values())


class SuspectChecks:
    """A peer says a replica this router still routes to is unhealthy: probe it now, as many times in a row
    as ejecting takes, rather than wait for the next ticks. This router's own probes decide: a peer's word
    alone never ejects a replica."""

    GAP_S = 0.1

    def __init__(self, registry: ReplicaRegistry, monitor: ReplicaMonitor, probes: int, min_gap_s: float) -> None:
        self._registry = registry
        self._monitor = monitor
        self._probes = probes
        self._min_gap_s = min_gap_s
        self._last: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __call__(self, replica_id: str) -> None:
        now = time.monotonic()
        if now - self._last.get(replica_id, -self._min_gap_s) < self._min_gap_s:
            return
        self._last[replica_id] = now
        task = asyncio.create_task(self._check(replica_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _check(self, replica_id: str) -> None:
        for attempt in range(self._probes):
            replica = self._registry.find(replica_id)
            if replica is None or not replica.healthy:
                return
            if attempt:
                await asyncio.sleep(self.GAP_S)
            await self._monitor.probe_now(replica)
            if replica.health.probe_failures == 0:
                return  # it answered: the peer's view was stale or its own


class PeerCollector(Collector):
    """dpserve_peer_* series, read from the links and the board at scrape time."""

    def __init__(self, links: PeerLinks) -> None:
        self._links = links

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        links, stats = self._links, self._links.board.stats
        known = GaugeMetricFamily("dpserve_peers", "Peer routers (and workers) heard from within the timeout")
        known.add_metric([], len(links.board.origins))
        yield known
        up = GaugeMetricFamily("dpserve_peer_links_up", "Peer streams this router follows that are up")
        up.add_metric([], sum(1 for link in links.links if link.state == "up"))
        yield up
        updates = CounterMetricFamily("dpserve_peer_updates", "Peer updates applied")
        updates.add_metric([], stats.updates)
        yield updates
        stale = CounterMetricFamily("dpserve_peer_stale_updates", "Peer updates dropped as old or out of order")
        stale.add_metric([], stats.stale)
        yield stale
        errors = CounterMetricFamily("dpserve_peer_link_errors", "Peer streams that ended badly", labels=["kind"])
        totals: dict[str, int] = {}
        for link in links.links:
            for kind, count in link.errors.items():
                totals[kind] = totals.get(kind, 0) + count
        for kind, count in sorted(totals.items()):
            errors.add_metric([kind], count)
        yield errors
        forgotten = CounterMetricFamily("dpserve_peers_forgotten", "Peers forgotten, by why", labels=["why"])
        for why, count in sorted(stats.forgotten.items()):
            forgotten.add_metric([why], count)
        yield forgotten
        sent = CounterMetricFamily("dpserve_peer_frames_sent", "Updates this router sent to its followers")
        sent.add_metric([], links.frames_sent)
        yield sent


def peer_tls(ca_certs: Path | None, certfile: Path | None, keyfile: Path | None) -> ssl.SSLContext | None:
    """How a router serving HTTPS (`certfile`) reaches its peers: their certificates verified against
    `ca_certs` (else the system's CAs), its own shown to a peer that asks for one. None without `certfile`."""
    if certfile is None:
        return None
    context = ssl.create_default_context(cafile=str(ca_certs) if ca_certs else None)
    context.load_cert_chain(certfile, keyfile)
    return context


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
