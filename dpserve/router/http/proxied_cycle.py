"""One proxied request's exchange with its client, on the router's own protocol (`protocol.py`).

uvicorn's cycle does, for every request, what the proxied path has no use for: a framework's routing and
error layers above it (FastAPI's), an `asyncio.Event` per request, every response header searched by two
regular expressions, an access-log check. Here the request goes straight to the app's middleware around
the hot path (`RouterApp.proxied`), waits on a plain future only when its body has not all arrived, and
its response head is framed from headers the hot path built itself: its own names, and values read off
the wire by httptools (the replica's, the client's request id), which cannot hold a line break; one
search over all the values together still refuses a control character. Everything between requests
(keep-alive, pipelining, flow control, limits on heads, shutdown) stays the protocol's.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from dpserve.router.http.errors import OpenAIError

log = logging.getLogger("dpserve.router")

_CONTROL = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_DISCONNECT: dict[str, Any] = {"type": "http.disconnect"}


class Wakeup:
    """What `asyncio.Event` is to uvicorn's protocol (`set` on body, end and disconnect), for one waiter and
    without a lock-step deque: a future only while the cycle waits."""

    __slots__ = ("_set", "_waiter")

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        self._set = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> None:
        if self._set:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


def _nothing() -> None:
    return None


class ProxiedCycle:
    """The attributes are those uvicorn's protocol reads and writes on its own cycle."""

    __slots__ = (
        "body",
        "chunked",
        "default_headers",
        "delivered_end",
        "disconnected",
        "flow",
        "keep_alive",
        "message_event",
        "more_body",
        "on_response",
        "remaining",
        "response_complete",
        "response_started",
        "scope",
        "transport",
        "waiting_for_100_continue",
    )

    def __init__(
        self,
        scope: dict[str, Any],
        transport: asyncio.Transport,
        flow: FlowControl,
        default_headers: list[tuple[bytes, bytes]],
        expect_100_continue: bool,
        keep_alive: bool,
        on_response: Callable[[], None],
    ) -> None:
        self.scope = scope
        self.transport = transport
        self.flow = flow
        self.default_headers = default_headers
        self.waiting_for_100_continue = expect_100_continue
        self.keep_alive = keep_alive
        self.on_response = on_response
        self.message_event = Wakeup()
        self.disconnected = False
        self.body = bytearray()
        self.more_body = True
        self.delivered_end = False
        self.response_started = False
        self.response_complete = False
        self.chunked = False
        self.remaining = 0
        """Body bytes still owed by a response with a content-length."""

    async def run_asgi(self, app: ASGIApp) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            log.error("the proxied path failed on %s %s", self.scope["method"], self.scope["path"], exc_info=exc)
            if not self.response_started:
                await self._internal_error()
            else:
                self.transport.close()
        else:
            if not self.response_started and not self.disconnected:
                log.error("the proxied path returned without answering %s", self.scope["path"])
                await self._internal_error()
            elif not self.response_complete and not self.disconnected:
                log.error("the proxied path returned with its answer to %s unfinished", self.scope["path"])
                self.transport.close()
        finally:
            self.on_response = _nothing

    async def receive(self) -> Message:
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(_CONTINUE)
            self.waiting_for_100_continue = False
        # Wait only when nothing is there to hand over: the usual body came in the head's read and is complete.
        if (
            not self.disconnected
            and not self.response_complete
            and not self.body
            and (self.more_body or self.delivered_end)
        ):
            self.flow.resume_reading()
            await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected or self.response_complete:
            return _DISCONNECT
        body, self.body = bytes(self.body), bytearray()
        more = self.more_body
        self.delivered_end = not more
        return {"type": "http.request", "body": body, "more_body": more}

    async def send(self, message: Message) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        if not self.response_started:
            if message["type"] != "http.response.start":
                raise RuntimeError(f"expected http.response.start, got {message['type']}")
            self._start(message["status"], message.get("headers", ()))
            return
        if self.response_complete or message["type"] != "http.response.body":
            raise RuntimeError(f"unexpected {message['type']} after the response")
        body: bytes = message.get("body", b"")
        more: bool = message.get("more_body", False)
        if self.scope["method"] == "HEAD":
            self.remaining = 0
        elif self.chunked:
            if body:
                self.transport.write(b"%x\r\n%b\r\n%b" % (len(body), body, b"" if more else b"0\r\n\r\n"))
            elif not more:
                self.transport.write(b"0\r\n\r\n")
        elif body:
            if len(body) > self.remaining:
                raise RuntimeError("response body longer than its content-length")
            self.remaining -= len(body)
            self.transport.write(body)
        if not more:
            if self.remaining:
                raise RuntimeError("response body shorter than its content-length")
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()

    def _start(self, status: int, headers: Any) -> None:
        self.response_started = True
        self.waiting_for_100_continue = False
        lines = [STATUS_LINE[status]]
        for name, value in self.default_headers:
            lines += (name, b": ", value, b"\r\n")
        length: int | None = None
        closing = False
        values = []
        for name, value in headers:
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and b"close" in value.lower():
                closing = True
                self.keep_alive = False
            values.append(value)
            lines += (name, b": ", value, b"\r\n")
        if _CONTROL.search(b"\t".join(values)):
            raise RuntimeError("a response header value holds a control character")
        if not self.keep_alive and not closing:
            lines.append(b"connection: close\r\n")
        if length is not None:
            self.remaining = length
        elif self.scope["method"] != "HEAD" and status not in (204, 304):
            self.chunked = True
            lines.append(b"transfer-encoding: chunked\r\n")
        lines.append(b"\r\n")
        self.transport.write(b"".join(lines))

    async def _internal_error(self) -> None:
        error = OpenAIError(500, "The router failed on this request.", type="internal_error", code="internal_error")
        body = error.body()
        self.keep_alive = False
        head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await self.send({"type": "http.response.start", "status": 500, "headers": head})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})
