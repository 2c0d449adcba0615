"""The proxied OpenAI endpoints as one raw ASGI app: the router's hot path.

Every request and every streamed chunk passes through here, so it skips the framework: no routing
table, no dependency solving, no Request or Response objects, one task (not two) watching for the
client leaving. The body is parsed once for what routing needs and relayed as the bytes it came in;
the answer is relayed as the bytes the replica sent. The rest of the router (admin, status, metrics)
stays on FastAPI, where per-request cost does not matter.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from starlette.types import Message, Receive, Scope, Send

from dpserve.disconnect import ClientGone
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.errors import OpenAIError, bad_request, model_not_found, no_replica, upstream_error_body
from dpserve.router.features import SESSION_HEADER
from dpserve.router.proxy import Buffered, Streaming
from dpserve.router.request_body import Endpoint, parse_body, read_limited, request_schema, with_model

if TYPE_CHECKING:
    from dpserve.router.app import RouterState

log = logging.getLogger("dpserve.router")

REPLICA_HEADER = "x-dpserve-replica"
REQUEST_ID_HEADER = "x-request-id"
CLIENT_CLOSED = 499  # nginx's convention for "client closed request", used in metrics only
_JSON = b"application/json"
# The only request headers the hot path reads (the session header for the session policy).
_READ_HEADERS = frozenset({b"content-length", REQUEST_ID_HEADER.encode(), SESSION_HEADER.encode()})


class ProxiedEndpoints:
    """Answers POST on the proxied paths; any other method there gets 405."""

    def __init__(self, state: RouterState, endpoints: Sequence[Endpoint]) -> None:
        self._state = state
        self._endpoints = {endpoint.path: endpoint for endpoint in endpoints}
        self._request_ids = RequestIds()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self._endpoints[scope["path"]]
        if scope["method"] != "POST":
            error = OpenAIError(
                405, f"Method {scope['method']} is not allowed on {endpoint.path}", headers={"allow": "POST"}
            )
            await _send_error(send, error, self._request_ids.next())
            return
        exchange = _Exchange(self._state, endpoint, scope, receive, send, self._request_ids)
        await exchange.run()


class _Exchange:
    """One request and its answer."""

    def __init__(
        self, state: RouterState, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send, ids: RequestIds
    ) -> None:
        self.state = state
        self.endpoint = endpoint
        self.receive = receive
        self.send = send
        self.started = time.perf_counter()
        self.headers = read_headers(scope["headers"])
        self.request_id = self.headers.get(REQUEST_ID_HEADER) or ids.next()
        self.response_started = False
        self.answered = False
        """The last message is on its way: from then on uvicorn reports the end of the exchange as a
        disconnect, which is not the client leaving."""
        self.client_gone = False

    async def run(self) -> None:
        state, endpoint = self.state, self.endpoint
        try:
            try:
                raw = await read_limited(self.headers, _body_chunks(self.receive), state.settings.max_body_bytes)
                parsed = parse_body(raw, endpoint)
                model = resolve_model(state.registry, parsed.model)
                assert state.features is not None and state.dispatcher is not None, "the lifespan has not started"
                features = await state.features.build(endpoint.name, model, parsed.stream, parsed.payload, self.headers)
                upstream_headers = {"content-type": "application/json", REQUEST_ID_HEADER: self.request_id}
                body = with_model(parsed, model)
            except OpenAIError as err:
                self._count_refusal(err)
                await _send_error(self.send, err, self.request_id)
                return
            except ClientGone:
                self._count_client_gone("none")
                return
            # From here on a client that leaves cancels this task, so the replica's request is dropped
            # (and aborted there) instead of computed for no one.
            watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(asyncio.current_task()))
            try:
                outcome = await state.dispatcher.send(endpoint.path, features, body, upstream_headers, self.started)
                if isinstance(outcome, Buffered):
                    await self._answer(outcome)
                else:
                    await self._relay(outcome)
            except OpenAIError as err:
                self._count_refusal(err)
                self.answered = True
                await _send_error(self.send, err, self.request_id)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not self.client_gone or task is None:
                    raise
                task.uncancel()
                if not self.response_started:
                    self._count_client_gone("none")
            finally:
                watcher.cancel()
        except Exception:
            # Logged here with its trace; the client gets no internals.
            log.exception("unhandled error on %s", endpoint.path)
            if not self.response_started:
                await _send_error(
                    self.send, OpenAIError(500, "Internal router error.", type="server_error"), self.request_id
                )
            else:
                await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _watch_disconnect(self, task: asyncio.Task[object] | None) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        if self.answered:
            return
        self.client_gone = True
        if task is not None:
            task.cancel()

    async def _answer(self, outcome: Buffered) -> None:
        metrics, endpoint = self.state.metrics, self.endpoint
        metrics.labeled(metrics.requests, endpoint.name, outcome.replica_id, str(outcome.status)).inc()
        metrics.labeled(metrics.duration, endpoint.name, "false").observe(time.perf_counter() - self.started)
        body, content_type = outcome.body, outcome.content_type.encode("latin-1")
        if outcome.status >= 400:
            # Always OpenAI-shaped JSON by now, whatever the replica's own content type was.
            body, content_type = upstream_error_body(outcome.status, body, endpoint.path), _JSON
        headers = [
            (b"content-type", content_type),
            (b"content-length", str(len(body)).encode()),
            *self._routing_headers(outcome.replica_id),
        ]
        self.response_started = True
        await self.send({"type": "http.response.start", "status": outcome.status, "headers": headers})
        self.answered = True
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def _relay(self, stream: Streaming) -> None:
        """Relays a stream as it comes; the upstream is always closed and accounted for."""
        open_streams = self.state.streams
        open_streams.add(stream)
        try:
            headers = [
                (b"content-type", stream.content_type.encode("latin-1")),
                *self._routing_headers(stream.replica_id),
            ]
            self.response_started = True
            send = self.send
            await send({"type": "http.response.start", "status": stream.status, "headers": headers})
            async for chunk in stream:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self.answered = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            open_streams.discard(stream)
            stream.finish()
            metrics, name = self.state.metrics, self.endpoint.name
            status = str(stream.status)
            if not stream.completed and not stream.broken:
                status = str(CLIENT_CLOSED)
                metrics.client_disconnects.labels(name).inc()
            metrics.labeled(metrics.requests, name, stream.replica_id, status).inc()
            metrics.labeled(metrics.duration, name, "true").observe(time.perf_counter() - self.started)

    def _routing_headers(self, replica_id: str) -> list[tuple[bytes, bytes]]:
        return [(REPLICA_HEADER.encode(), replica_id.encode()), (REQUEST_ID_HEADER.encode(), self.request_id.encode())]

    def _count_refusal(self, err: OpenAIError) -> None:
        metrics = self.state.metrics
        metrics.rejected.labels(str(err.status)).inc()
        metrics.labeled(metrics.requests, self.endpoint.name, "none", str(err.status)).inc()

    def _count_client_gone(self, replica_id: str) -> None:
        metrics = self.state.metrics
        metrics.client_disconnects.labels(self.endpoint.name).inc()
        metrics.labeled(metrics.requests, self.endpoint.name, replica_id, str(CLIENT_CLOSED)).inc()


class RequestIds:
    """Ids for requests that come without an `x-request-id`: a random prefix per router process and a
    counter, unique across routers and restarts without a random draw per request."""

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(8)
        self._count = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._count):016x}"


def read_headers(raw: Sequence[tuple[bytes, bytes]]) -> dict[str, str]:
    """The few request headers the hot path reads, by lower-case name (ASGI servers give names in lower
    case); the first of a repeated header wins, as `Headers.get` does."""
    found: dict[str, str] = {}
    for name, value in raw:
        if name in _READ_HEADERS:
            found.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return found


async def _body_chunks(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


async def _send_error(send: Send, error: OpenAIError, request_id: str) -> None:
    body = error.body()
    headers = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in error.headers.items()]
    headers += [
        (b"content-type", _JSON),
        (b"content-length", str(len(body)).encode()),
        (REQUEST_ID_HEADER.encode(), request_id.encode("latin-1")),
    ]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def resolve_model(registry: ReplicaRegistry, requested: str | None) -> str:
    if requested is None:
        only = registry.only_model()
        if only is not None:
            return only
        served = registry.served_models()
        if not served:
            raise no_replica("No healthy replica is serving a model right now.")
        raise bad_request(f"Missing `model`; this router serves: {', '.join(served)}.", param="model")
    if registry.serves(requested):
        return requested
    if requested in registry.known_models():
        raise no_replica(f"No healthy replica serves the model `{requested}` right now.")
    raise model_not_found(requested)


def proxied_openapi_paths(endpoints: Sequence[Endpoint]) -> dict[str, object]:
    """OpenAPI path items for the proxied endpoints, which FastAPI does not see."""
    return {
        endpoint.path: {
            "post": {
                "summary": f"OpenAI {endpoint.name}, routed to a replica",
                "operationId": endpoint.name,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": request_schema(endpoint)}},
                },
                "responses": {"200": {"description": "The replica's answer, relayed as it came (SSE when streaming)."}},
            }
        }
        for endpoint in endpoints
    }
