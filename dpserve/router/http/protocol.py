"""uvicorn's httptools protocol with a bound on a request's head (request line and headers), and
with a response's head and body written together.

httptools buffers a header until it is complete, however long, so one client could fill the router's
memory with an endless header line: measured, 200 MiB sent in one header grew the process by 240 MiB.
This counts the bytes a request's head arrives in and answers 431 once they pass the bound with the
head still incomplete, before the app (whose own header check runs only on complete heads) ever sees
the request. The parser then holds at most one read beyond the bound.

It also tells a request that its client left (`ClientLeft`, in the scope under `CLIENT_LEFT`) by a callback
from `connection_lost`, where the app would otherwise keep a task per request waiting on `receive()` for
`http.disconnect` (a task, a future and a cancellation per request, on the hot path).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import httptools
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dpserve.router.http.errors import OpenAIError
from dpserve.router.http.proxied_cycle import ProxiedCycle
from dpserve.router.http.proxied_paths import is_proxied

# Allowance for the request line (method, URL, version) on top of the headers' own limit.
REQUEST_LINE_BYTES = 8 * 1024


CLIENT_LEFT = "dpserve.client_left"
"""The scope key of a request's `ClientLeft`, when served by this protocol."""


class ClientLeft:
    """Where a request says what to call if its client's connection is lost before its answer is complete."""

    __slots__ = ("callback",)

    def __init__(self) -> None:
        self.callback: Callable[[], None] | None = None


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    max_head_bytes = 32 * 1024 + REQUEST_LINE_BYTES
    proxied_app: ASGIApp | None = None
    """The app's middleware around the hot path (`RouterApp.proxied`): proxied paths go there in a
    `ProxiedCycle`; every other path, and any request this does not handle, in uvicorn's own cycle."""
    _head_bytes = 0
    _in_head = True
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn narrows the base type
        super().connection_made(transport)
        self.transport = _HeadHoldingTransport(transport, self.loop)  # type: ignore[assignment]  # a wrapper that quacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._in_head = True
        self.scope[CLIENT_LEFT] = ClientLeft()  # type: ignore[literal-required]  # an extension key of ours

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        # uvicorn marks the current request disconnected here, when its answer is not complete.
        gone = cycle.scope.get(CLIENT_LEFT) if cycle is not None and not cycle.response_complete else None
        super().connection_lost(exc)
        if isinstance(gone, ClientLeft) and gone.callback is not None:
            gone.callback()

    def on_headers_complete(self) -> None:
        self._in_head = False
        app = self.proxied_app
        if app is None or self.root_path or self.limit_concurrency is not None or self.parser.should_upgrade():
            super().on_headers_complete()
            return
        parsed = httptools.parse_url(self.url)
        raw_path: bytes = parsed.path
        path = raw_path.decode("ascii")
        if "%" in path or not is_proxied(path):  # escaped paths are uvicorn's to decode
            super().on_headers_complete()
            return
        parser, scope = self.parser, cast(dict[str, Any], self.scope)
        scope["method"] = parser.get_method().decode("ascii")
        version = parser.get_http_version()
        if version != "1.1":
            scope["http_version"] = version
        scope["path"] = path
        scope["raw_path"] = raw_path
        scope["query_string"] = parsed.query or b""
        keep_alive = version != "1.0" and parser.should_keep_alive()
        defaults = self.server_state.default_headers
        cycle = ProxiedCycle(
            scope, self.transport, self.flow, defaults, self.expect_100_continue, keep_alive, self.on_response_complete
        )
        existing, self.cycle = self.cycle, cycle  # type: ignore[assignment]  # the same attributes as uvicorn's cycle
        if existing is None or existing.response_complete:
            self._start_asgi_task(cycle, app)  # type: ignore[arg-type]
        else:  # pipelined behind a request still being answered
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, app))  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        counting = self._in_head
        if counting:
            self._head_bytes += len(data)
        super().data_received(data)
        # Judged after parsing: one read may hold a whole head and the start of a large body.
        if counting and self._in_head and self._head_bytes > self.max_head_bytes:
            self._refuse()

    def send_400_response(self, msg: str) -> None:
        """The request could not be parsed (a control character in a header, say): an OpenAI-style
        error, as every other refusal, instead of uvicorn's plain text."""
        message = "Malformed HTTP request: a request line or header the router cannot read."
        self._answer_and_close(b"400 Bad Request", OpenAIError(400, message, code="malformed_request"))

    def _refuse(self) -> None:
        self._refused = True
        if self.transport.is_closing():  # the parser already answered 400 and closed it
            return
        message = f"Request line and headers are over this router's limit of {self.max_head_bytes} bytes."
        error = OpenAIError(431, message, code="headers_too_large")
        self._answer_and_close(b"431 Request Header Fields Too Large", error)

    def _answer_and_close(self, status: bytes, error: OpenAIError) -> None:
        """An error for a request the app never sees, written straight to the connection, which then closes."""
        body = error.body()
        head = b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        self.transport.write(head % (status, len(body)) + body)
        self.transport.close()


class _HeadHoldingTransport:
    """uvicorn writes a response's status line and headers, then its body, as two writes: two system
    calls, and on loopback two wake-ups of the client, for every small answer. This holds a head back
    until the next write (the body, which normally follows in the same turn of the event loop) and sends
    both at once; a head with nothing after it goes out at the end of the turn. Anything else is the
    transport's own."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.writelines((held, data))
        elif data.startswith(b"HTTP/1.1 "):  # a response head (a body that looks like one is merely delayed)
            self._held = data
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def bounded_protocol(max_header_bytes: int, proxied_app: ASGIApp | None = None) -> type[BoundedHttpToolsProtocol]:
    """The protocol class for uvicorn's `http=`, bounding heads at the headers' limit plus a request line;
    `proxied_app`: where proxied paths go in the protocol's own cycle (None: every path in uvicorn's)."""
    return type(
        "BoundedHttpToolsProtocol",
        (BoundedHttpToolsProtocol,),
        {"max_head_bytes": max_header_bytes + REQUEST_LINE_BYTES, "proxied_app": proxied_app},
    )
