"""`dpserve sim --count N`: N independent simulator replicas in one process, one event loop and one uvicorn
server (dpserve.sim.server runs it) listening on N sockets (--port + I for replica I), each connection handed to
its replica by the local port it arrived on. Each replica has its own engines, caches, metrics registry, KV-event
publishers (on one ZMQ context) and seeds; the tokenizer, which holds no state, is shared. Nothing runs per
replica while idle: an engine only waits while it has requests, gauges are read at scrape, and uvicorn's
once-a-tick housekeeping is one task for all (one server per port would be N of them).
"""

from __future__ import annotations

import contextlib
import errno
import resource
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq
from starlette.types import ASGIApp, Receive, Scope, Send

from dpserve.config import SimSettings
from dpserve.sim.replica import Simulator, build_simulator
from dpserve.sim.tokenizer import make_tokenizer

SPARE_FDS = 256
"""File descriptors kept for connections, logs and the loop, above the fleet's listening sockets."""


class FleetError(OSError):
    """The fleet cannot start: a port taken, too few file descriptors."""


def bind_ports(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` TCP sockets bound on `host`, ports `port`..`port + count - 1` (port 0: each one the OS picks),
    not yet listening; a port that cannot be bound is named in the error, and nothing stays bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bound: list[socket.socket] = []
    try:
        for index in range(count):
            wanted = port + index if port else 0
            sock = socket.socket(family, socket.SOCK_STREAM)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, wanted))
            except OSError as exc:
                why = "already in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound: {exc.strerror}"
                raise FleetError(f"port {wanted} (replica {index} of {count}) on {host} is {why}") from None
    except BaseException:
        for sock in bound:
            sock.close()
        raise
    return bound


def ensure_fds(needed: int) -> None:
    """Raise the soft limit on open files to `needed` if it is lower (up to the hard limit), or say why not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise FleetError(f"{needed} file descriptors needed, the hard limit is {hard} (ulimit -n)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


@dataclass
class Fleet:
    """The replicas, by the port each listens on (the order of `sockets`)."""

    simulators: list[Simulator]
    sockets: list[socket.socket]
    context: zmq.Context[zmq.Socket[bytes]] | None
    ports: list[int] = field(init=False)
    _owner: dict[int, Simulator] = field(init=False)
    _apps: dict[int, ASGIApp] = field(init=False, default_factory=dict)
    """Each replica's Starlette app, built on its first request (an idle replica holds none)."""

    def __post_init__(self) -> None:
        self.ports = [sock.getsockname()[1] for sock in self.sockets]
        self._owner = dict(zip(self.ports, self.simulators, strict=True))

    def close(self) -> None:
        """Close the publishers, their context and the listening sockets (uvicorn's, once it serves them)."""
        for simulator in self.simulators:
            simulator.close()
        if self.context is not None:
            self.context.term()
            self.context = None
        close_sockets(self.sockets)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app for all of them: a connection goes to the replica that owns its local port."""
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        port = (scope.get("server") or ("", 0))[1]
        app = self._apps.get(port)
        if app is None:
            app = self._apps[port] = self._replica_app(port)
        await app(scope, receive, send)

    def _replica_app(self, port: int) -> ASGIApp:
        simulator = self._owner.get(port)
        if simulator is None:
            raise RuntimeError(f"a connection on port {port}, which no replica owns")
        return simulator.api.app()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def build_fleet(settings: SimSettings) -> Fleet:
    """`--count` replicas on their ports, their KV-event publishers bound (on one ZMQ context of their own)."""
    count, engines = settings.sim_count, settings.sim_data_parallel_size
    publishers = count * engines if settings.sim_kv_events else 0
    # A listening socket per replica; a PUB socket per engine (its listener and its mailbox).
    ensure_fds(count + 2 * publishers + SPARE_FDS)
    sockets = bind_ports(settings.host, settings.port, count)
    context: zmq.Context[zmq.Socket[bytes]] | None = None
    simulators: list[Simulator] = []
    try:
        if publishers:
            context = zmq.Context()
            context.set(zmq.MAX_SOCKETS, publishers + 16)
        tokenizer = make_tokenizer(settings.sim_tokenizer)
        for index in range(count):
            simulators.append(build_simulator(settings, index, tokenizer, context))
    except BaseException:
        for simulator in simulators:
            simulator.close()
        if context is not None:
            context.term()
        close_sockets(sockets)
        raise
    return Fleet(simulators, sockets, context)


def port_span(ports: Sequence[int]) -> str:
    """`8000..8003` for consecutive ports, else every one."""
    if ports == list(range(ports[0], ports[0] + len(ports))):
        return f"{ports[0]}..{ports[-1]}" if len(ports) > 1 else str(ports[0])
    return ",".join(map(str, ports))


def close_sockets(sockets: Sequence[socket.socket]) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.close()
