"""A lean HTTP/1.1 client for the hot path: send a request to a replica and read the answer as bytes.

General-purpose clients spend most of a proxied request's CPU on features the router never uses
(cookies, redirects, auto headers, payload registries, per-read timeout rescheduling); measured in
docs/benchmarks/overhead.md. This one does what relaying needs and no more, and what it does follows
HTTP/1.1 as httpcore/h11 do (tests/unit/test_upstream_wire.py holds the cases):
- keep-alive connections pooled per replica, reused only when both sides finished the exchange; an idle
  connection the replica has closed is found before reuse (a readable idle socket is EOF or garbage), and
  a reused one that dies before any byte of the answer is retried once on a fresh connection;
- 1xx answers skipped; exactly one final answer per exchange: bytes past its end (past Content-Length,
  a second message) are a protocol error on that connection, delivered to no one;
- bodies by Content-Length, chunked (trailers dropped) or the connection's end (HTTP/1.0);
- back-pressure for streams read piecemeal, a size bound for answers read whole;
- deadlines for connecting, writing the request, each silence of the replica, and the whole exchange.
"""

from __future__ import annotations

import asyncio
import re
import select
import ssl
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools
from mypy_extensions import mypyc_attr

from dpserve.replicas.access import ReplicaAccess, tls_refusal

READ_BUFFER_HIGH = 256 * 1024  # a stream read piecemeal: stop reading from the replica past this much unread
DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
IDLE_CHECK_AFTER_S = 0.05
"""An idle connection is polled for the replica's close before reuse only past this idle time: a replica's
keep-alive timer takes seconds, and one closed sooner (a replica stopping) is a stale connection, retried.
Under load a connection idles for milliseconds, and the poll was a system call per request."""
STALE_WINDOW_S = 1.0
"""A reused connection that closes this soon after the request went out, before any byte of the answer,
was closed by the replica's keep-alive timer as the request crossed it: the replica never began the
request, so it is sent again on a fresh connection. Later, it is the replica failing the request."""
# RFC 9110 field names are tokens; values are visible ASCII, obs-text, spaces and tabs (no CR, LF, NUL).
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")


@mypyc_attr(native_class=False)  # mypyc compiles no subclass of a built-in exception
class UpstreamError(ConnectionError):
    """The replica's connection failed or closed before the answer was complete."""


@mypyc_attr(native_class=False)  # mypyc compiles no subclass of a built-in exception
class UpstreamConnectError(UpstreamError):
    """No connection to the replica could be made (nothing listening, or connecting timed out)."""


@mypyc_attr(native_class=False)  # mypyc compiles no subclass of a built-in exception
class UpstreamProtocolError(UpstreamError):
    """The replica broke HTTP/1.1 (bad framing, a second answer, bytes past the answer's end)."""


class ReplicaMisconfigured(Exception):
    """The replica refused the router itself: its TLS certificate failed verification, TLS with it failed, or
    it refused the router's key (401). Not the client's fault and not a passing failure: the replica is taken out
    of routing until a probe finds it usable (`ReplicaRegistry.set_misconfigured`)."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


@mypyc_attr(native_class=False)  # mypyc compiles no subclass of a built-in exception
class StaleConnection(UpstreamError):
    """A reused keep-alive connection closed before any byte of the answer: the replica had let it go."""


class ResponseTooLarge(Exception):
    """An answer read whole is over the router's bound. Not the replica's failure, and not retried."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the replica's answer is larger than the router's limit of {limit} bytes")
        self.limit = limit


class InvalidHeader(ValueError):
    """A header name or value that cannot go on the wire as it is."""


@dataclass(frozen=True)
class Deadlines:
    """How long each part of one exchange with a replica may take, in seconds."""

    connect_s: float = 5.0
    write_s: float = 60.0
    """Until the replica has taken the whole request (it stops reading: the router stops waiting)."""
    read_s: float = 900.0
    """The longest silence while waiting for the answer or between its bytes. A non-streamed answer
    only starts once generation ends, so this bounds a whole generation's time to the first byte."""
    total_s: float = 3600.0
    """The whole exchange, from sending the request to the answer's last byte, streams included."""


