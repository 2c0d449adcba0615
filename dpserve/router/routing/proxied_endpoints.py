"""The proxied OpenAI endpoints as one raw ASGI app: the router's hot path.

Every request and every streamed chunk passes through here, so it skips the framework's own per-request
work: no routing table, no dependency solving, no Request or Response objects, one task (not two)
watching for the client leaving. It still sits inside the app's middleware (`http/proxied_paths.py`), so
access control, and anything added later, wraps it as it wraps the rest. The body is parsed once for
what routing needs and relayed as the bytes it came in; the answer is relayed as the bytes the replica
sent. The rest of the router (admin, status, metrics) is FastAPI's routes, where per-request cost does
not matter.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive, Scope, Send

from dpserve.config import TRUE_WORDS
from dpserve.disconnect import ClientGone, until_disconnect
from dpserve.policies.base import RequestFeatures
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.flow.gate import Flow, Pass, with_fields
from dpserve.router.flow.slo import SLO_HEADERS, slo_of
from dpserve.router.flow.tenants import CALLER_SCOPE_KEY, PRIORITY_HEADER, TENANT_HEADER, Priority, Tenant
from dpserve.router.flow.usage_stream import UsageTap, ask_for_usage, usage_of_answer
from dpserve.router.http.endpoints import (
    CHAT,
    COMPLETIONS,
    RESPONSE_BY_ID,
    RESPONSES,
    VERSION,
    BodyKind,
    Endpoint,
    by_id_endpoint,
    path_response_id,
    route,
)
from dpserve.router.http.errors import (
    CLIENT_CLOSED,
    OpenAIError,
    bad_request,
    model_not_found,
    no_replica,
    replica_misconfigured,
    upstream_error_body,
)
from dpserve.router.http.protocol import CLIENT_LEFT, ClientLeft
from dpserve.router.http.request_body import (
    parse_body,
    parse_form,
    receive_limited,
    request_schema,
)
from dpserve.router.http.stored_responses import ResponseOwners, id_of_answer, id_of_stream
from dpserve.router.http.upstream_client import InvalidHeader, check_header
from dpserve.router.observe.life import RequestLife, Usage
from dpserve.router.observe.logs import RequestLog, request_fields
from dpserve.router.observe.metrics import RouterMetrics
from dpserve.router.observe.tracing import TRACE_HEADERS, Tracing, trace_context
from dpserve.router.quality.latency_watch import SloBook
from dpserve.router.quality.receipts import Receipt, ReceiptBook
from dpserve.router.quality.shadows import ShadowScorer
from dpserve.router.routing.dispatch import Buffered, Dispatcher, Outbound, Streaming
from dpserve.router.routing.features import SESSION_HEADER, FeatureBuilder
from dpserve.router.scale.cold_start import ColdStart

log = logging.getLogger("dpserve.router")

REPLICA_HEADER = "x-dpserve-replica"
REQUEST_ID_HEADER = "x-request-id"
PREDICTED_TTFT_HEADER = b"x-dpserve-predicted-ttft-ms"
"""With a receipt asked for: the time to first token the policy predicted at the replica it chose."""
RECEIPT_HEADER = "x-dpserve-receipt"
"""`1` (or true, yes, on): this request gets a routing receipt whatever the sample, and its answer the
predicted cached tokens in `x-dpserve-cached-tokens` (when the policy predicted any)."""
CACHED_TOKENS_HEADER = b"x-dpserve-cached-tokens"
_REPLICA_HEADER = REPLICA_HEADER.encode()
_REQUEST_ID_HEADER = REQUEST_ID_HEADER.encode()
_JSON = b"application/json"
# The only request headers the hot path reads (the session header for the session policy; the content
# type for multipart bodies, whose boundary the replica needs; the tenant and priority for flow control).
_READ_HEADERS = frozenset(
    {
        b"content-length",
        b"content-type",
        REQUEST_ID_HEADER.encode(),
        SESSION_HEADER.encode(),
        TENANT_HEADER.encode(),
        PRIORITY_HEADER.encode(),
        RECEIPT_HEADER.encode(),
        *(name.encode() for name in SLO_HEADERS),
        *(name.encode() for name in TRACE_HEADERS),
    }
)
# Streams whose usage the router can ask for (`stream_options.include_usage`) and take out again.
_USAGE_ON_REQUEST = frozenset({CHAT.name, COMPLETIONS.name})
_TRACEPARENT = TRACE_HEADERS[0]
MAX_REQUEST_ID_CHARS = 128
NO_BODY_STATUSES = frozenset({204, 304})


@dataclass(frozen=True)
class Relaying:
    """What an exchange needs, all of it there from the start."""

    registry: ReplicaRegistry
    catalog: ModelCatalog
    features: FeatureBuilder
    dispatcher: Dispatcher
    metrics: RouterMetrics
    response_owners: ResponseOwners
    """Which replica stored which response (`/v1/responses`)."""
    max_body_bytes: int
    flow: Flow
    receipts: ReceiptBook
    shadows: ShadowScorer | None
    """`--shadow-policy`: shown each decision, to say what they would have chosen (no traffic follows)."""
    tracing: Tracing | None = None
    """`--otlp-traces-endpoint`: each request's spans."""
    access_log: bool = False
    """`--access-log`: a line per request."""
    slo: SloBook | None = None
    """The policy predicts time (`--policy slo`): requests' SLOs are read, and the latency models fed."""
    cold_start: ColdStart | None = None
    """`--cold-start-wait`: a request no replica serves waits for one to start."""


