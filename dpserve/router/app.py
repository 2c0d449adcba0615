"""The router's FastAPI app. `create_app` is the one place its parts are built and wired."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from dpserve.config import Settings
from dpserve.disconnect import ClientGone
from dpserve.gpu.local_processes import ReplicaProcesses
from dpserve.gpu.nvml import Nvml, load_nvml
from dpserve.gpu.placement import ReplicaClue
from dpserve.gpu.sampler import GpuSampler
from dpserve.kvindex.index import KvIndex
from dpserve.kvindex.recent import RecentRoutes
from dpserve.kvindex.text_prefix import TextPrefixIndex
from dpserve.policies import Need, Policy, PolicyTuning, make_policy
from dpserve.policies.balance import BalanceGuard
from dpserve.policies.kv_aware import KvAwareWeights
from dpserve.replicas.health import HealthRules
from dpserve.replicas.kv_events import KvEventSubscriber, parse_kv_event_source
from dpserve.replicas.monitor import ReplicaMonitor
from dpserve.replicas.registry import Replica, ReplicaRegistry
from dpserve.router.access import Guard, Keys, load_keys
from dpserve.router.admin import FleetControl, add_admin_routes
from dpserve.router.admission import Admission
from dpserve.router.dashboard import dashboard_html
from dpserve.router.endpoints import PROXIED_ENDPOINTS
from dpserve.router.errors import (
    OpenAIError,
    bad_request,
    status_type,
)
from dpserve.router.features import FeatureBuilder
from dpserve.router.gpu_metrics import GpuCollector
from dpserve.router.metrics import RouterMetrics, RoutingStateCollector
from dpserve.router.prompt_tokens import LocalTokenizer, PromptTokenizer, RemoteTokenizer, TokenCache
from dpserve.router.proxy import Dispatcher, RetryRules, Streaming
from dpserve.router.relay import CLIENT_CLOSED, ProxiedEndpoints, proxied_openapi_paths
from dpserve.router.stored_responses import ResponseOwners
from dpserve.router.upstream import Deadlines, UpstreamPool

log = logging.getLogger("dpserve.router")


@dataclass
class RouterState:
    settings: Settings
    registry: ReplicaRegistry
    policy: Policy
    metrics: RouterMetrics
    admission: Admission
    dispatcher: Dispatcher | None = None
    features: FeatureBuilder | None = None
    kv_index: KvIndex | None = None
    subscribers: list[KvEventSubscriber] = dataclasses.field(default_factory=list)
    fleet: FleetControl | None = None
    gpus: GpuSampler | None = None
    started_at: float = 0.0
    response_owners: ResponseOwners = dataclasses.field(default_factory=ResponseOwners)
    """Which replica stored which response (`/v1/responses`)."""
    streams: set[Streaming] = dataclasses.field(default_factory=set)
    """Streams being relayed, so a shutdown past its grace period can end each one properly."""
    draining: bool = False
    loop: asyncio.AbstractEventLoop | None = None

    def begin_drain(self, grace_s: float) -> None:
        """Called from the SIGTERM handler (any thread): /ready turns 503 at once, and streams still
        open shortly before the grace period ends get an error event and [DONE] instead of a cut."""
        self.draining = True
        loop = self.loop
        if loop is None:
            return
        cut_after = max(0.0, grace_s - min(1.0, grace_s / 2))
        loop.call_soon_threadsafe(loop.call_later, cut_after, self._cut_streams)

    def _cut_streams(self) -> None:
        if self.streams:
            log.warning("shutdown grace period ending: cutting %d stream(s) in flight", len(self.streams))
        for stream in list(self.streams):
            stream.cut("The router is shutting down; this stream was ended before it finished.")


def policy_tuning(settings: Settings) -> PolicyTuning:
    return PolicyTuning(
        kv_weights=KvAwareWeights(
            load_weight=settings.kv_load_weight,
            kv_weight=settings.kv_cache_weight,
            held_weight=settings.kv_held_weight,
            temperature=settings.kv_temperature,
        ),
        guard=BalanceGuard(settings.balance_rel, settings.balance_abs),
        prefix_min_match=settings.prefix_min_match,
        session_load_factor=settings.session_load_factor,
    )


def kv_event_endpoints(settings: Settings, registry: ReplicaRegistry) -> dict[str, str]:
    """Replica id -> ZMQ endpoint, from `--kv-events URL=ENDPOINT` (the URL must be a known replica)."""
    endpoints: dict[str, str] = {}
    for text in settings.kv_events:
        url, endpoint = parse_kv_event_source(text)
        replica = registry.by_url(url)
        if replica is None:
            raise ValueError(f"--kv-events names {url}, which is not one of the router's --replica URLs")
        endpoints[replica.id] = endpoint
    return endpoints


def local_tokenizer(settings: Settings) -> LocalTokenizer | None:
    """The model's tokenizer in the router, when `--tokenizer` names a directory that has one."""
    if not settings.tokenizer or settings.tokenizer == "remote":
        return None
    path = Path(settings.tokenizer).expanduser()
    if not LocalTokenizer.available(path):
        raise ValueError(f"--tokenizer {settings.tokenizer}: no tokenizer.json there (or say `remote`)")
    return LocalTokenizer(path)


