"""HTTP/1.1 conformance of the hot path's upstream client, at the wire: a raw-socket replica writes exactly
the bytes each case needs (the cases httpcore/h11 handle), and the client must read them right.

Loopback only. Where a case needs the client not to have seen the replica's close yet, the test blocks
the event loop with time.sleep (the router, too, can be busy for a moment between two requests)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest

from dpserve.router.http import upstream_client as upstream
from dpserve.router.http.upstream_client import (
    Address,
    Deadlines,
    InvalidHeader,
    ResponseTooLarge,
    UpstreamError,
    UpstreamPool,
    UpstreamProtocolError,
)
from tests.unit.test_upstream import Handler, read_request, serving

FAST = Deadlines(connect_s=1.0, write_s=5.0, read_s=5.0, total_s=30.0)


def answers(*scripts: bytes | Callable[[asyncio.StreamWriter], Awaitable[None]]) -> Handler:
    """Answers the n-th request on a connection with the n-th script (bytes written in one write, or a
    coroutine given the writer); past the last, holds the connection open until the client leaves."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for script in scripts:
            await read_request(reader)
            if isinstance(script, bytes):
                writer.write(script)
                await writer.drain()
            else:
                await script(writer)
        await reader.read()

    return handle


def per_connection(*handlers: Handler) -> Handler:
    """The n-th connection is served by the n-th handler (the last one serves any after it)."""
    count = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = min(count[0], len(handlers) - 1)
        count[0] += 1
        await handlers[index](reader, writer)

    return handle


