"""One batch line through the router's own request path, in process: an ASGI call into the hot path as
its batch's tenant at the `batch` class, so flow control, quotas, routing, retries, metrics and tracing see
it as any other request. Cancelled (the router stopping, the batch's window past), it is a client that left:
the replica's request is aborted."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.types import ASGIApp, Message

from dpserve.router.batch.store import Claimed
from dpserve.router.flow.tenants import CALLER_SCOPE_KEY, PRIORITY_HEADER, Caller

REPLICA_HEADER = b"x-dpserve-replica"
REQUEST_ID_HEADER = b"x-request-id"


@dataclass(frozen=True)
class LineAnswer:
    status: int
    body: bytes
    request_id: str
    replica: str | None
    """The replica that answered; None when the router refused the line itself (full, over a quota)."""
    retry_after_s: float | None


async def call_line(app: ASGIApp, line: Claimed, request_id: str) -> LineAnswer:
    body = line.body
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": line.url,
        "raw_path": line.url.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (PRIORITY_HEADER.encode(), b"batch"),
            (REQUEST_ID_HEADER, request_id.encode()),
        ],
        "client": None,
        "server": None,
        CALLER_SCOPE_KEY: Caller(line.tenant, False),
    }
    sent = False
    never = asyncio.get_running_loop().create_future()

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never  # no disconnect: the line's task is cancelled instead
        return {"type": "http.disconnect"}

    status = 0
    headers: dict[bytes, bytes] = {}
    chunks: list[bytes] = []

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            headers.update((name.lower(), value) for name, value in message.get("headers", ()))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await app(scope, receive, send)
    finally:
        never.cancel()
    replica = headers.get(REPLICA_HEADER)
    retry = headers.get(b"retry-after")
    return LineAnswer(
        status,
        b"".join(chunks),
        headers.get(REQUEST_ID_HEADER, request_id.encode()).decode("latin-1"),
        replica.decode("latin-1") if replica is not None else None,
        _seconds(retry),
    )


def _seconds(value: bytes | None) -> float | None:
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None
