"""A stand-in replica that speaks raw HTTP/1.1, for what a real vLLM cannot be made to do on demand
(answers of 20 MB, a Retry-After, a keep-alive connection closed as a request arrives, audio). It
runs in its own thread and event loop, so a router process started from a blocking test can probe it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import httptools
import orjson


@dataclass
class Seen:
    """One request as the replica received it; `index` counts requests on its connection from 0."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    index: int


Script = Callable[[Seen], bytes | None]
"""The bytes to answer with (written at once), or None to close the connection without answering."""


def json_answer(payload: object, status: int = 200, extra: bytes = b"") -> bytes:
    body = orjson.dumps(payload)
    reason = {200: b"OK", 404: b"Not Found", 429: b"Too Many Requests", 503: b"Service Unavailable"}
    return b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        status,
        reason.get(status, b"Status"),
        len(body),
        extra,
        body,
    )


@dataclass
class RawReplica:
    routes: dict[str, Script]
    model: str = "m"
    seen: list[Seen] = field(default_factory=list)
    url: str = ""

    def __post_init__(self) -> None:
        defaults: dict[str, Script] = {
            "/health": lambda seen: b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
            "/v1/models": lambda seen: json_answer({"object": "list", "data": [{"id": self.model, "object": "model"}]}),
            "/metrics": lambda seen: b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
        }
        self.routes = {**defaults, **self.routes}
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RawReplica:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def requests(self, path: str) -> list[Seen]:
        return [seen for seen in self.seen if seen.path.split("?")[0] == path]

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0, limit=2**26))
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parsed: list[Seen] = []
        parts: dict[str, object] = {"url": b"", "headers": {}, "body": []}

        class Callbacks:
            def on_url(self, url: bytes) -> None:
                parts["url"] = parts["url"] + url  # type: ignore[operator]

            def on_header(self, name: bytes, value: bytes) -> None:
                parts["headers"][name.decode().lower()] = value.decode("latin-1")  # type: ignore[index]

            def on_body(self, body: bytes) -> None:
                parts["body"].append(body)  # type: ignore[attr-defined]

            def on_message_complete(self) -> None:
                method = parser.get_method().decode()
                body = b"".join(parts["body"])  # type: ignore[arg-type]
                seen = Seen(method, parts["url"].decode(), dict(parts["headers"]), body, len(parsed))  # type: ignore[attr-defined, arg-type]
                parsed.append(seen)
                parts.update(url=b"", headers={}, body=[])

        parser = httptools.HttpRequestParser(Callbacks())
        handled = 0
        try:
            while data := await reader.read(1 << 20):
                parser.feed_data(data)
                while handled < len(parsed):
                    seen = parsed[handled]
                    handled += 1
                    path = seen.path.split("?")[0]
                    if path not in ("/health", "/metrics", "/v1/models"):
                        self.seen.append(seen)
                    script = self.routes.get(path)
                    if script is None:
                        answer: bytes | None = json_answer({"detail": "Not Found"}, 404)
                    else:
                        answer = script(seen)
                    if answer is None:
                        return
                    writer.write(answer)
                    await writer.drain()
        except (ConnectionError, httptools.HttpParserError):
            pass
        finally:
            writer.close()
