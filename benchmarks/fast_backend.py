"""A scripted OpenAI-style backend that answers in microseconds, so that a router in front of it is the
bottleneck (`dpserve bench overhead --backend fast`). A `dpserve sim --speed 0` still runs a scheduler, a
tokenizer and uvicorn per request and serves fewer requests a second than the routers can push, so over sims
the benchmark partly measures the sims.

One process, one port, raw asyncio protocol on uvloop: HTTP/1.1 keep-alive, requests with Content-Length
bodies (what routers send). Answers:
  * POST /v1/completions and /v1/chat/completions: `max_tokens` tokens, as one JSON answer or, with
    `"stream": true`, as that many SSE chunks (one write each, so a router relays them one by one, as from
    vLLM), then a usage chunk when `stream_options.include_usage` asks for it, then `[DONE]`; chunked
    transfer encoding, as uvicorn streams;
  * GET /health: 200; GET /v1/models: the one model; GET /metrics: vLLM's load gauges at 0;
  * anything else: 404.

    python -m benchmarks.fast_backend --port 8100 [--model dpserve-tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from collections.abc import Sequence

import orjson

MAX_TOKENS = 4096
MAX_HEAD = 64 * 1024


def _response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-length: {len(body)}\r\n".encode()
    return head + b"content-type: " + content_type + b"\r\n\r\n" + body


def _metrics(model: str) -> bytes:
    labels = f'{{engine="0",model_name="{model}"}}'
    lines = [f"vllm:num_requests_running{labels} 0.0", f"vllm:num_requests_waiting{labels} 0.0"]
    lines.append(f"vllm:kv_cache_usage_perc{labels} 0.0")
    return ("\n".join(lines) + "\n").encode()


class Answers:
    """The canned answers, built once per model; per request only the token count varies."""

    def __init__(self, model: str) -> None:
        self.model = model
        models = {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "dpserve", "root": model}]}
        self.get = {
            b"/health": _response("200 OK", b""),
            b"/v1/models": _response("200 OK", orjson.dumps(models)),
            b"/metrics": _response("200 OK", _metrics(model), b"text/plain; version=0.0.4"),
        }
        self.not_found = _response("404 Not Found", b'{"error":{"message":"not found","type":"not_found"}}')
        self.bad_request = _response("400 Bad Request", b'{"error":{"message":"bad body","type":"invalid"}}')

    def json(self, chat: bool, tokens: int) -> bytes:
        text = " tok" * tokens
        choice: dict[str, object] = {"index": 0, "finish_reason": "length", "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        body = {
            "id": "cmpl-fast",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens},
        }
        return _response("200 OK", orjson.dumps(body))

    def chunks(self, chat: bool, tokens: int, usage: bool) -> list[bytes]:
        """The stream's chunks, each already framed for chunked transfer encoding, the last one ending it."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        events = []
        for index in range(tokens):
            delta: dict[str, object] = {"delta": {"content": " tok"}} if chat else {"text": " tok"}
            choice = {"index": 0, "finish_reason": "length" if index == tokens - 1 else None, **delta}
            event = {"id": "cmpl-fast", "object": kind, "created": 0, "model": self.model, "choices": [choice]}
            if usage:
                event["usage"] = None
            events.append(b"data: " + orjson.dumps(event) + b"\n\n")
        if usage:
            counts = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}
            last = {
                "id": "cmpl-fast",
                "object": kind,
                "created": 0,
                "model": self.model,
                "choices": [],
                "usage": counts,
            }
            events.append(b"data: " + orjson.dumps(last) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        framed = [f"{len(event):x}\r\n".encode() + event + b"\r\n" for event in events]
        framed[-1] += b"0\r\n\r\n"
        return framed


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class Connection(asyncio.Protocol):
    """One client connection: requests parsed from the buffer one after another (keep-alive)."""

    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.streaming = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while not self.streaming and self._one_request():
            pass

    def _one_request(self) -> bool:
        """Answers the first whole request in the buffer; False when there is none yet."""
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD and self.transport is not None:
                self.transport.close()
            return False
        head = self.buffer[:end].split(b"\r\n")
        method, _, rest = head[0].partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0]
        length = 0
        for line in head[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        if len(self.buffer) < end + 4 + length:
            return False
        body = self.buffer[end + 4 : end + 4 + length]
        self.buffer = self.buffer[end + 4 + length :]
        self._answer(method, path, body)
        return True

    def _answer(self, method: bytes, path: bytes, body: bytes) -> None:
        assert self.transport is not None
        if method == b"GET":
            self.transport.write(self.answers.get.get(path, self.answers.not_found))
            return
        if path not in (b"/v1/completions", b"/v1/chat/completions"):
            self.transport.write(self.answers.not_found)
            return
        try:
            request = orjson.loads(body)
            tokens = max(1, min(int(request.get("max_tokens") or 16), MAX_TOKENS))
        except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError):
            self.transport.write(self.answers.bad_request)
            return
        chat = path == b"/v1/chat/completions"
        if not request.get("stream"):
            self.transport.write(self.answers.json(chat, tokens))
            return
        options = request.get("stream_options")
        usage = isinstance(options, dict) and bool(options.get("include_usage"))
        chunks = self.answers.chunks(chat, tokens, usage)
        self.transport.write(STREAM_HEAD + chunks[0])
        self.streaming = True
        asyncio.get_running_loop().call_soon(self._write_rest, chunks, 1)

    def _write_rest(self, chunks: list[bytes], index: int) -> None:
        """One chunk a loop turn: each is its own write, as a server streaming tokens sends them."""
        if self.transport is None:
            return
        self.transport.write(chunks[index])
        if index + 1 < len(chunks):
            asyncio.get_running_loop().call_soon(self._write_rest, chunks, index + 1)
            return
        self.streaming = False
        while not self.streaming and self._one_request():
            pass


async def serve(host: str, port: int, model: str) -> None:
    answers = Answers(model)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Connection(answers), host, port, backlog=1024, reuse_address=True)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with server:
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fast_backend", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="dpserve-tiny")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args.host, args.port, args.model))
    else:
        uvloop.run(serve(args.host, args.port, args.model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