def gpu_sampler(settings: Settings, registry: ReplicaRegistry, nvml: Callable[[], Nvml]) -> GpuSampler | None:
    """NVML sampling, with each GPU tied to its replica by hint or, for replicas on this host, by process."""
    if settings.gpu_interval_s <= 0:
        return None
    # Only replicas without a hint are looked for by process.
    processes = ReplicaProcesses([r.url for r in registry if not r.gpu_hint])

    def clues() -> list[ReplicaClue]:
        pids = processes.pids()
        return [ReplicaClue(r.id, r.gpu_hint, pids.get(r.url, frozenset())) for r in registry]

    return GpuSampler(nvml, settings.gpu_interval_s, clues=clues)


def upstream_deadlines(settings: Settings) -> Deadlines:
    return Deadlines(
        connect_s=settings.connect_timeout_s,
        write_s=settings.write_timeout_s,
        read_s=settings.read_timeout_s,
        total_s=settings.request_timeout_s,
    )


def health_rules(settings: Settings) -> HealthRules:
    return HealthRules(
        fail_threshold=settings.fail_threshold,
        rise_threshold=settings.rise_threshold,
        passive_fail_threshold=settings.passive_fail_threshold,
        backoff_s=settings.backpressure_backoff_s,
    )


class RouterApp(FastAPI):
    """FastAPI, with some paths answered by a raw ASGI app ahead of the framework's middleware,
    routing and request objects (the proxied endpoints, which carry every token)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._direct: ASGIApp | None = None
        self._serves_directly: Callable[[str], bool] = lambda path: False

    def route_directly(self, app: ASGIApp, serves: Callable[[str], bool]) -> None:
        self._direct, self._serves_directly = app, serves

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._direct is not None and self._serves_directly(scope["path"]):
            await self._direct(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _document_proxied(app: FastAPI) -> None:
    """Adds the proxied endpoints, which FastAPI never sees, to the OpenAPI document."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            generate()["paths"].update(proxied_openapi_paths(PROXIED_ENDPOINTS))
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(
    settings: Settings,
    *,
    registry: ReplicaRegistry | None = None,
    policy: Policy | None = None,
    rng: random.Random | None = None,
    nvml: Callable[[], Nvml] = load_nvml,
    keys: Keys | None = None,
) -> FastAPI:
    """`nvml` loads the NVML library (the `pynvml` module); tests pass a fake, as these hosts have no GPU.
    `keys`: API and admin keys, read from the settings when not given."""
    registry = registry or ReplicaRegistry(settings.replicas, health_rules(settings))
    policy = policy or make_policy(settings.routing_policy, rng, policy_tuning(settings))
    keys = keys if keys is not None else load_keys(settings)
    admission = Admission(settings.max_in_flight, settings.queue_size, settings.queue_timeout_s)
    registry.on_change(admission.notify)
    state = RouterState(settings, registry, policy, RouterMetrics(registry, policy.name), admission)
    state.metrics.queue_depth.set_function(lambda: admission.depth)
    state.gpus = gpu_sampler(settings, registry, nvml)
    if state.gpus is not None:
        sampler = state.gpus
        state.metrics.registry.register(GpuCollector(lambda: sampler.snapshot, lambda: sampler.failures))
    endpoints = kv_event_endpoints(settings, registry)
    if endpoints or Need.KV_PREFIX in policy.needs:
        state.kv_index = KvIndex(settings.kv_index_max_entries)
        if not endpoints:
            log.warning("policy %s has no --kv-events to learn from: it routes on load only", policy.name)
    text_index = TextPrefixIndex(settings.prefix_index_max_chunks) if Need.TEXT_PREFIX in policy.needs else None
    local = local_tokenizer(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Hot path: a lean HTTP/1.1 client (upstream.py; measured in dpserve/bench/README.md).
        hot = UpstreamPool(upstream_deadlines(settings), max_response_bytes=settings.max_response_bytes)
        control = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0))
        monitor = ReplicaMonitor(registry, control, settings.probe_interval_s, settings.probe_timeout_s)
        tokens: TokenCache | None = None
        if Need.KV_PREFIX in policy.needs:
            tokenizer: PromptTokenizer = local or RemoteTokenizer(control)
            tokens = TokenCache(tokenizer, settings.token_cache_entries)
        recent = RecentRoutes(time.monotonic, settings.recent_route_ttl_s) if tokens is not None else None
        state.features = FeatureBuilder(policy, registry, state.metrics, state.kv_index, text_index, tokens, recent)
        state.dispatcher = Dispatcher(
            registry,
            policy,
            hot,
            state.metrics,
            RetryRules(settings.retries, settings.retry_backoff_s),
            admission,
            rng=rng,
            on_routed=state.features.routed,
            at_decision=state.features.at_decision,
            likely_best=state.features.likely_best,
            sample_size=settings.route_sample,
        )
        zmq_context = zmq.asyncio.Context()
        if state.kv_index is not None:
            state.subscribers.extend(
                KvEventSubscriber(state.kv_index, rid, endpoint, zmq_context, time.monotonic)
                for rid, endpoint in endpoints.items()
            )
        state.fleet = FleetControl(registry, monitor, state.subscribers, state.kv_index, zmq_context, control)
        state.metrics.registry.register(RoutingStateCollector(state.kv_index, state.subscribers, text_index, tokens))
        for subscriber in state.subscribers:
            subscriber.start()
        state.started_at = time.time()
        state.loop = asyncio.get_running_loop()
        if state.gpus is not None:
            # First reading before serving: /status has the GPUs at once, and a host without one
            # logs its single `no NVIDIA GPU found: ...` line at start.
            await asyncio.to_thread(state.gpus.sample_once)
            state.gpus.start()
        await monitor.probe_all()
        monitor.start()
        try:
            yield
        finally:
            await monitor.stop()
            if state.gpus is not None:
                await state.gpus.stop()
            for subscriber in list(state.subscribers):
                await subscriber.stop()
            zmq_context.destroy(linger=0)
            hot.close()
            await control.close()

    app = RouterApp(title="dpserve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = state
    app.add_middleware(Guard, keys=keys, max_header_bytes=settings.max_header_bytes)
    _install_error_handlers(app)

    def fleet() -> FleetControl:
        assert state.fleet is not None, "the app's lifespan has not started"
        return state.fleet

    add_admin_routes(app, fleet, lambda replica: _replica_status(replica, state))

    # The hot path bypasses FastAPI (see relay.py); its paths are documented by hand.
    proxied = ProxiedEndpoints(state, PROXIED_ENDPOINTS)
    app.route_directly(Guard(proxied, keys, settings.max_header_bytes), proxied.serves)
    _document_proxied(app)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        # From what the probes last read: answers at once, also while a replica is down.
        cards = state.registry.model_cards(healthy_only=True)
        return JSONResponse({"object": "list", "data": list(cards.values())})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        healthy = len(state.registry.healthy())
        ready = healthy > 0 and not state.draining
        body = {
            "ready": ready,
            "healthy_replicas": healthy,
            "replicas": len(state.registry),
            "draining": state.draining,
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    async def status() -> JSONResponse:
        return JSONResponse(_status(state))

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(dashboard_html(_status(state)), headers={"cache-control": "no-store"})

    return app


def _status(state: RouterState) -> dict[str, Any]:
    gpus = _gpu_status(state)
    replicas = []
    for replica in state.registry:
        entry = _replica_status(replica, state)
        entry["gpus"] = [gpu for gpu in gpus["devices"] if gpu["replica"] == replica.id]
        replicas.append(entry)
    return {
        "policy": state.policy.name,
        "uptime_s": round(time.time() - state.started_at, 1),
        "replicas": replicas,
        "gpus": gpus,
    }


def _gpu_status(state: RouterState) -> dict[str, Any]:
    if state.gpus is None:
        return {"available": False, "reason": "GPU telemetry is off (--gpu-interval 0)", "devices": []}
    snapshot = state.gpus.snapshot
    devices = [{**gpu.to_dict(), "replica": snapshot.replica_of(gpu.index)} for gpu in snapshot.gpus]
    return {
        "available": bool(snapshot.gpus),
        "reason": snapshot.unavailable,
        "sampled_at": snapshot.taken_at,
        "devices": devices,
    }


def _replica_status(replica: Replica, state: RouterState) -> dict[str, Any]:
    hit_rate = replica.prefix_cache_hits / replica.prefix_cache_queries if replica.prefix_cache_queries else None
    kv_events = None
    subscriber = next((s for s in state.subscribers if s.replica_id == replica.id), None)
    if subscriber is not None and state.kv_index is not None:
        stats = subscriber.stats
        kv_events = {
            "endpoint": subscriber.endpoint,
            "batches": stats.batches,
            "gaps": stats.gaps,
            "restarts": stats.restarts,
            "seconds_since_last": None
            if stats.last_event_at is None
            else round(time.monotonic() - stats.last_event_at, 1),
            "indexed_blocks": state.kv_index.blocks(replica.id),
        }
    return {
        "id": replica.id,
        "url": replica.url,
        "model": replica.models[0] if replica.models else None,
        "models": list(replica.models),
        "healthy": replica.healthy,
        "state": replica.state,
        "draining": replica.draining,
        "ejections": replica.health.ejections,
        "in_flight": replica.in_flight,
        "running": replica.running,
        "waiting": replica.waiting,
        "kv_cache_usage": replica.kv_usage,
        "prefix_cache_hit_rate": hit_rate,
        "block_size": replica.block_size,
        "served_total": replica.served_total,
        "last_error": replica.last_error,
        "kv_events": kv_events,
    }


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> Response:
        return exc.to_response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else "Request failed."
        if exc.status_code == 404:
            message = f"Unknown path: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        return OpenAIError(exc.status_code, message, type=status_type(exc.status_code)).to_response(
            dict(exc.headers or {})
        )

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED)  # never read: the client has gone

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return bad_request(f"Invalid request: {exc.errors()[:1]}").to_response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        # Logged here with its trace; the client gets no internals.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return OpenAIError(500, "Internal router error.", type="server_error").to_response()
