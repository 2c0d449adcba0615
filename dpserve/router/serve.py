"""Running the router app under uvicorn."""

from __future__ import annotations

import gc
import logging
import socket
import sys
from collections.abc import Callable
from types import FrameType

import prometheus_client
import uvicorn

from dpserve.config import RouterSettings
from dpserve.router.access import check_bind, load_keys
from dpserve.router.app import create_app
from dpserve.router.http_protocol import bounded_protocol
from dpserve.router.shutdown import Shutdown


def serve_router(settings: RouterSettings) -> int:
    """Serves until stopped; 2 with one line on stderr when the settings are wrong."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Process-wide switch (hence here, not in the app factory): no `*_created` series per counter.
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated upstream
    try:
        keys = load_keys(settings)
        check_bind(settings.host, keys, settings.insecure)
        app = create_app(settings, keys=keys)
    except ValueError as exc:  # a bad --replica, --kv-events, --tokenizer or key, or an unsafe bind
        print(f"dpserve router: {exc}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=bounded_protocol(settings.max_header_bytes),
        access_log=settings.access_log,
        log_level=settings.log_level,
        # On SIGTERM uvicorn stops listening at once, then requests in flight (streams too) get this
        # long to finish before they are cut.
        # (uvicorn hints int; it hands the value to asyncio.wait_for, which takes seconds as a float.)
        timeout_graceful_shutdown=settings.shutdown_grace_s,  # type: ignore[arg-type]
    )
    shutdown: Shutdown = app.state.shutdown
    DrainingServer(config, lambda: shutdown.begin_drain(settings.shutdown_grace_s)).run()
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the app when a shutdown begins (uvicorn itself tells it only once
    every connection has closed, too late to end streams properly)."""

    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_drain = on_drain

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # Everything built so far (libraries, the app, its indexes' containers) lives as long as the
        # process: out of the collector's sight, its full collections cost microseconds, not the 60-80 ms
        # measured here that would stall every request in flight.
        gc.freeze()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            self._on_drain()
        super().handle_exit(sig, frame)
