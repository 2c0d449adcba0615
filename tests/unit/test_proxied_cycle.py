"""The proxied cycle's framing and its body hand-over, over a transport that records what it was given (the
wire itself: tests/integration/test_router_http.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.types import Message
from uvicorn.protocols.http.flow_control import FlowControl

from dpserve.router.http.protocol import ProxiedCycle


class Recorder:
    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


def cycle(method: str = "POST", keep_alive: bool = True, expect_100: bool = False) -> tuple[ProxiedCycle, Recorder]:
    transport = Recorder()
    wire: Any = transport  # what the cycle uses of a transport
    ended: list[int] = []
    scope: dict[str, Any] = {"type": "http", "method": method, "path": "/v1/completions"}
    made = ProxiedCycle(
        scope, wire, FlowControl(wire), [(b"server", b"x")], expect_100, keep_alive, lambda: ended.append(1)
    )
    return made, transport


def start(status: int, *headers: tuple[bytes, bytes]) -> dict[str, Any]:
    return {"type": "http.response.start", "status": status, "headers": list(headers)}


def body(data: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


async def answer(made: ProxiedCycle, *messages: dict[str, Any]) -> None:
    for message in messages:
        await made.send(message)


def test_a_sized_answer_is_its_head_then_its_body_and_the_connection_stays() -> None:
    made, transport = cycle()
    asyncio.run(answer(made, start(200, (b"content-length", b"2"), (b"x-a", b"b")), body(b"ok")))
    assert transport.written == b"HTTP/1.1 200 OK\r\nserver: x\r\ncontent-length: 2\r\nx-a: b\r\n\r\nok"
    assert made.response_complete and not transport.closed


def test_an_unsized_answer_is_chunked_and_ends_with_the_last_chunk() -> None:
    made, transport = cycle()
    asyncio.run(answer(made, start(200, (b"content-type", b"text/event-stream")), body(b"abc", True), body(b"")))
    head, _, chunks = transport.written.partition(b"\r\n\r\n")
    assert head.endswith(b"transfer-encoding: chunked") and chunks == b"3\r\nabc\r\n0\r\n\r\n"
    made, transport = cycle()
    asyncio.run(answer(made, start(200), body(b"abc", False)))
    assert transport.written.endswith(b"\r\n\r\n3\r\nabc\r\n0\r\n\r\n")


def test_no_keep_alive_says_close_and_closes_after_the_answer() -> None:
    made, transport = cycle(keep_alive=False)
    asyncio.run(answer(made, start(204), body(b"")))
    assert b"connection: close\r\n" in transport.written and b"chunked" not in transport.written
    assert transport.closed


def test_a_head_request_gets_no_body() -> None:
    made, transport = cycle(method="HEAD")
    asyncio.run(answer(made, start(200, (b"content-length", b"5")), body(b"hello")))
    assert transport.written.endswith(b"content-length: 5\r\n\r\n") and made.response_complete


@pytest.mark.parametrize("value", [b"a\tb", b"caf\xe9", b"\xa0\x85", b"plain text"])
def test_a_tab_or_obs_text_in_a_header_value_is_written(value: bytes) -> None:
    made, transport = cycle()
    asyncio.run(answer(made, start(200, (b"x-note", value), (b"content-length", b"0")), body(b"")))
    assert b"x-note: " + value + b"\r\n" in transport.written


@pytest.mark.parametrize("value", [b"a\r\nx-injected: 1", b"a\x00b", b"\x7f", b"\xe9\x1b", b"a\nb"])
def test_a_control_character_in_a_header_value_is_refused_before_anything_is_written(value: bytes) -> None:
    made, transport = cycle()
    with pytest.raises(RuntimeError, match="control character"):
        asyncio.run(answer(made, start(200, (b"x-request-id", value))))
    assert transport.written == b""


def test_a_body_longer_or_shorter_than_its_length_is_an_error() -> None:
    made, _ = cycle()
    with pytest.raises(RuntimeError, match="longer"):
        asyncio.run(answer(made, start(200, (b"content-length", b"1")), body(b"ab")))
    made, _ = cycle()
    with pytest.raises(RuntimeError, match="shorter"):
        asyncio.run(answer(made, start(200, (b"content-length", b"3")), body(b"ab")))


def test_a_complete_body_is_handed_over_at_once_then_receive_waits_for_the_client_to_leave() -> None:
    async def scenario() -> list[Message]:
        made, _ = cycle()
        made.body += b'{"a": 1}'
        made.more_body = False
        first = await made.receive()
        waiting = asyncio.create_task(made.receive())
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing more to hand over until something happens
        made.disconnected = True
        made.message_event.set()
        return [first, await waiting]

    first, second = asyncio.run(scenario())
    assert first == {"type": "http.request", "body": b'{"a": 1}', "more_body": False}
    assert second == {"type": "http.disconnect"}


def test_a_body_in_pieces_is_handed_over_as_it_comes_after_a_100_continue() -> None:
    async def scenario() -> tuple[list[Message], bytes]:
        made, transport = cycle(expect_100=True)
        got = asyncio.create_task(made.receive())
        await asyncio.sleep(0)
        made.body += b"ab"
        made.message_event.set()
        pieces = [await got]
        made.body += b"c"
        made.more_body = False
        made.message_event.set()
        pieces.append(await made.receive())
        return pieces, transport.written

    pieces, written = asyncio.run(scenario())
    assert written == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert [(p["body"], p["more_body"]) for p in pieces] == [(b"ab", True), (b"c", False)]


def test_a_path_that_fails_before_answering_gets_an_openai_500_and_the_connection_closes() -> None:
    async def failing(scope: Any, receive: Any, send: Any) -> None:
        raise ValueError("a bug on the proxied path")

    made, transport = cycle()
    asyncio.run(made.run_asgi(failing))
    head, _, body = transport.written.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 500 ") and b"connection: close" in head
    assert json.loads(body)["error"]["code"] == "internal_error" and transport.closed
