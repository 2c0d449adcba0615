"""HTTP/1.1 as clients speak it to the router, on raw sockets: the proxied paths (served by the router's own
cycle, `http/protocol.py`) and the control plane (uvicorn's) on one connection, pipelining, HTTP/1.0,
`Expect: 100-continue`, chunked request bodies, HEAD, `connection: close`, a client gone mid-body. What a
client reads is checked byte for byte where the framing is the point."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.conftest import RouterProcess, SimProcess, running_sim, start_router, stop_router

pytestmark = pytest.mark.integration

BODY = json.dumps({"prompt": "hello there", "max_tokens": 3}).encode()
STREAM_BODY = json.dumps({"prompt": "hello there", "max_tokens": 3, "stream": True}).encode()


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with running_sim() as started:
        yield started


@pytest.fixture(scope="module")
def router(sim: SimProcess) -> Iterator[RouterProcess]:
    started = start_router([sim.url], "least_loaded")
    yield started
    stop_router(started)


def connect(router: RouterProcess) -> socket.socket:
    host, port = router.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=20)


def post(path: str, body: bytes, *headers: str, version: str = "1.1") -> bytes:
    lines = [f"POST {path} HTTP/{version}", "host: router", "content-type: application/json", *headers]
    return ("\r\n".join([*lines, f"content-length: {len(body)}"]) + "\r\n\r\n").encode() + body


class Reader:
    """Responses off one socket, framed by their own content-length or chunks."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buffer += data
        return bool(data)

    def _until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            if not self._fill():
                raise ConnectionError(f"closed before {marker!r}: {self.buffer[:300]!r}")
        head, _, self.buffer = self.buffer.partition(marker)
        return head

    def _take(self, count: int) -> bytes:
        while len(self.buffer) < count:
            if not self._fill():
                raise ConnectionError("closed mid-body")
        taken, self.buffer = self.buffer[:count], self.buffer[count:]
        return taken

    def response(self, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        status_line, *lines = self._until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        headers: dict[str, str] = {}
        for line in lines:
            name, _, value = line.partition(":")
            assert name.lower() not in headers, f"{name} twice"
            headers[name.lower()] = value.strip()
        status = int(status_line.split()[1])
        if head_only or status in (100, 204, 304):
            return status, headers, b""
        if headers.get("transfer-encoding") == "chunked":
            assert "content-length" not in headers
            body = b""
            while size := int(self._until(b"\r\n"), 16):
                body += self._take(size)
                assert self._take(2) == b"\r\n"
            assert self._take(2) == b"\r\n"
            return status, headers, body
        return status, headers, self._take(int(headers["content-length"]))

    def closed(self) -> bool:
        """True once the router has closed the connection (after what was read)."""
        return not self.buffer and not self._fill()


def test_pipelined_requests_are_answered_in_order_proxied_and_control_plane_alike(router: RouterProcess) -> None:
    with connect(router) as sock:
        reader = Reader(sock)
        health = b"GET /health HTTP/1.1\r\nhost: router\r\n\r\n"
        stream = post("/v1/completions", STREAM_BODY, "x-request-id: second")
        sock.sendall(post("/v1/completions", BODY, "x-request-id: first") + health + stream + health)
        first, health_1, second, health_2 = (reader.response() for _ in range(4))
        assert first[0] == 200 and first[1]["x-request-id"] == "first" and json.loads(first[2])["choices"]
        assert second[0] == 200 and second[1]["x-request-id"] == "second" and second[2].endswith(b"data: [DONE]\n\n")
        assert health_1[0] == health_2[0] == 200
        sock.sendall(post("/v1/completions", BODY))  # the connection is still good for more
        assert reader.response()[0] == 200


def test_http_1_0_gets_its_answer_and_the_connection_closes(router: RouterProcess) -> None:
    with connect(router) as sock:
        reader = Reader(sock)
        sock.sendall(post("/v1/completions", BODY, version="1.0"))
        status, headers, body = reader.response()
        assert status == 200 and json.loads(body)["object"] == "text_completion"
        assert headers.get("connection") == "close" and reader.closed()


def test_connection_close_from_the_client_is_honoured_after_the_answer(router: RouterProcess) -> None:
    with connect(router) as sock:
        reader = Reader(sock)
        sock.sendall(post("/v1/completions", STREAM_BODY, "connection: close"))
        status, headers, body = reader.response()
        assert status == 200 and body.endswith(b"data: [DONE]\n\n") and headers.get("connection") == "close"
        assert reader.closed()


def test_expect_100_continue_is_answered_before_the_body_is_sent(router: RouterProcess) -> None:
    with connect(router) as sock:
        reader = Reader(sock)
        request = post("/v1/completions", BODY, "expect: 100-continue")
        head, body = request[: request.index(b"\r\n\r\n") + 4], request[request.index(b"\r\n\r\n") + 4 :]
        sock.sendall(head)
        assert reader.response()[0] == 100  # the router asked for the body
        sock.sendall(body)
        status, _, answer = reader.response()
        assert status == 200 and json.loads(answer)["choices"]


def test_a_chunked_request_body_in_pieces_is_read_whole(router: RouterProcess) -> None:
    with connect(router) as sock:
        reader = Reader(sock)
        head = b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
        sock.sendall(head + b"transfer-encoding: chunked\r\n\r\n")
        for start in range(0, len(BODY), 7):
            piece = BODY[start : start + 7]
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            time.sleep(0.01)
        sock.sendall(b"0\r\n\r\n")
        status, _, answer = reader.response()
        assert status == 200 and json.loads(answer)["choices"]


def test_head_and_get_of_a_bodiless_endpoint_frame_their_answers(router: RouterProcess) -> None:
    """GET /version is relayed (the sim has none: its 404, as JSON); a HEAD's answer is a head alone."""
    with connect(router) as sock:
        reader = Reader(sock)
        get = b"GET /version HTTP/1.1\r\nhost: router\r\n\r\n"
        sock.sendall(get)
        status, _, body = reader.response()
        assert status == 404 and json.loads(body)["error"]
        sock.sendall(b"HEAD /version HTTP/1.1\r\nhost: router\r\n\r\n" + get)
        reader.response(head_only=True)
        assert reader.response()[0] == 404  # the next answer starts where the head's ended


def test_a_bad_body_and_an_unknown_model_are_openai_errors_on_a_connection_that_goes_on(router: RouterProcess) -> None:
    with connect(router) as sock:
        reader = Reader(sock)
        sock.sendall(post("/v1/completions", b"{not json"))
        status, headers, body = reader.response()
        assert status == 400 and headers["content-type"] == "application/json" and json.loads(body)["error"]
        sock.sendall(post("/v1/completions", json.dumps({"model": "nope", "prompt": "x"}).encode()))
        status, _, body = reader.response()
        assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
        sock.sendall(post("/v1/completions", BODY))
        assert reader.response()[0] == 200


def test_a_client_gone_mid_body_harms_no_other_request(router: RouterProcess) -> None:
    for _ in range(3):
        with connect(router) as sock:
            request = post("/v1/completions", BODY)
            sock.sendall(request[: len(request) - 5])  # the head and most of the body, then gone
    with connect(router) as sock:
        reader = Reader(sock)
        sock.sendall(post("/v1/completions", BODY))
        assert reader.response()[0] == 200
    assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200
