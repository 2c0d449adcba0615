"""Draining on SIGTERM: /ready turns 503 at once, and streams still open shortly before the grace period
ends get an error event and [DONE] instead of a cut."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from dpserve.router.routing.dispatch import OpenStreams

log = logging.getLogger("dpserve.router")


class Shutdown:
    def __init__(self, open_streams: OpenStreams, on_drain: Sequence[Callable[[], None]] = ()) -> None:
        """`on_drain`: run on the loop as the drain begins (the peers are told)."""
        self.draining = False
        self._open_streams = open_streams
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_drain = tuple(on_drain)

    def serving(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop the streams run on, once the app serves."""
        self._loop = loop

    def begin_drain(self, grace_s: float) -> None:
        """Called from the SIGTERM handler (any thread)."""
        self.draining = True
        loop = self._loop
        if loop is None:
            return
        for listener in self._on_drain:
            loop.call_soon_threadsafe(listener)
        cut_after = max(0.0, grace_s - min(1.0, grace_s / 2))
        loop.call_soon_threadsafe(loop.call_later, cut_after, self._cut_streams)

    def _cut_streams(self) -> None:
        cut = self._open_streams.cut_all("The router is shutting down; this stream was ended before it finished.")
        if cut:
            log.warning("shutdown grace period ending: cut %d stream(s) in flight", cut)
