"""Running the router app under uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import multiprocessing
import os
import signal
import socket
import ssl
import sys
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from types import FrameType

import prometheus_client
import uvicorn

from dpserve.config import RouterSettings
from dpserve.router.app import create_app
from dpserve.router.control.shutdown import Shutdown
from dpserve.router.flow.access import check_bind, load_keys
from dpserve.router.http.protocol import bounded_protocol
from dpserve.router.http.proxied_paths import is_proxied
from dpserve.router.observe import logs

log = logging.getLogger("dpserve.router")

WORKER_RESTART_DELAY_S = 1.0
GC_YOUNG_THRESHOLD = 20_000


def serve_router(
    settings: RouterSettings, sockets: list[socket.socket] | None = None, sibling_socket: socket.socket | None = None
) -> int:
    """Serves until stopped; 2 with one line on stderr when the settings are wrong. `sockets`: a worker's shared
    port and `sibling_socket` its private one (see `serve_workers`), already bound; otherwise it binds
    `settings.host` and `settings.port`."""
    log_config = logs.configure(settings.log_format, settings.log_level)
    logging.getLogger("uvicorn.access").addFilter(_not_proxied)
    if settings.workers > 1 and sockets is None:
        return serve_workers(settings)
    # Process-wide switch (hence here, not in the app factory): no `*_created` series per counter.
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated upstream
    try:
        keys = load_keys(settings)
        check_bind(settings.host, keys, settings.insecure)
        check_tls_files(settings)
        app = create_app(settings, keys=keys)
    except ValueError as exc:  # a bad --replica, --kv-events, --tokenizer, key or TLS file, or an unsafe bind
        print(f"dpserve router: {exc}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=bounded_protocol(settings.max_header_bytes, app.proxied()),
        # Nothing in the router reads the client's address, so uvicorn's X-Forwarded-For rewrite (a middleware
        # around every request, 1.2% of a JSON request's CPU measured) is left out.
        proxy_headers=False,
        # HTTPS only on the port clients use, when given a certificate (`check_tls_files` read them already).
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
        ssl_ca_certs=settings.ssl_ca_certs,
        ssl_cert_reqs=settings.ssl_cert_reqs,
        access_log=settings.access_log,
        log_level=settings.log_level,
        log_config=log_config,
        # On SIGTERM uvicorn stops listening at once, then requests in flight (streams too) get this
        # long to finish before they are cut.
        # (uvicorn hints int; it hands the value to asyncio.wait_for, which takes seconds as a float.)
        timeout_graceful_shutdown=settings.shutdown_grace_s,  # type: ignore[arg-type]
    )
    config.load()  # here, not in `run`: the TLS context it makes is the one a changed certificate is loaded into
    app.state.adopt_server_tls(config.ssl)
    shutdown: Shutdown = app.state.shutdown
    server = DrainingServer(config, lambda: shutdown.begin_drain(settings.shutdown_grace_s), sibling_socket)
    server.run(sockets=sockets)
    return 0


def check_tls_files(settings: RouterSettings) -> None:
    """Reads the TLS files once before serving, so a missing or unreadable one is one line at start rather
    than a traceback (from every worker)."""
    if settings.ssl_certfile is None:
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(settings.ssl_certfile, settings.ssl_keyfile)
    except OSError as exc:  # ssl.SSLError too
        raise ValueError(f"--ssl-certfile {settings.ssl_certfile}: cannot load it (and its key): {exc}") from None
    if settings.ssl_ca_certs is None:
        return
    try:
        context.load_verify_locations(settings.ssl_ca_certs)
    except OSError as exc:
        raise ValueError(f"--ssl-ca-certs {settings.ssl_ca_certs}: cannot load it: {exc}") from None
    if settings.ssl_cert_reqs == ssl.CERT_NONE:
        log.warning("--ssl-ca-certs without --ssl-cert-reqs 1 or 2: clients are not asked for certificates")


def _not_proxied(record: logging.LogRecord) -> bool:
    """uvicorn's access line, for the router's own paths only: a relayed request's line is the router's
    (`dpserve.access`), with its id. uvicorn's args: client, method, path and query, HTTP version, status."""
    args = record.args
    if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
        return not is_proxied(args[2].partition("?")[0])
    return True


