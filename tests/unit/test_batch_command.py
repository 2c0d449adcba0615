"""`dpserve batch` against servers that are not a router's batches API: one line saying what was wrong, exit 1,
never a traceback; the batch id sent as one path segment."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from dpserve.router.batch.follow import run_batch_command

ANSWERS = {
    "/v1/batches?limit=100": (200, b"<html>a web page</html>"),
    "/v1/batches/shapeless": (200, b'{"id": "shapeless"}'),
    "/v1/batches/..%2Ffiles": (404, b'{"error": {"message": "no such batch"}}'),
}


class Answers(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        status, body = ANSWERS.get(self.path, (500, b"unexpected path " + self.path.encode()))
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    made = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    thread = threading.Thread(target=made.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{made.server_address[1]}"
    finally:
        made.shutdown()


@pytest.mark.parametrize(
    ("batch_id", "key", "says"),
    [
        (None, None, "the answer is not JSON"),
        ("shapeless", None, "not an OpenAI batch answer (no 'status' field)"),
        ("../files", None, "404 no such batch"),  # quoted: the server saw one segment, not /v1/files
        (None, "a\nb", "the key cannot be sent"),
    ],
)
def test_a_server_that_is_no_batches_api_gets_one_line_and_exit_1(
    server: str, batch_id: str | None, key: str | None, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    shown: list[str] = []
    assert run_batch_command(server, key, batch_id, False, write=shown.append) == 1
    err = capsys.readouterr().err
    assert err.startswith("dpserve batch: ") and says in err and "Traceback" not in err, err
    assert "a\nb" not in err  # a key is never echoed
