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

Proxied paths get a cycle of the protocol's own (`ProxiedCycle`): uvicorn's does, for every request, what
the proxied path has no use for (FastAPI's routing and error layers above it, an `asyncio.Event` per
request, every response header searched by two regular expressions, an access-log check). A proxied request
goes straight to the app's middleware around the hot path (`RouterApp.proxied`), waits on a plain future
only when its body has not all arrived, and its response head is framed from headers the hot path built
itself: its own names, and values read off the wire by httptools (the replica's, the client's request id),
which cannot hold a line break; one search over all the values together still refuses a control character.
Every other path, and everything between requests (keep-alive, pipelining, flow control, shutdown), stays
uvicorn's.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import re
from collections.abc import Callable
from typing import Any, Protocol, cast

import httptools
from starlette.types import ASGIApp, Message
from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from dpserve.router.http.endpoints import PROXIED_PATHS, RESPONSE_BY_ID
from dpserve.router.http.errors import OpenAIError

log = logging.getLogger("dpserve.router")

# Allowance for the request line (method, URL, version) on top of the headers' own limit.
REQUEST_LINE_BYTES = 8 * 1024


CLIENT_LEFT = "dpserve.client_left"
"""The scope key of a request's `ClientLeft`, when served by this protocol."""


class ClientLeft:
    """Where a request says what to call if its client's connection is lost before its answer is complete."""

    __slots__ = ("callback",)

    def __init__(self) -> None:
        self.callback: Callable[[], None] | None = None


class _Url(Protocol):
    """httptools' parsed URL as it is: its stubs say bytes, but a part the URL lacks is None (mypyc checks)."""

    path: bytes | None
    query: bytes | None


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    url: bytes
    """uvicorn's, set per request (declared here: mypyc needs the attributes it compiles access to)."""

    def __init__(
        self,
        *args: Any,
        max_head_bytes: int = 32 * 1024 + REQUEST_LINE_BYTES,
        proxied_app: ASGIApp | None = None,
        **kwargs: Any,
    ) -> None:
        """uvicorn's arguments, and: `max_head_bytes`, the most a request line and headers may take;
        `proxied_app`, the app's middleware around the hot path (`RouterApp.proxied`): proxied paths go there
        in a `ProxiedCycle`; every other path, and any request this does not handle, in uvicorn's own cycle."""
        super().__init__(*args, **kwargs)
        self.max_head_bytes = max_head_bytes
        self.proxied_app = proxied_app
        self._head_bytes = 0
        self._in_head = True
        self._refused = False
        self._idle_since: float | None = None
        """When the last answer on this connection completed; None while a request is being read or answered."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn narrows the base type
        super().connection_made(transport)
        self.transport = _HeadHoldingTransport(transport, self.loop)  # type: ignore[assignment]  # a wrapper that quacks

    # uvicorn's parser callbacks and keep-alive handling, here so that they run compiled: per request, they
    # are what is left of uvicorn's interpreted code on the proxied path. Same state, same behaviour.

    def on_message_begin(self) -> None:
        self.url = b""
        self.expect_100_continue = False
        headers: list[tuple[bytes, bytes]] = []
        self.headers = headers
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": self.root_path,
            "headers": headers,
            "state": self.app_state.copy(),
            CLIENT_LEFT: ClientLeft(),  # an extension key of ours
        }
        self.scope = cast(Any, scope)  # uvicorn's HTTPScope, with our key
        self._head_bytes = 0
        self._in_head = True

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
            return
        cycle.more_body = False
        cycle.message_event.set()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        if self.config.reset_contextvars:  # uvicorn's opt-in: each request in a fresh context
            task = self.loop.create_task(cycle.run_asgi(app), context=contextvars.Context())
        else:
            task = self.loop.create_task(cycle.run_asgi(app))
        tasks = self.tasks
        task.add_done_callback(tasks.discard)
        tasks.add(task)

    def on_response_complete(self) -> None:
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        # uvicorn arms a timer here and cancels it when the next request's bytes arrive: a timer made and
        # cancelled per request. This notes the time and keeps one timer, which looks again when it fires.
        self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self._keep_alive_due)

    def _unset_keepalive_if_required(self) -> None:
        # Bytes arrived (or uvicorn is done with the connection): not idle; the timer finds that when it fires.
        self._idle_since = None

    def _keep_alive_due(self) -> None:
        self.timeout_keep_alive_task = None
        since = self._idle_since
        if since is None:  # busy: the answer's completion arms the timer again
            return
        left = since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_due)
        else:
            self.timeout_keep_alive_handler()

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        # uvicorn marks the current request disconnected here, when its answer is not complete.
        gone = cycle.scope.get(CLIENT_LEFT) if cycle is not None and not cycle.response_complete else None
        timer = self.timeout_keep_alive_task
        if timer is not None:
            timer.cancel()
            self.timeout_keep_alive_task = None
        super().connection_lost(exc)
        if isinstance(gone, ClientLeft) and gone.callback is not None:
            gone.callback()

    def on_headers_complete(self) -> None:
        self._in_head = False
        app = self.proxied_app
        if app is None or self.root_path or self.limit_concurrency is not None or self.parser.should_upgrade():
            super().on_headers_complete()
            return
        parsed = cast(_Url, httptools.parse_url(self.url))
        raw_path = parsed.path
        path = raw_path.decode("ascii") if raw_path is not None else ""
        # `proxied_paths.is_proxied`, read here as data: the request enters that file once, for the hot path.
        # Escaped paths are uvicorn's to decode.
        if raw_path is None or "%" in path or not (path in PROXIED_PATHS or path.startswith(RESPONSE_BY_ID)):
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
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
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
    # A factory, not a subclass made with type(): a compiled class takes no interpreted subclass. uvicorn
    # calls what it is given with keywords.
    made = functools.partial(
        BoundedHttpToolsProtocol, max_head_bytes=max_header_bytes + REQUEST_LINE_BYTES, proxied_app=proxied_app
    )
    return cast(type[BoundedHttpToolsProtocol], made)


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
        joined = b" ".join(values)
        # Printable text passes in C; a tab, obs-text or a control character gets the regex's word.
        if not joined.decode("latin-1").isprintable() and _CONTROL.search(joined):
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
        await error.to_response({"connection": "close"})(self.scope, self.receive, self.send)