@dataclass(frozen=True)
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
        self.reused = False
        self.idle_since = 0.0
        self.write_paused = False
        self._response: UpstreamResponse | None = None
        self._interim = False  # parsing a 1xx answer, which is skipped
        self._final_seen = False  # this exchange's final answer has begun: any further message is an error
        self._final_done = False
        self._poller: select.poll | None = None

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        sock = transport.get_extra_info("socket")
        if sock is not None:  # registered once: the check before each reuse is then one poll(2)
            self._poller = select.poll()
            self._poller.register(sock.fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        response = self._response
        if response is None or self._final_done:
            # Bytes outside an exchange or past its answer's end: the connection's framing is lost.
            if response is not None:
                response._protocol_error("bytes past the end of the replica's answer")
            self.close()
            return
        response.bytes_in += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            response._protocol_error("unexpected protocol upgrade from the replica")
            self.close()
        except httptools.HttpParserError as exc:
            response._protocol_error(f"malformed HTTP response from the replica: {exc}")
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self._response
        if response is not None:
            response._connection_lost()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writer()

    def _wake_writer(self) -> None:
        if self._response is not None:
            self._response._wake()

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        if self._final_seen:
            raise UpstreamProtocolError("a second answer within one exchange")

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._final_seen:
            assert self._response is not None
            self._response._header(name, value)
        # else: a trailer of a chunked body; nothing the router relays

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        assert self._response is not None
        if 100 <= status < 200 and status != 101:
            self._interim = True  # 100 Continue, 103 Early Hints: the final answer follows
            self._response._forget_head()
            return
        self._final_seen = True
        self._response._headers_done(status)

    def on_body(self, body: bytes) -> None:
        assert self._response is not None
        self._response._body(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._final_done = True
        assert self._response is not None
        self._response._complete(self._parser.should_keep_alive())

    # -- used by the pool and the response
    def start(self, response: UpstreamResponse, request: bytes) -> None:
        self._response = response
        self._final_seen = self._final_done = self._interim = False
        assert self.transport is not None
        self.transport.write(request)

    def finished(self) -> None:
        self._response = None

    def readable_while_idle(self) -> bool:
        """An idle keep-alive socket with something to read holds the replica's close (EOF) or garbage:
        either way it must not carry a request. One poll, no read (as httpcore checks before reuse)."""
        if self._poller is None:
            return False
        try:
            return bool(self._poller.poll(0))
        except OSError:
            return True

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
    """A response as it arrives: `status`, `content_type` and `retry_after` once the headers are in,
    then the body by `read()` (all of it, up to the size bound) or `readany()` (what has come so far;
    b"" at the end). `release()` returns a finished connection to the pool; `close()` drops it (which
    also aborts the replica's request)."""

    def __init__(
        self, pool: UpstreamPool, key: Address, conn: _Connection, deadlines: Deadlines, max_bytes: int
    ) -> None:
        self._pool = pool
        self._key = key
        self._conn = conn
        self._loop = conn._loop
        self._deadlines = deadlines
        now = self._sent_at = self._loop.time()
        self._write_deadline = now + deadlines.write_s
        self._deadline = now + deadlines.total_s
        self._max_bytes = max_bytes
        self.status = 0
        self.sent_old_key = False
        """The replicas' key was replaced before this answer's headers came (a 401 then is no misconfiguration)."""
        self.content_type = "application/json"
        self.retry_after: str | None = None
        self.has_body = True
        self.bytes_in = 0
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._whole = False  # read() wants it all: no pausing, a size bound instead
        self._paused = False
        self._headers_in = False
        self._length_known = False
        self._done = False
        self._keep_alive = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._settled = False
        # One deadline timer per response, moved only when a wait must end sooner than it fires: a
        # timer set and cancelled around every read cost more than the read (docs/benchmarks/overhead.md).
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._due = 0.0
        self._due_reason = ""

    # -- fed by the connection
    def _header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-type":
            self.content_type = value.decode("latin-1").strip()
        elif lowered == b"retry-after":
            self.retry_after = value.decode("latin-1").strip()
        elif lowered in (b"content-length", b"transfer-encoding"):
            self._length_known = True
        # Any other header of the replica's stays here: hop-by-hop ones and its own bookkeeping.

    def _forget_head(self) -> None:
        """What a 1xx answer said is not the final answer's."""
        self.content_type = "application/json"
        self.retry_after = None
        self._length_known = False

    def _headers_done(self, status: int) -> None:
        self.status = status
        self.has_body = status not in (204, 304)
        self._headers_in = True
        self._wake()

    def _body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._whole:
            if self._buffered > self._max_bytes:
                self._error = ResponseTooLarge(self._max_bytes)
                self._conn.close()
        elif self._buffered > READ_BUFFER_HIGH and not self._paused:
            self._paused = True
            self._conn.pause()
        self._wake()

    def _complete(self, keep_alive: bool) -> None:
        self._done = True
        self._keep_alive = keep_alive
        self._stop_timer()  # nothing more to wait for
        self._wake()

    def _connection_lost(self) -> None:
        if self._done:
            return
        if self._headers_in and not self._length_known and self.has_body:
            self._complete(keep_alive=False)  # a body delimited by the connection's end
            return
        if self.bytes_in == 0 and self._conn.reused and self._loop.time() - self._sent_at < STALE_WINDOW_S:
            self._fail(StaleConnection("a reused connection was closed by the replica before it answered"))
            return
        self._fail(UpstreamError("the replica closed the connection before the answer was complete"))

    def _protocol_error(self, message: str) -> None:
        """Also after the answer completed: what was buffered and not yet taken is not delivered."""
        self._keep_alive = False
        if self._error is None and not self._settled:
            self._error = UpstreamProtocolError(message)
            self._wake()

    def _fail(self, error: Exception) -> None:
        if self._error is None and not self._done:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        """Until the connection reports something, at most the idle-read, write or total deadline."""
        if self._error is not None:
            raise self._error
        now = self._loop.time()
        timeout, reason = self._deadlines.read_s, "the replica did not answer in time (read timeout)"
        if self._deadline - now < timeout:
            timeout, reason = self._deadline - now, "the replica did not finish in time (request timeout)"
        if self._conn.write_paused and self._write_deadline - now < timeout:
            timeout, reason = self._write_deadline - now, "the replica did not take the request in time (write timeout)"
        due = self._due = now + timeout
        self._due_reason = reason
        if self._timer is None or self._timer_at > due:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = due
            self._timer = self._loop.call_at(due, self._check_deadline)
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None
        self._raise_error()

    def _raise_error(self) -> None:
        """The connection's failure, if it had one. A method of its own, not `if self._error ...` after the
        await above: mypy keeps the narrowing of the check before it (to None) across the await, and mypyc
        compiles that belief (a replica failing mid-wait became a TypeError)."""
        if self._error is not None:
            raise self._error

    def _check_deadline(self) -> None:
        """The timer fired: the wait in progress times out if its own deadline has passed; one that began
        later (after more bytes came) gets the timer again for the rest of its time."""
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # nobody waits: the next wait sets a timer
        if self._loop.time() < self._due:
            self._timer_at = self._due
            self._timer = self._loop.call_at(self._due, self._check_deadline)
            return
        waiter.set_exception(TimeoutError(self._due_reason))

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- read by the proxy
    async def _wait_headers(self) -> None:
        while not self._headers_in:
            await self._wait()

    async def readany(self) -> bytes:
        while not self._chunks:
            if self._done:
                if self._error is not None:
                    raise self._error
                return b""
            await self._wait()
        if self._error is not None:
            raise self._error
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
        """The whole body; ResponseTooLarge past the bound (the connection is then dropped)."""
        self._whole = True
        if self._buffered > self._max_bytes:
            self._error = ResponseTooLarge(self._max_bytes)
            self._conn.close()
        if self._paused:
            self._paused = False
            self._conn.resume()
        while not self._done:
            await self._wait()
        if self._error is not None:
            raise self._error
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
        self._stop_timer()
        conn = self._conn
        conn.finished()
        reusable = self._done and self._keep_alive and self._error is None
        if reusable and not self._chunks and not conn.closed:
            self._pool._give_back(self._key, conn)
        else:
            conn.close()

    def close(self) -> None:
        if self._settled:
            return
        self._settled = True
        self._stop_timer()
        self._conn.finished()
        self._conn.close()
        self._fail(UpstreamError("closed by the router"))


class UpstreamPool:
    """Idle keep-alive connections per replica address. Connections idle longer than `keepalive_s`
    are dropped rather than reused: keep it under the replicas' own keep-alive (uvicorn: 5 s)."""

    def __init__(
        self,
        deadlines: Deadlines | None = None,
        keepalive_s: float = 4.0,
        clock: Callable[[], float] = time.monotonic,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        access: ReplicaAccess | None = None,
    ) -> None:
        """`access`: the replicas' key, sent on every request, and the TLS context for https:// replicas."""
        self.deadlines = deadlines or Deadlines()
        self._keepalive_s = keepalive_s
        self._clock = clock
        self._max_response_bytes = max_response_bytes
        self._idle: dict[Address, list[_Connection]] = {}
        self._closed = False
        access = access or ReplicaAccess()
        self._access_lines = access.header_lines
        self._ssl: ssl.SSLContext | None = access.tls
        self.stale_retries = 0
        """Requests sent again on a fresh connection after a reused one turned out closed."""
        self.key_changes = 0

    def use_access(self, access: ReplicaAccess) -> None:
        """The replicas' key from the next request on (a key file changed); requests sent keep theirs."""
        self._access_lines = access.header_lines
        self.key_changes += 1

    async def post(self, address: Address, path: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        return await self.request(address, "POST", path, body, headers)

    async def request(
        self, address: Address, method: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> UpstreamResponse:
        """Sends the request; returns once the final answer's headers are in. InvalidHeader for a header
        that cannot be sent."""
        request = request_bytes(address, method, path, body, headers, self._access_lines)
        key_changes = self.key_changes
        conn = self._take_idle(address)
        while True:
            if conn is None:
                conn = await self._connect(address)
            response = UpstreamResponse(self, address, conn, self.deadlines, self._max_response_bytes)
            conn.start(response, request)
            try:
                await response._wait_headers()
            except StaleConnection:
                # The replica closed an idle connection as the request went out: it never saw it.
                response.close()
                self.stale_retries += 1
                conn = None
                continue
            except BaseException:
                response.close()
                raise
            response.sent_old_key = key_changes != self.key_changes
            return response

    def _take_idle(self, key: Address) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = self._clock()
        oldest_usable, unchecked = now - self._keepalive_s, now - IDLE_CHECK_AFTER_S
        while idle:
            conn = idle.pop()  # the most recently used: the likeliest to be alive and warm
            since = conn.idle_since
            if not conn.closed and since >= oldest_usable and (since > unchecked or not conn.readable_while_idle()):
                conn.reused = True
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
            async with asyncio.timeout(self.deadlines.connect_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop), address.host, address.port, ssl=context
                )
        except TimeoutError:
            raise UpstreamConnectError(f"connecting to {address.host_header} timed out") from None
        except ssl.SSLError as refused:  # an OSError too, but no passing failure: the replica refused the router
            raise ReplicaMisconfigured(tls_refusal(refused) or f"TLS with it failed ({refused})") from None
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


def check_header(name: str, value: str) -> None:
    """InvalidHeader unless `name: value` is a valid HTTP/1.1 field (RFC 9110 token and field value)."""
    # The common cases first, checked in C: a name of letters, digits and dashes; a printable ASCII value.
    plain_name = name.isascii() and name.replace("-", "").isalnum()
    if not plain_name and not _TOKEN.fullmatch(name.encode("latin-1", "replace")):
        raise InvalidHeader(f"invalid header name {name!r}")
    if value.isascii() and value.isprintable():
        return
    try:
        raw = value.encode("latin-1")
    except UnicodeEncodeError:
        raise InvalidHeader(f"header {name} has a value that is not latin-1") from None
    if not _FIELD_VALUE.fullmatch(raw):
        raise InvalidHeader(f"header {name} has a control character in its value")


def request_bytes(
    address: Address, method: str, path: str, body: bytes, headers: Mapping[str, str], access_lines: bytes = b""
) -> bytes:
    """`access_lines`: the router's own header lines to the replica (its key), already checked and encoded."""
    lines = [f"{method} {address.base_path}{path} HTTP/1.1", f"host: {address.host_header}"]
    if body or method not in ("GET", "HEAD", "DELETE"):
        lines.append(f"content-length: {len(body)}")
    for name, value in headers.items():
        check_header(name, value)
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n").encode("latin-1") + access_lines + b"\r\n" + body
