"""A lean HTTP/1.1 client for the hot path: POST a JSON body to a replica and read the answer as bytes.

General-purpose clients spend most of a proxied request's CPU on features the router never uses
(cookies, redirects, auto headers, payload registries, per-read timeout rescheduling). This one does
what relaying needs and no more: keep-alive connections pooled per replica, one write per request,
httptools (the parser uvicorn uses) for the response, chunked bodies decoded, back-pressure for slow
readers, and timeouts for connecting and for each wait on the replica.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

READ_BUFFER_HIGH = 256 * 1024  # stop reading from the replica past this much unread body (slow client)


class UpstreamError(ConnectionError):
    """The replica's connection failed or closed before the answer was complete."""


class UpstreamConnectError(UpstreamError):
    """No connection to the replica could be made (nothing listening, or connecting timed out)."""


@dataclass(frozen=True, slots=True)
class Address:
    """Where a replica listens, parsed once from its URL."""

    host: str
    port: int
    tls: bool = False
    base_path: str = ""

    @classmethod
    def from_url(cls, url: str) -> Address:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url}")
        tls = parts.scheme == "https"
        return cls(parts.hostname, parts.port or (443 if tls else 80), tls, parts.path.rstrip("/"))

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one exchange at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self._response: UpstreamResponse | None = None

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        if self._response is None:
            self.close()  # bytes nobody asked for: the connection is not in a known state
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._response._fail(UpstreamError("unexpected protocol upgrade from the replica"))
            self.close()
        except httptools.HttpParserError as exc:
            self._response._fail(UpstreamError(f"malformed HTTP response from the replica: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self._response
        if response is not None:
            response._connection_lost()

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._response is not None
        self._response._header(name, value)

    def on_headers_complete(self) -> None:
        assert self._response is not None
        self._response._headers_done(self._parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        assert self._response is not None
        self._response._body(body)

    def on_message_complete(self) -> None:
        assert self._response is not None
        self._response._complete(self._parser.should_keep_alive())

    # -- used by the pool and the response
    def start(self, response: UpstreamResponse, request: bytes) -> None:
        self._response = response
        assert self.transport is not None
        self.transport.write(request)

    def finished(self) -> None:
        self._response = None

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()


class UpstreamResponse:
    """A response as it arrives: `status` and `content_type` once the headers are in, then the body by
    `read()` (all of it) or `readany()` (what has come so far; b"" at the end). `release()` returns a
    finished connection to the pool; `close()` drops it (which also aborts the replica's request)."""

    def __init__(self, pool: UpstreamPool, key: Address, conn: _Connection, read_timeout_s: float) -> None:
        self._pool = pool
        self._key = key
        self._conn = conn
        self._loop = conn._loop
        self._read_timeout_s = read_timeout_s
        self.status = 0
        self.content_type = "application/json"
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._headers_in = False
        self._length_known = False
        self._done = False
        self._keep_alive = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._settled = False

    # -- fed by the connection
    def _header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-type":
            self.content_type = value.decode("latin-1")
        elif lowered in (b"content-length", b"transfer-encoding"):
            self._length_known = True

    def _headers_done(self, status: int) -> None:
        self.status = status
        self._headers_in = True
        self._wake()

    def _body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > READ_BUFFER_HIGH and not self._paused:
            self._paused = True
            self._conn.pause()
        self._wake()

    def _complete(self, keep_alive: bool) -> None:
        self._done = True
        self._keep_alive = keep_alive
        self._wake()

    def _connection_lost(self) -> None:
        if self._done:
            return
        if self._headers_in and not self._length_known:
            self._complete(keep_alive=False)  # a body delimited by the connection's end
            return
        self._fail(UpstreamError("the replica closed the connection before the answer was complete"))

    def _fail(self, error: Exception) -> None:
        if self._error is None and not self._done:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        """Until the connection reports something, at most the read timeout."""
        if self._error is not None:
            raise self._error
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(self._read_timeout_s, _time_out, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        if self._error is not None:
            raise self._error

    # -- read by the proxy
    async def _wait_headers(self) -> None:
        while not self._headers_in:
            await self._wait()

    async def readany(self) -> bytes:
        while not self._chunks:
            if self._done:
                return b""
            await self._wait()
        if len(self._chunks) == 1:
            data = self._chunks.popleft()
        else:
            data = b"".join(self._chunks)
            self._chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            self._conn.resume()
        return data

    async def read(self) -> bytes:
        while not self._done:
            await self._wait()
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        self.release()
        return data

    def release(self) -> None:
        """Back to the pool when the answer was read whole and the connection may be reused; else close."""
        if self._settled:
            return
        self._settled = True
        conn = self._conn
        conn.finished()
        if self._done and self._keep_alive and not self._chunks and not conn.closed:
            self._pool._give_back(self._key, conn)
        else:
            conn.close()

    def close(self) -> None:
        if self._settled:
            return
        self._settled = True
        self._conn.finished()
        self._conn.close()
        self._fail(UpstreamError("closed by the router"))


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("the replica did not answer in time"))


class UpstreamPool:
    """Idle keep-alive connections per replica address. Connections idle longer than `keepalive_s`
    are dropped rather than reused: keep it under the replicas' own keep-alive (uvicorn: 5 s), so a
    request never goes out on a socket the replica is closing."""

    def __init__(
        self,
        connect_timeout_s: float,
        read_timeout_s: float,
        keepalive_s: float = 4.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._keepalive_s = keepalive_s
        self._clock = clock
        self._idle: dict[Address, list[_Connection]] = {}
        self._closed = False
        self._ssl: ssl.SSLContext | None = None

    async def post(self, address: Address, path: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        """Sends the request; returns once the response's headers are in."""
        request = _request_bytes(address, path, body, headers)
        conn = self._take_idle(address) or await self._connect(address)
        response = UpstreamResponse(self, address, conn, self._read_timeout_s)
        conn.start(response, request)
        try:
            await response._wait_headers()
        except BaseException:
            response.close()
            raise
        return response

    def _take_idle(self, key: Address) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        oldest_usable = self._clock() - self._keepalive_s
        while idle:
            conn = idle.pop()  # the most recently used: the likeliest to be alive and warm
            if not conn.closed and conn.idle_since >= oldest_usable:
                return conn
            conn.close()
        return None

    def _give_back(self, key: Address, conn: _Connection) -> None:
        if self._closed:
            conn.close()
            return
        conn.idle_since = self._clock()
        self._idle.setdefault(key, []).append(conn)

    async def _connect(self, address: Address) -> _Connection:
        loop = asyncio.get_running_loop()
        context = self._tls_context() if address.tls else None
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop), address.host, address.port, ssl=context
                )
        except TimeoutError:
            raise UpstreamConnectError(f"connecting to {address.host_header} timed out") from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {address.host_header}: {exc.strerror or exc}") from None
        return conn

    def _tls_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


def _request_bytes(address: Address, path: str, body: bytes, headers: Mapping[str, str]) -> bytes:
    lines = [f"POST {address.base_path}{path} HTTP/1.1", f"host: {address.host_header}", f"content-length: {len(body)}"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            raise ValueError(f"header {name} has a line break in its value")
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
