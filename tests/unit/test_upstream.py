"""The hot path's HTTP client against small scripted servers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from dpserve.router.http.upstream_client import Address, Deadlines, UpstreamConnectError, UpstreamError, UpstreamPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[Address, list[int]]]:
    """A server on a free loopback port; yields its address and the number of connections it accepted."""
    connections: list[int] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield Address("127.0.0.1", port), connections
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head, await reader.readexactly(length)


def keep_alive_json(body: bytes) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
            writer.write(body)
            await writer.drain()

    return handle


async def test_answers_are_read_whole_and_connections_reused() -> None:
    async with serving(keep_alive_json(b'{"ok":true}')) as (address, connections):
        pool = UpstreamPool(Deadlines(connect_s=1.0, read_s=5.0))
        for _ in range(3):
            response = await pool.post(address, "/v1/completions", b"{}", {"content-type": "application/json"})
            assert (response.status, response.content_type) == (200, "application/json")
            assert await response.read() == b'{"ok":true}'
        assert len(connections) == 1
        pool.close()


async def test_the_request_goes_out_as_sent() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()

    async with serving(handle) as (address, _):
        pool = UpstreamPool(Deadlines(connect_s=1.0, read_s=5.0))
        response = await pool.post(address, "/v1/chat/completions", b'{"a":1}', {"x-request-id": "abc"})
        assert response.status == 204 and await response.read() == b""
        head, body = seen[0]
        assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n") and b"x-request-id: abc\r\n" in head
        assert body == b'{"a":1}'
        with pytest.raises(ValueError):
            await pool.post(address, "/x", b"", {"x-request-id": "a\r\nevil: 1"})
        pool.close()


async def test_chunked_streams_arrive_decoded_in_order() -> None:
    events = [b"data: %d\n\n" % i for i in range(20)]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for event in events:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.sleep(0.001)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()  # keep the connection until the client is done

    async with serving(handle) as (address, _):
        pool = UpstreamPool(Deadlines(connect_s=1.0, read_s=5.0))
        response = await pool.post(address, "/v1/completions", b"{}", {})
        assert response.content_type == "text/event-stream"
        received = b""
        while chunk := await response.readany():
            received += chunk
        assert received == b"".join(events)
        response.release()
        pool.close()


async def test_nothing_listening_is_a_connect_error() -> None:
    async with serving(keep_alive_json(b"")) as (address, _):
        pass  # closed: the port is free again
    with pytest.raises(UpstreamConnectError):
        await UpstreamPool(Deadlines(connect_s=1.0, read_s=5.0)).post(address, "/", b"", {})


async def test_a_replica_dying_mid_answer_is_an_upstream_error() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        await writer.drain()

    async with serving(handle) as (address, _):
        response = await UpstreamPool(Deadlines(connect_s=1.0, read_s=5.0)).post(address, "/", b"", {})
        with pytest.raises(UpstreamError):
            await response.read()


async def test_a_silent_replica_times_out() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async with serving(handle) as (address, _):
        with pytest.raises(TimeoutError):
            await UpstreamPool(Deadlines(connect_s=1.0, read_s=0.2)).post(address, "/", b"", {})


async def test_garbage_from_a_replica_is_an_upstream_error() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"this is not HTTP\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async with serving(handle) as (address, _):
        with pytest.raises(UpstreamError):
            await UpstreamPool(Deadlines(connect_s=1.0, read_s=5.0)).post(address, "/", b"", {})


async def test_idle_connections_past_keep_alive_are_not_reused() -> None:
    now = [0.0]
    async with serving(keep_alive_json(b"{}")) as (address, connections):
        pool = UpstreamPool(Deadlines(connect_s=1.0, read_s=5.0), keepalive_s=4.0, clock=lambda: now[0])
        await (await pool.post(address, "/", b"", {})).read()
        now[0] += 3.0
        await (await pool.post(address, "/", b"", {})).read()
        assert len(connections) == 1
        now[0] += 4.5
        await (await pool.post(address, "/", b"", {})).read()
        assert len(connections) == 2
        pool.close()


async def test_a_closed_response_drops_its_connection() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        assert await reader.read() == b""  # the router hung up: an engine would abort the request here
        closed.set()

    closed = asyncio.Event()
    async with serving(handle) as (address, _):
        pool = UpstreamPool(Deadlines(connect_s=1.0, read_s=5.0))
        response = await pool.post(address, "/", b"", {})
        assert await response.readany() == b"hello"
        response.close()
        await asyncio.wait_for(closed.wait(), 2)
        with pytest.raises(UpstreamError):
            await response.readany()
        pool.close()


def test_addresses_come_from_replica_urls() -> None:
    assert Address.from_url("http://10.0.0.5:8000") == Address("10.0.0.5", 8000)
    assert Address.from_url("https://replica.example/base/") == Address("replica.example", 443, True, "/base")
    assert Address.from_url("http://[::1]:9000").host_header == "[::1]:9000"
    with pytest.raises(ValueError):
        Address.from_url("ftp://x")