def serve_workers(settings: RouterSettings) -> int:
    """`--workers N`: N router processes, each with its own socket on the one port (SO_REUSEPORT: the kernel
    spreads connections over them) and a private loopback port its sibling workers follow it on, as peers
    follow each other. A worker that dies is started again (it warms from its siblings); SIGTERM drains them
    all."""
    if settings.port == 0:
        print("dpserve router: --workers needs a fixed --port", file=sys.stderr)
        return 2
    try:
        keys = load_keys(settings)
        check_bind(settings.host, keys, settings.insecure)
        check_tls_files(settings)
        create_app(settings, keys=keys)  # every setting checked once, here, rather than in N workers
        reuse_port_socket(settings.host, settings.port).close()
    except (ValueError, OSError) as exc:
        print(f"dpserve router: {exc}", file=sys.stderr)
        return 2
    private_ports = [free_loopback_port() for _ in range(settings.workers)]
    urls = [f"http://127.0.0.1:{port}" for port in private_ports]
    spawn = multiprocessing.get_context("spawn")

    def launch(index: int) -> BaseProcess:
        siblings = tuple(url for other, url in enumerate(urls) if other != index)
        worker = dataclasses.replace(settings, workers=1, peer_siblings=siblings)
        process = spawn.Process(
            target=run_worker, args=(worker, private_ports[index]), name=f"dpserve-router-worker-{index}"
        )
        process.start()
        return process

    workers = [launch(index) for index in range(settings.workers)]
    log.info("router: %d workers on %s:%d", settings.workers, settings.host, settings.port)
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for process in workers:
            if process.pid is not None and process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping:
        time.sleep(0.2)
        for index, process in enumerate(workers):
            if not process.is_alive() and not stopping:
                log.warning("router worker %d exited (%s); starting it again", index, process.exitcode)
                time.sleep(WORKER_RESTART_DELAY_S)
                workers[index] = launch(index)
    deadline = time.monotonic() + settings.shutdown_grace_s + 10
    for process in workers:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
    return 0


def run_worker(settings: RouterSettings, private_port: int) -> None:
    """One worker process: the shared port, and its private port for its siblings."""
    shared = reuse_port_socket(settings.host, settings.port)
    sys.exit(serve_router(settings, [shared], reuse_port_socket("127.0.0.1", private_port)))


def reuse_port_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the app when a shutdown begins (uvicorn itself tells it only once
    every connection has closed, too late to end streams properly)."""

    def __init__(
        self, config: uvicorn.Config, on_drain: Callable[[], None], sibling_socket: socket.socket | None = None
    ) -> None:
        super().__init__(config)
        self._on_drain = on_drain
        self._sibling_socket = sibling_socket

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self._sibling_socket is not None:
            await self._listen_for_siblings(self._sibling_socket)
        # Everything built so far (libraries, the app, its indexes' containers) lives as long as the
        # process: out of the collector's sight, its full collections cost microseconds, not the 60-80 ms
        # measured here that would stall every request in flight.
        gc.freeze()
        # A request leaves its objects to reference counting (no cycles on the hot path), yet each allocates
        # dozens: at the default threshold (700) a young collection ran every few requests, 4.8% of a JSON
        # request's CPU (py-spy). Cycles that do form are still collected, a few hundred requests later.
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])

    async def _listen_for_siblings(self, sock: socket.socket) -> None:
        """A worker's private port, where its sibling workers read it (peer updates, `/metrics?scope=worker`):
        plain HTTP, whatever the shared port speaks. It is bound to loopback, so only this host's own processes
        reach it and nothing on it crosses a network; TLS there would need a certificate valid for 127.0.0.1
        and, with client certificates required, one for the workers themselves, for no protection loopback
        lacks. It is the same app, so the keys hold on it (siblings send the admin key); a router whose only
        credential is the client certificate leaves it open to this host's users, as every loopback port."""
        config = self.config

        def protocol() -> asyncio.Protocol:
            # As uvicorn's own startup makes one per connection, sharing the server's state (connections
            # drained on shutdown) and the app's.
            return config.http_protocol_class(  # type: ignore[call-arg]  # uvicorn types the class as a bare Protocol
                config=config, server_state=self.server_state, app_state=self.lifespan.state
            )

        server = await asyncio.get_running_loop().create_server(protocol, sock=sock, backlog=config.backlog)
        self.servers.append(server)  # closed with the others on shutdown

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            self._on_drain()
        super().handle_exit(sig, frame)