@contextlib.contextmanager
def threaded_server(serve: Callable[[socket.socket, int], None]) -> Iterator[Address]:
    """A replica in its own thread, so it writes while the client's event loop is busy."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept_loop() -> None:
        index = 0
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                try:
                    serve(conn, index)
                except OSError:
                    pass
            index += 1

    thread = threading.Thread(target=accept_loop, daemon=True)
    thread.start()
    try:
        yield Address("127.0.0.1", port)
    finally:
        listener.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body),
        extra,
        body,
    )


async def fetch(pool: UpstreamPool, address: object) -> bytes:
    response = await pool.post(address, "/v1/completions", b"{}", {})  # type: ignore[arg-type]
    return await response.read()


async def test_a_whole_answer_larger_than_the_stream_buffer_arrives() -> None:
    body = bytes(range(256)) * (3 * 4096)  # 3 MiB: far past the 256 KiB a stream may hold unread
    async with serving(answers(ok(body), ok(b"next"))) as (address, connections):
        pool = UpstreamPool(Deadlines(connect_s=1.0, read_s=2.0))
        assert await fetch(pool, address) == body
        assert await fetch(pool, address) == b"next"
        assert len(connections) == 1
        pool.close()


async def test_an_answer_over_the_bound_is_refused_and_its_connection_dropped() -> None:
    dropped = asyncio.Event()

    async def big(writer: asyncio.StreamWriter) -> None:
        writer.write(ok(b"x" * (2 * 1024 * 1024)))
        try:
            await writer.drain()
        except ConnectionError:
            pass
        dropped.set()

    async with serving(answers(big)) as (address, _):
        pool = UpstreamPool(FAST, max_response_bytes=1024 * 1024)
        response = await pool.post(address, "/", b"", {})
        with pytest.raises(ResponseTooLarge):
            await response.read()
        await asyncio.wait_for(dropped.wait(), 5)
        pool.close()


async def test_1xx_answers_are_skipped_and_the_connection_stays_usable() -> None:
    async def hints_then_answer(writer: asyncio.StreamWriter) -> None:
        # Each interim answer on its own, as a server sends them while it works: none is the final one.
        for interim in (
            b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\n",
        ):
            writer.write(interim)
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(ok(b"first"))

    async with serving(answers(hints_then_answer, ok(b"second"))) as (address, connections):
        pool = UpstreamPool(FAST)
        response = await pool.post(address, "/", b"", {})
        assert response.status == 200
        assert await response.read() == b"first"
        assert await fetch(pool, address) == b"second"
        assert len(connections) == 1
        pool.close()


async def test_bytes_past_content_length_are_a_protocol_error_on_that_connection() -> None:
    async with serving(per_connection(answers(ok(b"ok") + b"EXTRA"), answers(ok(b"fresh")))) as (address, connections):
        pool = UpstreamPool(FAST)
        with pytest.raises(UpstreamProtocolError):
            await fetch(pool, address)
        assert await fetch(pool, address) == b"fresh"
        assert len(connections) == 2
        pool.close()


async def test_a_second_answer_in_one_exchange_reaches_no_one() -> None:
    rogue = ok(b"first") + ok(b"rogue")
    async with serving(answers(rogue)) as (address, _):
        pool = UpstreamPool(FAST)
        with pytest.raises(UpstreamProtocolError):
            await fetch(pool, address)
        pool.close()


async def test_a_late_second_answer_is_never_taken_for_the_next_request() -> None:
    def late_rogue(conn: socket.socket, index: int) -> None:
        conn.recv(65536)
        conn.sendall(ok(b"first" if index == 0 else b"fresh"))
        if index == 0:
            time.sleep(0.05)
            conn.sendall(ok(b"rogue"))
            conn.recv(65536)
            conn.sendall(ok(b"never"))

    with threaded_server(late_rogue) as address:
        pool = UpstreamPool(FAST)
        assert await fetch(pool, address) == b"first"
        time.sleep(0.3)  # noqa: ASYNC251 (the loop must not run): the rogue answer is in the socket, unread by the event loop
        assert await fetch(pool, address) == b"fresh"  # on a new connection, not the rogue bytes
        pool.close()


async def test_connection_close_answers_are_not_reused() -> None:
    async with serving(answers(ok(b"a", b"connection: close\r\n"))) as (address, connections):
        pool = UpstreamPool(FAST)
        assert await fetch(pool, address) == b"a"
        assert await fetch(pool, address) == b"a"
        assert len(connections) == 2
        pool.close()


async def test_an_http_1_0_answer_without_length_ends_with_the_connection() -> None:
    async def old_server(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end")
        await writer.drain()
        writer.close()

    async with serving(answers(old_server)) as (address, connections):
        pool = UpstreamPool(FAST)
        assert await fetch(pool, address) == b"until the end"
        assert await fetch(pool, address) == b"until the end"
        assert len(connections) == 2
        pool.close()


async def test_204_and_304_have_no_body_and_keep_the_connection() -> None:
    script = answers(b"HTTP/1.1 204 No Content\r\n\r\n", b"HTTP/1.1 304 Not Modified\r\n\r\n", ok(b"after"))
    async with serving(script) as (address, connections):
        pool = UpstreamPool(FAST)
        for status in (204, 304):
            response = await pool.post(address, "/", b"", {})
            assert response.status == status and not response.has_body
            assert await response.read() == b""
        assert await fetch(pool, address) == b"after"
        assert len(connections) == 1
        pool.close()


async def test_chunked_with_trailers_is_decoded_and_trailers_are_not_headers() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n"
        b"trailer: content-type\r\n\r\n"
        b'4\r\n{"a"\r\n3\r\n:1}\r\n0\r\ncontent-type: text/evil\r\nx-checksum: 1\r\n\r\n'
    )
    async with serving(answers(chunked, ok(b"next"))) as (address, connections):
        pool = UpstreamPool(FAST)
        response = await pool.post(address, "/", b"", {})
        assert await response.read() == b'{"a":1}'
        assert response.content_type == "application/json"
        assert await fetch(pool, address) == b"next"
        assert len(connections) == 1
        pool.close()


async def test_an_idle_connection_the_replica_closed_is_not_used() -> None:
    async def answer_then_close(writer: asyncio.StreamWriter) -> None:
        writer.write(ok(b"fine"))
        await writer.drain()
        writer.close()  # as a replica's keep-alive timer does

    async with serving(answers(answer_then_close)) as (address, connections):
        pool = UpstreamPool(FAST)
        assert await fetch(pool, address) == b"fine"
        time.sleep(0.2)  # noqa: ASYNC251 (the loop must not run): the close is in the socket, not yet seen by the event loop
        assert await fetch(pool, address) == b"fine"
        assert len(connections) == 2
        assert pool.stale_retries == 0  # found before use, not by failing
        pool.close()


async def test_a_connection_idle_for_less_than_the_check_is_reused_unpolled_and_a_close_is_retried() -> None:
    """Under load a connection idles for milliseconds: no poll before reuse (a system call per request). One the
    replica closed all the same (a replica stopping) fails as stale and the request goes out again."""

    async def answer_then_close(writer: asyncio.StreamWriter) -> None:
        writer.write(ok(b"fine"))
        await writer.drain()
        writer.close()

    now = [100.0]
    async with serving(answers(answer_then_close)) as (address, connections):
        pool = UpstreamPool(FAST, clock=lambda: now[0])
        assert await fetch(pool, address) == b"fine"
        time.sleep(0.2)  # noqa: ASYNC251 (the loop must not run): the close is in the socket, not yet seen
        now[0] += upstream.IDLE_CHECK_AFTER_S / 2  # idle, by the pool's clock, for less than the check
        assert await fetch(pool, address) == b"fine"
        assert len(connections) == 2 and pool.stale_retries == 1  # sent, found closed, sent again
        pool.close()


async def test_a_reused_connection_closed_as_the_request_arrives_is_retried_once_on_a_fresh_one() -> None:
    async def close_without_answer(writer: asyncio.StreamWriter) -> None:
        writer.close()

    async with serving(answers(ok(b"one"), close_without_answer)) as (address, connections):
        pool = UpstreamPool(FAST)
        assert await fetch(pool, address) == b"one"
        assert await fetch(pool, address) == b"one"  # the second connection's first answer
        assert pool.stale_retries == 1
        assert len(connections) == 2
        pool.close()


async def test_a_reused_connection_dropped_while_the_replica_worked_is_its_failure_not_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(upstream, "STALE_WINDOW_S", 0.1)

    async def work_then_drop(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.3)  # the replica had the request: a crash, not a keep-alive race
        writer.close()

    async with serving(answers(ok(b"one"), work_then_drop)) as (address, connections):
        pool = UpstreamPool(FAST)
        assert await fetch(pool, address) == b"one"
        with pytest.raises(UpstreamError):
            await fetch(pool, address)
        assert pool.stale_retries == 0 and len(connections) == 1
        pool.close()


async def test_a_fresh_connection_closed_before_answering_is_an_error_not_retried() -> None:
    async def close_without_answer(writer: asyncio.StreamWriter) -> None:
        writer.close()

    async with serving(answers(close_without_answer)) as (address, connections):
        pool = UpstreamPool(FAST)
        with pytest.raises(UpstreamError):
            await fetch(pool, address)
        assert pool.stale_retries == 0 and len(connections) == 1
        pool.close()


@pytest.mark.parametrize(
    ("name", "value"),
    [("bad name", "x"), ("x-ok", "a\r\nevil: 1"), ("x-ok", "nul\x00"), ("", "x"), ("x-ok", "snow☃")],
)
async def test_invalid_request_headers_never_reach_the_wire(name: str, value: str) -> None:
    async with serving(answers(ok(b"{}"))) as (address, connections):
        pool = UpstreamPool(FAST)
        with pytest.raises(InvalidHeader):
            await pool.post(address, "/", b"", {name: value})
        assert not connections
        pool.close()


async def test_invalid_response_headers_are_a_protocol_error() -> None:
    async with serving(answers(b"HTTP/1.1 200 OK\r\nx-bad: a\x01b\r\ncontent-length: 0\r\n\r\n")) as (address, _):
        pool = UpstreamPool(FAST)
        with pytest.raises(UpstreamProtocolError):
            await pool.post(address, "/", b"", {})
        pool.close()


async def test_a_replica_that_does_not_read_the_request_hits_the_write_deadline() -> None:
    async def never_reads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(10)

    async with serving(never_reads) as (address, _):
        pool = UpstreamPool(Deadlines(connect_s=1.0, write_s=0.3, read_s=30.0, total_s=60.0))
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="write timeout"):
            await asyncio.wait_for(pool.post(address, "/", b"x" * (64 * 1024 * 1024), {}), 5)
        assert time.monotonic() - started < 3
        pool.close()


async def test_the_total_deadline_ends_an_answer_that_never_stops_trickling() -> None:
    async def trickle(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(100):
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)

    async with serving(answers(trickle)) as (address, _):
        pool = UpstreamPool(Deadlines(connect_s=1.0, write_s=1.0, read_s=1.0, total_s=0.5))
        response = await pool.post(address, "/", b"", {})
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="request timeout"):
            while await asyncio.wait_for(response.readany(), 5):
                pass
        assert time.monotonic() - started < 2
        pool.close()


# A chunk every 50 ms, 24 of them (1.2 s), under a read deadline of 0.5 s: a gap of up to 0.45 s (a busy
# machine's) between two chunks still reads on.
CHUNKS, READ_S = 24, 0.5


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_read_deadline_counts_from_the_last_byte_not_the_first_wait(loop: str) -> None:
    """The one timer a response keeps is moved on, not set per read: a stream that keeps sending past
    several read deadlines never times out, and one that then falls silent times out a read deadline
    after its last byte. On both event loops (the router serves on uvloop)."""

    async def trickle_then_stop(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(CHUNKS):
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
        await asyncio.sleep(10)

    async def run() -> tuple[int, float, float]:
        async with serving(answers(trickle_then_stop)) as (address, _):
            pool = UpstreamPool(Deadlines(connect_s=1.0, write_s=1.0, read_s=READ_S, total_s=30.0))
            response = await pool.post(address, "/", b"", {})
            started, received, last = time.monotonic(), 0, 0.0
            with pytest.raises(TimeoutError, match="read timeout"):
                while chunk := await asyncio.wait_for(response.readany(), 5):
                    received, last = received + len(chunk), time.monotonic()
            timed_out = time.monotonic()
            pool.close()
            return received, last - started, timed_out - last

    factory = None
    if loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        received, streamed_s, silent_s = runner.run(run())
    assert received == CHUNKS and streamed_s >= 2 * READ_S  # past two read deadlines, still read
    # One read deadline after the last byte; the upper bound leaves a loaded machine's scheduling slack.
    assert 0.75 * READ_S <= silent_s < 3 * READ_S


async def test_retry_after_is_read_and_other_headers_are_not_kept() -> None:
    answer = b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 7\r\nconnection: keep-alive\r\ncontent-length: 2\r\n\r\n"
    answer += b"{}"
    async with serving(answers(answer)) as (address, _):
        pool = UpstreamPool(FAST)
        response = await pool.post(address, "/", b"", {})
        assert (response.status, response.retry_after) == (429, "7")
        await response.read()
        pool.close()