class ProxiedEndpoints:
    """Answers the proxied paths (`endpoints`, and stored responses by id); another method there gets 405."""

    def __init__(self, relaying: Relaying, endpoints: Sequence[Endpoint]) -> None:
        self._relaying = relaying
        self._endpoints = {endpoint.path: endpoint for endpoint in endpoints}
        self._request_ids = RequestIds()
        # Built in the lifespan, on the serving loop: `current_task(loop)` then costs no `getpid` (3.11
        # checks the running loop's process on every lookup: one system call per request, measured).
        self._loop = asyncio.get_running_loop()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        endpoint = self._endpoints.get(path) or by_id_endpoint(path, scope["method"])
        if endpoint is None:
            error = OpenAIError(404, f"Unknown path: {scope['method']} {path}", type="not_found_error")
            await _send_error(send, error, self._request_ids.next())
            return
        if scope["method"] != endpoint.method:
            error = OpenAIError(
                405, f"Method {scope['method']} is not allowed on {path}", headers={"allow": endpoint.method}
            )
            await _send_error(send, error, self._request_ids.next())
            return
        exchange = _Exchange(self._relaying, endpoint, scope, receive, send, self._request_ids, self._loop)
        await exchange.run()


@dataclass(init=False)
class _Prepared:
    """A request ready for a replica."""

    features: RequestFeatures
    request: Outbound
    response_id: str | None
    """The stored response it must reach (by id, or `previous_response_id`), None for any replica."""
    payload: dict[str, Any] | None
    strip_usage: bool
    """The router asked for the stream's usage: its usage chunk is taken out before the client sees it."""

    def __init__(
        self,
        features: RequestFeatures,
        request: Outbound,
        response_id: str | None = None,
        payload: dict[str, Any] | None = None,
        strip_usage: bool = False,
    ) -> None:
        # Written out: dataclass's __init__ is interpreted even when compiled (see policies.base.RequestFeatures).
        self.features = features
        self.request = request
        self.response_id = response_id
        self.payload = payload
        self.strip_usage = strip_usage


