"""The router's protocol keeps uvicorn's keep-alive: an idle connection closes `timeout_keep_alive` after its
last answer, one kept busy stays open (it runs one timer that looks again, not one armed per request)."""

from __future__ import annotations

import asyncio

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from dpserve.router.http.protocol import bounded_protocol
from tests.conftest import free_port

KEEP_ALIVE_S = 1
"""uvicorn's setting is whole seconds (typed int: the compiled protocol takes it as one)."""


async def ok(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    if scope["query_string"] == b"slow":  # an answer that takes longer than the keep-alive
        await asyncio.sleep(1.5 * KEEP_ALIVE_S)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


GET = b"GET /health%s HTTP/1.1\r\nhost: x\r\n\r\n"
POST = b"POST /v1/completions%s HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"
"""A path the router proxies: its own cycle serves it."""


async def ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> None:
    writer.write(request % b"")
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert await reader.readexactly(2) == b"ok"


@pytest.mark.parametrize("proxied", [False, True], ids=["uvicorn-cycle", "proxied-cycle"])
async def test_an_idle_connection_closes_after_the_keep_alive_and_a_busy_one_stays(proxied: bool) -> None:
    port = free_port()
    http = bounded_protocol(1024, proxied_app=ok if proxied else None)
    config = uvicorn.Config(ok, host="127.0.0.1", port=port, http=http, log_level="error", lifespan="off")
    config.timeout_keep_alive = KEEP_ALIVE_S
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    loop = asyncio.get_running_loop()
    try:
        while not server.started:
            assert not task.done(), task.result()
            await asyncio.sleep(0.02)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = POST if proxied else GET
        # Busy for longer than the keep-alive: a request every third of it. The connection stays.
        started = loop.time()
        while loop.time() - started < 1.5 * KEEP_ALIVE_S:
            await ask(reader, writer, request)
            await asyncio.sleep(KEEP_ALIVE_S / 3)
        # A request answered after longer than the keep-alive: being answered is not idle.
        writer.write(request % b"?slow")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        assert await reader.readexactly(2) == b"ok"
        last_answer = loop.time()
        # Idle: the router closes it, not before the keep-alive, and not long after.
        assert await asyncio.wait_for(reader.read(), timeout=10 * KEEP_ALIVE_S) == b""
        idle = loop.time() - last_answer
        assert KEEP_ALIVE_S * 0.9 <= idle <= KEEP_ALIVE_S * 3, idle
        writer.close()
    finally:
        server.should_exit = True
        await task
