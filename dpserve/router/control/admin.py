"""The admin API: list, add, drain, resume and remove replicas while the router serves.

GET    /admin/replicas                 every replica with its state
POST   /admin/replicas                 {"url": ..., "name": "r1"?, "gpu": "1"?, "kv_events": "tcp://host:port"?} -> 201
POST   /admin/replicas/{id}/drain      no new requests; those in flight finish
POST   /admin/replicas/{id}/resume     back into routing (probed at once: a replica just started serves now)
DELETE /admin/replicas/{id}            out of the router at once; requests in flight still finish
GET|POST|DELETE /admin/replicas/{id}/engine/{op}  a vLLM engine operation on one replica (control/engine_ops.py)
GET|POST|DELETE /admin/engine/{op}                the same on every replica
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
import zmq.asyncio
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse

from dpserve.background import CpuMeter
from dpserve.kvindex.index import KvIndex
from dpserve.replicas.kv_events import KvEventSubscriber, engine_endpoint, parse_kv_event_source
from dpserve.replicas.monitor import ReplicaMonitor
from dpserve.replicas.registry import REPLICA_NAME, Replica, ReplicaRegistry
from dpserve.router.control.engine_ops import call_engine, engine_op
from dpserve.router.control.sibling_relay import SiblingRelay
from dpserve.router.http.errors import OpenAIError, bad_request
from dpserve.router.http.request_body import receive_limited

log = logging.getLogger("dpserve.router")

ADMIN_BODY_LIMIT = 16 * 1024
ADAPTER_OPS = frozenset({"load_lora_adapter", "unload_lora_adapter", "load_adapter", "unload_adapter"})
ENGINE_OP_TIMEOUT_S = 120.0  # loading an adapter or waking a sleeping engine can take a while


class FleetControl:
    """What changing the fleet at run time touches: the registry, the probes, the KV-event subscribers."""

    def __init__(
        self,
        registry: ReplicaRegistry,
        monitor: ReplicaMonitor,
        subscribers: list[KvEventSubscriber],
        kv_index: KvIndex | None,
        zmq_context: zmq.asyncio.Context,
        session: aiohttp.ClientSession,
        kv_events_cpu: CpuMeter | None = None,
    ) -> None:
        self.session = session
        self.kv_events_cpu = kv_events_cpu
        self.registry = registry
        self.monitor = monitor
        self.subscribers = subscribers
        self.kv_index = kv_index
        self.zmq_context = zmq_context
        monitor.on_engines(self.split_engines)

    async def add(self, url: str, gpu: str | None, kv_events: str | None, name: str | None = None) -> Replica:
        check_replica_url(url)
        if name is not None and not REPLICA_NAME.fullmatch(name):
            raise bad_request("`name` must be letters, digits and . _ : - (at most 64).", param="name")
        if kv_events is not None:
            try:
                parse_kv_event_source(f"{url}={kv_events}")  # the same check --kv-events gets
            except ValueError:
                message = "`kv_events` must be a ZMQ endpoint like tcp://host:5557."
                raise bad_request(message, param="kv_events") from None
        try:
            named = f"{name}={url}" if name else url
            replica = self.registry.add(named + (f"@gpu={gpu}" if gpu else ""))
        except ValueError as exc:
            raise OpenAIError(409, str(exc), code="replica_exists") from None
        if kv_events is not None:
            self._subscribe(replica, kv_events)
        await self.monitor.probe_now(replica)
        return replica

    def _subscribe(self, replica: Replica, endpoint: str) -> None:
        """Its KV events: the index's, or (a policy that reads none) its stream's liveness only, as at start."""
        subscriber = KvEventSubscriber(
            self.kv_index, replica.id, endpoint, self.zmq_context, time.monotonic, self.monitor, self.kv_events_cpu
        )
        self.subscribers.append(subscriber)
        subscriber.start()

    async def _stop_events(self, replica_id: str) -> None:
        for subscriber in [s for s in self.subscribers if s.replica_id == replica_id]:
            self.subscribers.remove(subscriber)
            await subscriber.stop()
        if self.kv_index is not None:
            self.kv_index.clear(replica_id)

    async def split_engines(self, server: Replica, ranks: list[int]) -> None:
        """A replica found to be a vLLM data-parallel server: each engine routed as its own replica, its
        KV events read where that engine publishes them (the server's endpoint, offset by its rank)."""
        endpoint = next((s.endpoint for s in self.subscribers if s.replica_id == server.id), None)
        await self._stop_events(server.id)
        engines = self.registry.split_engines(server.id, ranks)
        log.info("replica %s is a data-parallel server: engines %s", server.id, ", ".join(e.id for e in engines))
        if endpoint is not None and self.kv_index is not None:
            for engine in engines:
                self._subscribe(engine, engine_endpoint(endpoint, engine.rank))
        await asyncio.gather(*(self.monitor.probe_now(engine) for engine in engines))

    def drain(self, replica_id: str, draining: bool) -> Replica:
        self.registry.set_draining(self.known(replica_id), draining)
        return self.registry.get(replica_id)

    async def resume(self, replica_id: str) -> Replica:
        """Back into routing, probed now: one its supervisor just saw start serves without waiting a probe."""
        replica = self.drain(replica_id, False)
        await self.monitor.probe_now(replica)
        return replica

    async def remove(self, replica_id: str) -> Replica:
        replica = self.registry.remove(self.known(replica_id))
        await self._stop_events(replica_id)
        return replica

    def known(self, replica_id: str) -> str:
        if replica_id not in self.registry:
            raise OpenAIError(404, f"No replica `{replica_id}`.", type="not_found_error", code="replica_not_found")
        return replica_id


def check_replica_url(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
        raise bad_request("`url` must be a replica's base URL, like http://10.0.0.5:8000.", param="url")
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        raise bad_request("`url` has an invalid port.", param="url") from None


def _text_field(payload: dict[str, Any], name: str) -> str | None:
    value = payload.get(name)
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and name == "gpu":
        return str(value)
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"`{name}` must be a non-empty string.", param=name)
    return value.strip()


def add_admin_routes(
    app: FastAPI,
    control: FleetControl,
    describe: Callable[[Replica], dict[str, Any]],
    siblings: SiblingRelay | None = None,
) -> None:
    """Added as the app starts, with the fleet its lifespan built; `describe` is /status's replica entry;
    `siblings`: with `--workers`, where a change to the fleet is made too (`sibling_relay.py`)."""

    async def relayed(request: Request, body: bytes = b"") -> None:
        if siblings is not None and siblings.relays(request.query_params.get("scope")):
            await siblings.relay(request.method, request.url.path, body)

    @app.get("/admin/replicas")
    async def list_replicas() -> JSONResponse:
        return JSONResponse({"replicas": [describe(r) for r in control.registry]})

    @app.post("/admin/replicas")
    async def add_replica(request: Request) -> JSONResponse:
        raw = await receive_limited(request.headers, request.receive, ADMIN_BODY_LIMIT)
        try:
            payload = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise bad_request('The body must be a JSON object like {"url": "http://host:port"}.') from None
        if not isinstance(payload, dict) or not isinstance(payload.get("url"), str):
            raise bad_request("The body must be a JSON object with a `url` string.", param="url")
        unknown = set(payload) - {"url", "name", "gpu", "kv_events"}
        if unknown:
            raise bad_request(f"Unknown field(s): {', '.join(sorted(unknown))}.")
        url, gpu, events = (
            payload["url"].strip().rstrip("/"),
            _text_field(payload, "gpu"),
            _text_field(payload, "kv_events"),
        )
        replica = await control.add(url, gpu, events, _text_field(payload, "name"))
        await relayed(request, raw)
        return JSONResponse(describe(replica), status_code=201)

    @app.post("/admin/replicas/{replica_id}/drain")
    async def drain_replica(replica_id: str, request: Request) -> JSONResponse:
        replica = control.drain(replica_id, True)
        await relayed(request)
        return JSONResponse(describe(replica))

    @app.post("/admin/replicas/{replica_id}/resume")
    async def resume_replica(replica_id: str, request: Request) -> JSONResponse:
        replica = await control.resume(replica_id)
        await relayed(request)
        return JSONResponse(describe(replica))

    @app.delete("/admin/replicas/{replica_id}")
    async def remove_replica(replica_id: str, request: Request) -> JSONResponse:
        replica = await control.remove(replica_id)
        await relayed(request)
        return JSONResponse({**describe(replica), "removed": True})

    async def engine(request: Request, replicas: list[Replica], op_name: str) -> JSONResponse:
        op = engine_op(op_name, request.method)
        body = await receive_limited(request.headers, request.receive, ADMIN_BODY_LIMIT)
        query = request.url.query
        answers = await call_engine(control.session, replicas, op, query, body, ENGINE_OP_TIMEOUT_S)
        if op_name in ADAPTER_OPS:  # their adapter set changed: read it again now, not at the next refresh
            await asyncio.gather(*(control.monitor.probe_now(replica) for replica in replicas))
        return JSONResponse({"operation": op_name, "replicas": answers})

    async def engine_on_one(request: Request, replica_id: str, op: str) -> JSONResponse:
        return await engine(request, [control.registry.get(control.known(replica_id))], op)

    async def engine_on_all(request: Request, op: str) -> JSONResponse:
        replicas = [replica for replica in control.registry if replica.healthy]
        if not replicas:
            raise OpenAIError(503, "No healthy replica to run it on.", type="service_unavailable")
        return await engine(request, replicas, op)

    for method in ("GET", "POST", "DELETE"):
        app.add_api_route(
            "/admin/replicas/{replica_id}/engine/{op}",
            engine_on_one,
            methods=[method],
            operation_id=f"engine_on_one_{method.lower()}",
        )
        app.add_api_route(
            "/admin/engine/{op}", engine_on_all, methods=[method], operation_id=f"engine_on_all_{method.lower()}"
        )