class _Exchange:
    """One request and its answer."""

    def __init__(
        self,
        state: Relaying,
        endpoint: Endpoint,
        scope: Scope,
        receive: Receive,
        send: Send,
        ids: RequestIds,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.state = state
        self.loop = loop
        self.endpoint = endpoint
        self.scope = scope
        self.receive = receive
        self.send = send
        self.headers = read_headers(scope["headers"])
        client_id = self.headers.get(REQUEST_ID_HEADER)
        self.refused_id = request_id_error(client_id) if client_id else None
        """Why the client's own request id cannot be used; it is then answered under a fresh one."""
        self.request_id = client_id if client_id and self.refused_id is None else ids.next()
        life = self.life = RequestLife(self.request_id, endpoint.name)
        life.watch(state.metrics.watch(life))
        if state.shadows is not None:
            life.watch(state.shadows.watch(life))
        if state.access_log:
            life.watch(RequestLog(scope["method"], scope["path"], state.metrics.policy_name))
        if state.tracing is not None:
            life.watch(state.tracing.watch(life, self.headers, scope["method"], route(endpoint), scope["path"]))
        elif _TRACEPARENT in self.headers:  # not traced here: the client's context goes on as it came
            life.trace_headers = trace_context(self.headers)
        self.response_started = False
        self.answered = False
        """The last message is on its way: from then on uvicorn reports the end of the exchange as a
        disconnect, which is not the client leaving."""
        self.stream: Streaming | None = None
        self.client_gone = False
        self.tenant: Tenant | None = None
        self.flow_pass: Pass | None = None
        self.status = CLIENT_CLOSED
        """The answer's status as the client got it (client gone until one is sent)."""
        self.refused = False
        """The router answered with its own error."""
        self.usage: Usage | None = None
        self.receipt: Receipt | None = None
        self.receipt_asked = False
        """The client asked for its receipt (`x-dpserve-receipt`): the predicted cached tokens come back
        in `x-dpserve-cached-tokens`."""

    async def run(self) -> None:
        """The exchange, and its life's one end, whatever happened."""
        try:
            await self._exchange()
        except Exception:
            # Logged here with its trace; the client gets no internals.
            log.exception("unhandled error on %s", self.endpoint.path, extra=request_fields(self.life))
            self.status, self.refused = 500, True
            if not self.response_started:
                await _send_error(
                    self.send, OpenAIError(500, "Internal router error.", type="server_error"), self.request_id
                )
            else:
                await self.send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.life.finish(self.status, self.usage, self.refused)

    async def _exchange(self) -> None:
        try:
            prepared = await self._prepare()
            assert self.tenant is not None
            self.flow_pass = self.state.flow.begin(
                self.tenant, prepared.features, prepared.payload or {}, len(prepared.request.body)
            )
            self.life.watch(self.flow_pass)
            self.life.checked()
        except OpenAIError as err:
            await self._refuse(err)
            return
        except ClientGone:
            return
        # From here on a client that leaves cancels this task, so the replica's request is dropped
        # (and aborted there) instead of computed for no one. (One frame, not a helper coroutine: every
        # chunk of a stream resumes through each frame of this await chain.)
        task = asyncio.current_task(self.loop)
        left = self.scope.get(CLIENT_LEFT)
        watcher = None
        if isinstance(left, ClientLeft) and task is not None:
            left.callback = lambda: self._client_left(task)
        else:  # served by another ASGI server (tests): a task waits for `http.disconnect`
            watcher = self.loop.create_task(self._watch_disconnect(task))
        try:
            outcome = await self._dispatch(prepared)
            if isinstance(outcome, Buffered):
                await self._answer(outcome)
            else:
                if self.endpoint is RESPONSES:
                    self._learn_owner(id_of_stream(outcome.first), outcome.replica_id)
                self.response_started = True
                self.stream = outcome
                tap = UsageTap(prepared.strip_usage)
                try:
                    await outcome.relay(self.send, self._routing_headers(outcome), tap)
                finally:
                    self.usage, self.status = tap.usage, outcome.outcome
        except OpenAIError as err:
            self.answered = True
            await self._refuse(err)
        except asyncio.CancelledError:
            task = asyncio.current_task(self.loop)
            if not self.client_gone or task is None:
                raise
            task.uncancel()
        finally:
            if watcher is not None:
                watcher.cancel()
            elif isinstance(left, ClientLeft):
                left.callback = None

    async def _prepare(self) -> _Prepared:
        """Reads and checks the request; OpenAIError (4xx) for anything the router will not send on."""
        state, endpoint, headers = self.state, self.endpoint, self.headers
        if self.refused_id is not None:
            raise self.refused_id
        tenant = self.tenant = state.flow.identify(self.scope.get(CALLER_SCOPE_KEY), headers)
        self.life.tenant = tenant.name
        upstream_headers = {"content-type": "application/json", REQUEST_ID_HEADER: self.request_id}
        path = upstream_path(self.scope)
        if endpoint.body is BodyKind.NONE:
            # Nothing to relay (a replica ignores a body here too), but read it so the connection stays usable.
            await receive_limited(headers, self.receive, state.max_body_bytes)
            del upstream_headers["content-type"]
            stream = endpoint.method == "GET" and b"stream=true" in self.scope.get("query_string", b"")
            features = RequestFeatures(endpoint.name, "", stream)
            response_id = path_response_id(endpoint)
            return _Prepared(features, Outbound(endpoint.method, path, b"", upstream_headers), response_id)
        raw = await receive_limited(headers, self.receive, state.max_body_bytes)
        if endpoint.body is BodyKind.FORM:
            content_type = headers.get("content-type")
            parsed = parse_form(raw, content_type, endpoint)
            assert content_type is not None
            upstream_headers["content-type"] = content_type
            try:
                check_header("content-type", content_type)
            except InvalidHeader as exc:
                raise bad_request(f"Invalid Content-Type header: {exc}.") from None
        else:
            parsed = parse_body(raw, endpoint)
        try:
            model = resolve_model(state.catalog, parsed.model)
        except OpenAIError as unserved:
            if state.cold_start is None or not state.cold_start.covers(unserved):
                raise
            self.life.checked()  # waiting in the router, for a replica to start
            await self._unless_gone(state.cold_start.wait(parsed.model))
            model = resolve_model(state.catalog, parsed.model)
        self.life.model = model  # one the router serves: a bounded label, whatever clients send
        features = await state.features.build(endpoint, model, parsed.stream, parsed.payload, headers)
        if tenant.priority is not Priority.STANDARD:
            features = features.with_priority(int(tenant.priority))
        if state.slo is not None:  # the policy predicts time: from the prompt's size, for its promise
            features = features.with_slo(slo_of(headers, tenant.rules), len(raw))
        body, strip_usage = raw, False
        if endpoint.body is BodyKind.JSON:
            fields = state.flow.upstream_fields(tenant, features.slo is not None)
            if parsed.model != model:  # the client left `model` out and the router chose it
                fields["model"] = model
            if parsed.stream and endpoint.name in _USAGE_ON_REQUEST:
                # Every stream's usage is counted: asked for when the client did not, and taken out again.
                asked = ask_for_usage(parsed.payload)
                if asked is not None:
                    fields["stream_options"] = asked["stream_options"]
                    strip_usage = True
            body = with_fields(raw, parsed.payload, fields)
        previous = parsed.payload.get("previous_response_id") if endpoint is RESPONSES else None
        response_id = previous if isinstance(previous, str) and previous else None
        outbound = Outbound(endpoint.method, path, body, upstream_headers)
        return _Prepared(features, outbound, response_id, parsed.payload, strip_usage)

    async def _dispatch(self, prepared: _Prepared) -> Buffered | Streaming:
        state, endpoint = self.state, self.endpoint
        dispatcher = state.dispatcher
        features, request = prepared.features, prepared.request
        if endpoint is VERSION:
            # The same release everywhere (the engine is pinned): any healthy replica answers.
            return await dispatcher.send_to_any(features, request, self.life)
        response_id = prepared.response_id
        if response_id is None:
            return await self._routed(features, request)
        owner = state.response_owners.get(response_id)
        if owner is None or owner not in state.registry:  # unseen, or its replica was removed since
            owner = await self._find_owner(response_id)
        if owner is None:
            if endpoint is RESPONSES:
                # Continuing a response no replica holds: any replica gives vLLM's own 404 for it.
                return await self._routed(features, request)
            raise OpenAIError(
                404,
                f"No stored response `{response_id}` on any replica.",
                type="not_found_error",
                param="response_id",
                code="response_not_found",
            )
        return await dispatcher.send_to(owner, features, request, self.life)

    async def _routed(self, features: RequestFeatures, request: Outbound) -> Buffered | Streaming:
        """Sent where the policy chooses, with a receipt when it falls in the sample or the client asked."""
        state = self.state
        asked = self.receipt_asked = _asks_receipt(self.headers.get(RECEIPT_HEADER))
        tenant = self.tenant.name if self.tenant is not None else ""
        receipt = state.receipts.watch(self.request_id, self.endpoint.name, features.model, tenant, asked)
        if receipt is not None:
            self.receipt = receipt.receipt
            self.life.watch(receipt)
        if state.slo is not None:
            self.life.watch(state.slo.watch(self.life, features.slo, state.registry))
        ticket = self.flow_pass.ticket if self.flow_pass is not None else None
        return await state.dispatcher.send(features, request, self.life, ticket)

    async def _find_owner(self, response_id: str) -> str | None:
        """Asks each healthy replica for the response (made before a restart, or through another router)."""
        state = self.state
        features = RequestFeatures("responses_find", "", False)
        request = Outbound("GET", f"{RESPONSE_BY_ID}{response_id}", b"", {REQUEST_ID_HEADER: self.request_id})
        for replica in state.registry.healthy():
            try:
                outcome = await state.dispatcher.send_to(replica.id, features, request, None)
            except OpenAIError:
                continue
            assert isinstance(outcome, Buffered)
            if outcome.status == 200:
                state.response_owners.remember(response_id, replica.id)
                return replica.id
        return None

    async def _unless_gone(self, wait: Coroutine[Any, Any, None]) -> None:
        """`wait` (the body read, before the exchange watches its client), ended by the client leaving:
        ClientGone, so a request no one waits for any more stops asking for a replica at once."""
        left = self.scope.get(CLIENT_LEFT)
        if not isinstance(left, ClientLeft):  # another ASGI server (tests): read its `http.disconnect`
            await until_disconnect(self.receive, wait)
            return
        waiting = self.loop.create_task(wait)

        def leave() -> None:
            waiting.cancel()

        left.callback = leave
        try:
            await waiting
        except asyncio.CancelledError:
            task = asyncio.current_task(self.loop)
            if not waiting.cancelled() or task is None or task.cancelling():
                raise  # the router stopping, not the client leaving
            raise ClientGone from None
        finally:
            left.callback = None

    async def _watch_disconnect(self, task: asyncio.Task[object] | None) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        if task is not None:
            self._client_left(task)

    def _client_left(self, task: asyncio.Task[object]) -> None:
        """The client is gone: the exchange is cancelled, unless its answer is already all written."""
        if self.answered or (self.stream is not None and self.stream.ending):
            return
        self.client_gone = True
        task.cancel()

    async def _answer(self, outcome: Buffered) -> None:
        endpoint, status = self.endpoint, outcome.status
        body, content_type = outcome.body, outcome.content_type.encode("latin-1")
        if status >= 400:
            # Always OpenAI-shaped JSON by now, whatever the replica's own content type was.
            body, content_type = upstream_error_body(status, body, endpoint.path), _JSON
        else:
            if endpoint is RESPONSES and status == 200:
                self._learn_owner(id_of_answer(body), outcome.replica_id)
            if status == 200 and endpoint.body is BodyKind.JSON:
                self.usage = usage_of_answer(body)
        if status in NO_BODY_STATUSES:
            headers = self._routing_headers(outcome)
            body = b""
        else:
            headers = [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *self._routing_headers(outcome),
            ]
        if outcome.retry_after is not None and status in (429, 503):
            headers.append((b"retry-after", outcome.retry_after.encode("latin-1")))
        self.response_started = True
        self.status = status
        await self.send({"type": "http.response.start", "status": outcome.status, "headers": headers})
        self.answered = True
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    def _learn_owner(self, response_id: str | None, replica_id: str) -> None:
        if response_id is not None:
            self.state.response_owners.remember(response_id, replica_id)

    def _routing_headers(self, answer: Buffered | Streaming) -> list[tuple[bytes, bytes]]:
        headers = [(_REPLICA_HEADER, answer.replica_id.encode()), (_REQUEST_ID_HEADER, self.request_id.encode())]
        if isinstance(answer, Streaming):
            headers.insert(0, (b"content-type", answer.content_type.encode("latin-1")))
        receipt = self.receipt
        if self.receipt_asked and receipt is not None:
            if receipt.predicted is not None:
                headers.append((CACHED_TOKENS_HEADER, str(receipt.predicted).encode()))
            if receipt.predicted_ttft_s is not None:
                headers.append((PREDICTED_TTFT_HEADER, str(round(receipt.predicted_ttft_s * 1000.0, 1)).encode()))
        return headers

    async def _refuse(self, err: OpenAIError) -> None:
        """The router's own error for this request."""
        self.status, self.refused = err.status, True
        if self.flow_pass is None and self.tenant is not None:  # not counted in by flow control yet
            self.state.flow.usage.record(self.tenant.name, error=True)
        await _send_error(self.send, err, self.request_id)


class RequestIds:
    """Ids for requests that come without an `x-request-id`: a random prefix per router process and a
    counter, unique across routers and restarts without a random draw per request."""

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(8)
        self._count = itertools.count()

    def next(self) -> str:
        return self._prefix + hex(next(self._count))[2:]  # not a format spec: 4k instructions a request


def request_id_error(request_id: str) -> OpenAIError | None:
    """Why a client's `x-request-id` cannot be used (it goes to the replica and into logs: bounded, and a
    valid header value), or None."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        return bad_request(f"`x-request-id` is longer than {MAX_REQUEST_ID_CHARS} characters.", param=REQUEST_ID_HEADER)
    if not visible_ascii(request_id):
        return bad_request("`x-request-id` may hold only visible ASCII characters.", param=REQUEST_ID_HEADER)
    return None


def visible_ascii(text: str) -> bool:
    """Only characters 0x21-0x7e (checked in C: no regex on the hot path)."""
    return bool(text) and text.isascii() and text.isprintable() and " " not in text


def upstream_path(scope: Scope) -> str:
    """The path and query as the client sent them (raw: percent-escapes kept)."""
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string") or b""
    return (raw + b"?" + query if query else raw).decode("latin-1")


def read_headers(raw: Sequence[tuple[bytes, bytes]]) -> dict[str, str]:
    """The few request headers the hot path reads, by lower-case name (ASGI servers give names in lower
    case); the first of a repeated header wins, as `Headers.get` does."""
    found: dict[str, str] = {}
    for name, value in raw:
        if name in _READ_HEADERS:
            found.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return found


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


def resolve_model(catalog: ModelCatalog, requested: str | None) -> str:
    """The model a request is for; else why none can serve it (a replica refusing the router is named first:
    the model may well be its, unread)."""
    if requested is None:
        only = catalog.only_model()
        if only is not None:
            return only
        served = catalog.served_models()
        if not served:
            refusing = catalog.refusing(None)
            if refusing:
                raise replica_misconfigured(refusing)
            raise no_replica("No healthy replica is serving a model right now.")
        raise bad_request(f"Missing `model`; this router serves: {', '.join(served)}.", param="model")
    if catalog.serves(requested):
        return requested
    refusing = catalog.refusing(requested)
    if refusing:
        raise replica_misconfigured(refusing)
    if requested in catalog.known_models():
        raise no_replica(f"No healthy replica serves the model `{requested}` right now.")
    raise model_not_found(requested)


def proxied_openapi_paths(endpoints: Sequence[Endpoint]) -> dict[str, object]:
    """OpenAPI path items for the proxied endpoints, which FastAPI does not see."""
    answer = {"200": {"description": "The replica's answer, relayed as it came (SSE when streaming)."}}
    paths: dict[str, object] = {}
    for endpoint in endpoints:
        operation: dict[str, object] = {
            "summary": f"vLLM {endpoint.name}, routed to a replica",
            "operationId": endpoint.path.strip("/").replace("/", "_"),
            "responses": answer,
        }
        if endpoint.body is BodyKind.JSON:
            content = {"application/json": {"schema": request_schema(endpoint)}}
            operation["requestBody"] = {"required": True, "content": content}
        elif endpoint.body is BodyKind.FORM:
            form = {"type": "object", "properties": {"file": {"type": "string", "format": "binary"}}}
            operation["requestBody"] = {"required": True, "content": {"multipart/form-data": {"schema": form}}}
        paths[endpoint.path] = {endpoint.method.lower(): operation}
    by_id = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    paths[RESPONSE_BY_ID + "{response_id}"] = {
        "get": {
            "summary": "A stored response, from the replica that holds it",
            "operationId": "responses_get",
            "parameters": by_id,
            "responses": answer,
        }
    }
    paths[RESPONSE_BY_ID + "{response_id}/cancel"] = {
        "post": {
            "summary": "Cancel a background response, on the replica that holds it",
            "operationId": "responses_cancel",
            "parameters": by_id,
            "responses": answer,
        }
    }
    return paths


def _asks_receipt(value: str | None) -> bool:
    return value is not None and value.strip().lower() in TRUE_WORDS
