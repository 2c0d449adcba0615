"""The router's FastAPI app. `create_app` is the one place its parts are built and wired."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from dpserve.config import RouterSettings
from dpserve.disconnect import ClientGone
from dpserve.gpu.health import GpuHealthRules, GpuHealthTracker
from dpserve.gpu.local_processes import ReplicaProcesses
from dpserve.gpu.nvml import Nvml, load_nvml
from dpserve.gpu.placement import ReplicaClue
from dpserve.gpu.sampler import GpuSampler
from dpserve.kvindex.index import KvIndex
from dpserve.kvindex.recent import RecentRoutes
from dpserve.kvindex.text_prefix import ChunkTokens, TextPrefixIndex
from dpserve.policies import Need, Policy, PolicyTuning, make_policy
from dpserve.policies.balance import BalanceGuard
from dpserve.policies.bindings import SessionBindings
from dpserve.policies.kv_aware import KvAwareWeights
from dpserve.replicas.adapter_folder import AdapterFolder, AdapterFolderWatch
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.discovery import DnsResolver, parse_discovery_source
from dpserve.replicas.health import HealthRules
from dpserve.replicas.kv_events import KvEventSubscriber, parse_kv_event_source
from dpserve.replicas.monitor import ReplicaMonitor
from dpserve.replicas.registry import Replica, ReplicaRegistry
from dpserve.router.control.admin import FleetControl, add_admin_routes
from dpserve.router.control.dashboard import dashboard_html
from dpserve.router.control.discovery import Discovery, DiscoveryCollector, SourceState
from dpserve.router.fleet.agents import GpuAgents
from dpserve.router.fleet.gpu_metrics import GpuCollector
from dpserve.router.fleet.gpus import GpuFleet
from dpserve.router.flow.access import Guard, Keys, load_keys
from dpserve.router.flow.admission import Admission
from dpserve.router.flow.gate import Flow
from dpserve.router.flow.quotas import QuotaBook
from dpserve.router.flow.tenants import Tenants
from dpserve.router.flow.usage import UsageBook, UsageCollector
from dpserve.router.http.endpoints import PROXIED_ENDPOINTS
from dpserve.router.http.errors import CLIENT_CLOSED, OpenAIError, bad_request, status_type
from dpserve.router.http.proxied_paths import HotPath, RouterApp
from dpserve.router.http.stored_responses import ResponseOwners
from dpserve.router.http.upstream_client import Deadlines, UpstreamPool
from dpserve.router.observe.metrics import RouterMetrics, RoutingStateCollector
from dpserve.router.observe.prompt_tokens import LocalTokenizer, PromptTokenizer, RemoteTokenizer, TokenCache
from dpserve.router.peers.board import PeerBoard
from dpserve.router.peers.links import SNAPSHOT_PATH, STREAM_PATH, PeerCollector, PeerLinks, SuspectChecks
from dpserve.router.peers.wire import MAX_ROUTES
from dpserve.router.quality.receipt_log import ReceiptLog
from dpserve.router.quality.receipts import ReceiptBook, ReceiptCollector
from dpserve.router.quality.shadows import ShadowCollector, ShadowScorer
from dpserve.router.routing.adapter_loader import AdapterLoader
from dpserve.router.routing.dispatch import Dispatcher, OpenStreams, RetryRules
from dpserve.router.routing.features import FeatureBuilder
from dpserve.router.routing.proxied_endpoints import ProxiedEndpoints, Relaying, proxied_openapi_paths
from dpserve.router.routing.selection import PrefixLookup, Selector
from dpserve.router.shutdown import Shutdown

log = logging.getLogger("dpserve.router")


@dataclass(frozen=True)
class RouterState:
    """What the status page, metrics and admin API read, complete when `create_app` returns."""

    registry: ReplicaRegistry
    catalog: ModelCatalog
    policy: Policy
    metrics: RouterMetrics
    kv_index: KvIndex | None
    """None when no policy reads KV events (not a state to wait for: it never comes)."""
    subscribers: list[KvEventSubscriber]
    """One per replica publishing KV events; filled as the app starts and as replicas are added."""
    gpus: GpuFleet
    """Every GPU: this host's (NVML) or, with GPU agents, every host's; off with --gpu-interval 0."""
    shutdown: Shutdown
    started_at: float
    discovery: list[SourceState]
    """One per --discover source; empty without."""
    peers: PeerLinks
    """The other routers (and workers) this one shares routing state with; `enabled` is False without."""
    flow: Flow
    receipts: ReceiptBook
    shadows: ShadowScorer | None


def policy_tuning(settings: RouterSettings) -> PolicyTuning:
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


def catalog_for(settings: RouterSettings, registry: ReplicaRegistry) -> ModelCatalog:
    """The LoRA adapters the router may load on the replicas (`--lora`; `--lora-dir`'s come from its watch)."""
    adapters = settings.lora_adapters
    return ModelCatalog(
        registry,
        adapters=adapters,
        # vLLM reports its adapter slots only once it has served a request; until then one is assumed.
        assumed_max_loras=1 if adapters or settings.lora_dir else 0,
        adapter_slots=settings.lora_slots,
    )


def adapter_folder_watch(settings: RouterSettings, catalog: ModelCatalog) -> AdapterFolderWatch | None:
    """`--lora-dir`: read before serving, then every second, off the request path."""
    return AdapterFolderWatch(AdapterFolder(settings.lora_dir), catalog) if settings.lora_dir else None


def admission_for(settings: RouterSettings) -> Admission:
    return Admission(
        settings.max_in_flight,
        settings.queue_size,
        settings.queue_timeout_s,
        flow_control=settings.flow_control,
        batch_reserve=settings.batch_reserve,
        engine_queue=settings.engine_queue,
    )


def flow_for(settings: RouterSettings, keys: Keys, admission: Admission) -> Flow:
    """Tenants from the named keys and `--tenant` rules; quotas and usage books; the admission queue."""
    if settings.engine_queue < 0:
        raise ValueError(f"--engine-queue {settings.engine_queue}: 0 or more requests per replica")
    if not 0 <= settings.batch_reserve < 1:
        raise ValueError(f"--batch-reserve {settings.batch_reserve:g}: a share from 0 up to (not including) 1")
    tenants = Tenants.from_specs(settings.tenants, keys.user_names, open_access=not keys.enabled)
    usage = UsageBook(named=tenants.named)
    return Flow(tenants, QuotaBook(), usage, admission, pass_priority=settings.vllm_priority)


def selector_for(
    settings: RouterSettings,
    registry: ReplicaRegistry,
    catalog: ModelCatalog,
    policy: Policy,
    admission: Admission,
    metrics: RouterMetrics,
    kv_index: KvIndex | None,
    text_index: TextPrefixIndex | None,
    recent: RecentRoutes | None,
    rng: random.Random | None = None,
    bindings: SessionBindings | None = None,
) -> Selector:
    """How the router chooses replicas (also what `benchmarks/decision_time.py` times); the prefix lookup
    only for a policy that reads prefixes."""
    reads_prefix = policy.needs & {Need.KV_PREFIX, Need.TEXT_PREFIX}
    prefixes = PrefixLookup(metrics, kv_index, text_index, recent) if reads_prefix else None
    return Selector(
        registry,
        catalog,
        policy,
        admission,
        metrics,
        prefixes,
        rng=rng,
        sample_size=settings.route_sample,
        bindings=bindings,
        adapter_affinity=settings.lora_affinity,
        guard=BalanceGuard(settings.balance_rel, settings.balance_abs),
    )


def shadow_scorer(settings: RouterSettings, registry: ReplicaRegistry) -> ShadowScorer | None:
    """`--shadow-policy`: each its own policy object (a shadow's turn or random draws are its own)."""
    if not settings.shadow_policies:
        return None
    policies = [make_policy(name, random.Random(), policy_tuning(settings)) for name in settings.shadow_policies]

    def capacity_of(replica_id: str) -> int:
        replica = registry.find(replica_id)
        return replica.kv_blocks if replica is not None else 0

    return ShadowScorer(policies, capacity_of, random.Random())


def kv_event_endpoints(settings: RouterSettings, registry: ReplicaRegistry) -> dict[str, str]:
    """Replica id -> ZMQ endpoint, from `--kv-events URL=ENDPOINT` (the URL must be a known replica)."""
    endpoints: dict[str, str] = {}
    for text in settings.kv_events:
        url, endpoint = parse_kv_event_source(text)
        replica = registry.by_url(url)
        if replica is None:
            raise ValueError(f"--kv-events names {url}, which is not one of the router's --replica URLs")
        endpoints[replica.id] = endpoint
    return endpoints


def local_tokenizer(settings: RouterSettings) -> LocalTokenizer | None:
    """The model's tokenizer in the router, when `--tokenizer` names a directory that has one."""
    if not settings.tokenizer or settings.tokenizer == "remote":
        return None
    path = Path(settings.tokenizer).expanduser()
    if not LocalTokenizer.available(path):
        raise ValueError(f"--tokenizer {settings.tokenizer}: no tokenizer.json there (or say `remote`)")
    return LocalTokenizer(path)


def gpu_health_rules(settings: RouterSettings) -> GpuHealthRules:
    try:
        ignored = tuple(int(code) for code in settings.gpu_ignored_xids)
    except ValueError:
        raise ValueError(f"--gpu-ignored-xids {','.join(settings.gpu_ignored_xids)}: Xid codes are numbers") from None
    return GpuHealthRules(
        throttle=settings.gpu_throttle_reasons,
        ignored_xids=ignored,
        event_hold_s=settings.gpu_event_hold_s,
        pcie_busy_utilization=settings.gpu_pcie_busy_utilization,
        degrade_after_s=settings.gpu_degrade_after_s,
        recover_after_s=settings.gpu_recover_after_s,
    )


def gpu_agents(settings: RouterSettings, resolver: DnsResolver | None) -> GpuAgents | None:
    """The other hosts' GPU agents, given by URL or found by DNS; None without any."""
    if settings.gpu_interval_s <= 0 or not (settings.gpu_agents or settings.discover_agents):
        return None
    for url in settings.gpu_agents:
        check_base_url(url, "--gpu-agent", "an agent's base URL, e.g. http://10.0.0.2:9400")
    sources = [parse_discovery_source(text, "--discover-agents") for text in settings.discover_agents]
    return GpuAgents(settings.gpu_agents, sources, resolver, settings.gpu_interval_s, settings.discover_interval_s)


def gpu_fleet(
    settings: RouterSettings, registry: ReplicaRegistry, nvml: Callable[[], Nvml], resolver: DnsResolver | None
) -> GpuFleet:
    """This host's GPUs through NVML, or, given GPU agents, every host's through its agent (this host's
    agent included: the router then reads no GPU itself, so none is counted twice)."""
    agents = gpu_agents(settings, resolver)
    local = gpu_sampler(settings, registry, nvml) if agents is None else None
    fleet = GpuFleet(registry, local, agents, GpuHealthTracker(gpu_health_rules(settings)), act=settings.gpu_health)
    if local is not None:
        local.on_sample = fleet.refresh
    if agents is not None:
        agents.on_update = fleet.refresh_remote
    return fleet


def gpu_sampler(settings: RouterSettings, registry: ReplicaRegistry, nvml: Callable[[], Nvml]) -> GpuSampler | None:
    """NVML sampling, with each GPU tied to its replica by hint or, for replicas on this host, by process."""
    if settings.gpu_interval_s <= 0:
        return None
    # Only replicas without a hint are looked for by process.
    processes = ReplicaProcesses([r.url for r in registry if not r.gpu_hint])

    def clues() -> list[ReplicaClue]:
        pids = processes.pids()
        return [ReplicaClue(r.id, r.gpu_hint, pids.get(r.url, frozenset())) for r in registry]

    return GpuSampler(nvml, settings.gpu_interval_s, clues=clues)


def check_base_url(url: str, flag: str, expected: str) -> None:
    """A service's base URL: http(s), a host, no path (the router appends its own)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
        raise ValueError(f"{flag} {url!r}: expected {expected}")


def origin_id() -> str:
    """This router process's name among its peers: a restarted router is a new peer."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def peer_links(
    settings: RouterSettings,
    board: PeerBoard,
    resolver: DnsResolver | None,
    keys: Keys,
) -> PeerLinks:
    for url in (*settings.peers, *settings.peer_siblings):
        check_base_url(url, "--peer", "another router's base URL, e.g. http://10.0.0.3:8000")
    if settings.peering and keys.enabled and not keys.admins:
        log.warning("peers need an admin key when API keys are set (--admin-key): they will refuse each other")
    return PeerLinks(
        board,
        peers=settings.peers,
        siblings=settings.peer_siblings,
        sources=[parse_discovery_source(text, "--discover-peers") for text in settings.discover_peers],
        resolver=resolver,
        interval_s=settings.peer_interval_s,
        timeout_s=settings.peer_timeout_s,
        discover_interval_s=settings.discover_interval_s,
        admin_key=keys.admins[0] if keys.admins else None,
        max_snapshot_blocks=settings.kv_index_max_entries,
    )


def upstream_deadlines(settings: RouterSettings) -> Deadlines:
    return Deadlines(
        connect_s=settings.connect_timeout_s,
        write_s=settings.write_timeout_s,
        read_s=settings.read_timeout_s,
        total_s=settings.request_timeout_s,
    )


def health_rules(settings: RouterSettings) -> HealthRules:
    return HealthRules(
        fail_threshold=settings.fail_threshold,
        rise_threshold=settings.rise_threshold,
        passive_fail_threshold=settings.passive_fail_threshold,
        backoff_s=settings.backpressure_backoff_s,
    )


def _document_proxied(app: FastAPI) -> None:
    """Adds the proxied endpoints, which FastAPI never sees, to the OpenAPI document."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            generate()["paths"].update(proxied_openapi_paths(PROXIED_ENDPOINTS))
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI documents this override


def create_app(
    settings: RouterSettings,
    *,
    policy: Policy | None = None,
    rng: random.Random | None = None,
    nvml: Callable[[], Nvml] = load_nvml,
    keys: Keys | None = None,
) -> FastAPI:
    """`nvml` loads the NVML library (the `pynvml` module); tests pass a fake, as these hosts have no GPU.
    `keys`: API and admin keys, read from the settings when not given."""
    sources = [SourceState(parse_discovery_source(text)) for text in settings.discover]
    # A bad nameserver fails here.
    wants_dns = sources or settings.discover_agents or settings.discover_peers
    resolver = DnsResolver(settings.discover_nameserver) if wants_dns else None
    if not settings.replicas and not sources:
        raise ValueError("no replicas: give --replica URL or --discover dns:NAME:PORT")
    registry = ReplicaRegistry(settings.replicas, health_rules(settings))
    catalog = catalog_for(settings, registry)
    folder_watch = adapter_folder_watch(settings, catalog)
    policy = policy or make_policy(settings.routing_policy, rng, policy_tuning(settings))
    shadows = shadow_scorer(settings, registry)
    # What features are computed: the live policy's, and the shadows' (a kv_aware shadow beside a load
    # policy needs the prompt's blocks).
    needs = policy.needs | (shadows.needs if shadows is not None else frozenset())
    keys = keys if keys is not None else load_keys(settings)
    admission = admission_for(settings)
    flow = flow_for(settings, keys, admission)
    registry.on_change(admission.notify)
    metrics = RouterMetrics(registry, policy.name)
    metrics.queue_depth.set_function(lambda: admission.depth)
    metrics.queue_oldest_wait.set_function(admission.oldest_wait_s)
    metrics.registry.register(UsageCollector(flow.usage))
    chunk_tokens = ChunkTokens()  # taught by the receipts' answers, read by the text prefix features
    receipts = ReceiptBook(settings.receipts_sample, settings.receipts_keep, chunk_tokens=chunk_tokens)
    metrics.registry.register(ReceiptCollector(receipts))
    if shadows is not None:
        metrics.registry.register(ShadowCollector(shadows))
    receipt_log = ReceiptLog(settings.receipts_log) if settings.receipts_log else None  # a bad path fails here
    if receipt_log is not None:
        receipts.on_closed = receipt_log.write
    gpus = gpu_fleet(settings, registry, nvml, resolver)
    if gpus.enabled:
        metrics.registry.register(GpuCollector(gpus))
    endpoints = kv_event_endpoints(settings, registry)
    kv_index: KvIndex | None = None
    if endpoints or Need.KV_PREFIX in needs:
        kv_index = KvIndex(settings.kv_index_max_entries)
        if not endpoints:
            log.warning("policy %s has no --kv-events to learn from: it routes on load only", policy.name)
    text_index = TextPrefixIndex(settings.prefix_index_max_chunks) if Need.TEXT_PREFIX in policy.needs else None
    local = local_tokenizer(settings)
    # With peers, this router's own routes and session bindings are also kept for them.
    outbox = MAX_ROUTES if settings.peering else 0
    recent = None
    if Need.KV_PREFIX in policy.needs:
        recent = RecentRoutes(time.monotonic, settings.recent_route_ttl_s, max_outbox=outbox)
        if kv_index is not None:
            # Found by routing receipts: a prompt sent to a replica that then evicted it was still predicted
            # cached there for the routes' whole ttl (classed `evicted`), though the events had said so.
            kv_index.on_removed = recent.forget
    bindings = SessionBindings(time.monotonic, max_outbox=outbox) if Need.SESSION in policy.needs else None
    board = PeerBoard(registry, origin_id(), recent, bindings, kv_index, timeout_s=settings.peer_timeout_s)
    board.quotas = flow.quotas  # quotas hold across routers: each counts what its peers report
    peers = peer_links(settings, board, resolver, keys)
    if peers.enabled:
        if recent is not None:
            recent.on_news = peers.news
        if bindings is not None:
            bindings.on_news = peers.news
    open_streams = OpenStreams()
    shutdown = Shutdown(open_streams)
    state = RouterState(
        registry,
        catalog,
        policy,
        metrics,
        kv_index,
        [],
        gpus,
        shutdown,
        time.time(),
        sources,
        peers,
        flow,
        receipts,
        shadows,
    )
    if sources:
        metrics.registry.register(DiscoveryCollector(sources))
    if peers.enabled:
        metrics.registry.register(PeerCollector(peers))
        shutdown.on_drain.append(peers.drain)
    hot_path = HotPath()
    selector = selector_for(
        settings, registry, catalog, policy, admission, metrics, kv_index, text_index, recent, rng, bindings
    )
    retry = RetryRules(settings.retries, settings.retry_backoff_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Hot path: a lean HTTP/1.1 client (http/upstream_client.py; measured in docs/benchmarks/overhead.md).
        hot = UpstreamPool(upstream_deadlines(settings), max_response_bytes=settings.max_response_bytes)
        control = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0))
        monitor = ReplicaMonitor(
            registry,
            catalog,
            control,
            settings.probe_interval_s,
            settings.probe_timeout_s,
            held=lambda: admission.depth > 0,
            held_interval_s=settings.held_probe_interval_s,
        )
        tokens: TokenCache | None = None
        if Need.KV_PREFIX in needs:
            tokenizer: PromptTokenizer = local or RemoteTokenizer(control)
            tokens = TokenCache(tokenizer, settings.token_cache_entries)
        adapters = AdapterLoader(registry, catalog, metrics)
        adapters.attach(control)
        dispatcher = Dispatcher(
            registry, catalog, selector, hot, metrics, retry, admission, open_streams, rng=rng, adapters=adapters
        )
        features = FeatureBuilder(
            needs, registry, catalog, metrics, kv_index, text_index, tokens, bindings, chunk_tokens
        )
        relaying = Relaying(
            registry,
            catalog,
            features,
            dispatcher,
            metrics,
            ResponseOwners(),
            max_body_bytes=settings.max_body_bytes,
            flow=flow,
            receipts=receipts,
            shadows=shadows,
        )
        zmq_context = zmq.asyncio.Context()
        subscribers = state.subscribers
        if kv_index is not None:
            subscribers.extend(
                KvEventSubscriber(kv_index, rid, endpoint, zmq_context, time.monotonic)
                for rid, endpoint in endpoints.items()
            )
        fleet = FleetControl(registry, monitor, subscribers, kv_index, zmq_context, control)
        add_admin_routes(app, fleet, lambda replica: _replica_status(replica, state))
        discovery = None
        if resolver is not None:
            interval, kv_port = settings.discover_interval_s, settings.discover_kv_port
            discovery = Discovery(sources, resolver, fleet, interval, kv_port)
        metrics.registry.register(RoutingStateCollector(kv_index, subscribers, text_index, tokens))
        for subscriber in subscribers:
            subscriber.start()
        state.shutdown.serving(asyncio.get_running_loop())
        if gpus.local is not None:
            # First reading before serving: /status has the GPUs at once, and a host without one
            # logs its single `no NVIDIA GPU found: ...` line at start.
            await asyncio.to_thread(gpus.local.sample_once)
            gpus.refresh()
            gpus.local.start()
        if gpus.agents is not None:  # polled from the start, not waited for: an agent may be slow or gone
            gpus.agents.start(control)
        if folder_watch is not None:
            await folder_watch.refresh()  # the folder's adapters listed and servable from the first request
            folder_watch.start()
        await monitor.probe_all()
        monitor.start()
        if discovery is not None:
            # The first answer before serving: discovered replicas are probed as they are added.
            await discovery.refresh()
            discovery.start()
        peers.attach(control)
        if peers.enabled:
            # Before serving (uvicorn listens only once this returns): a restarted router routes as its
            # peers do from its first request.
            await peers.load_from_a_peer(settings.warm_start_timeout_s)
            peers.on_suspect = SuspectChecks(registry, monitor, settings.fail_threshold, settings.probe_interval_s)
            peers.start()
        hot_path.serve(ProxiedEndpoints(relaying, PROXIED_ENDPOINTS))
        try:
            yield
        finally:
            hot_path.stop()
            if peers.enabled:
                await peers.stop()
            if discovery is not None:
                await discovery.stop()
            await monitor.stop()
            if folder_watch is not None:
                await folder_watch.stop()
            if gpus.local is not None:
                await gpus.local.stop()
            if gpus.agents is not None:
                await gpus.agents.stop()
            for subscriber in list(subscribers):
                await subscriber.stop()
            zmq_context.destroy(linger=0)
            hot.close()
            await control.close()
            if receipt_log is not None:
                receipt_log.close()

    app = RouterApp(hot_path, title="dpserve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.shutdown = state.shutdown
    app.add_middleware(Guard, keys=keys, max_header_bytes=settings.max_header_bytes)
    _install_error_handlers(app)
    _document_proxied(app)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        # From what the probes last read: answers at once, also while a replica is down.
        cards = state.catalog.model_cards(healthy_only=True)
        return JSONResponse({"object": "list", "data": list(cards.values())})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        healthy = len(state.registry.healthy())
        draining = state.shutdown.draining
        ready = healthy > 0 and not draining
        body = {
            "ready": ready,
            "healthy_replicas": healthy,
            "replicas": len(state.registry),
            "draining": draining,
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get(STREAM_PATH)
    async def peer_stream(origin: str = "", relay: str = "0") -> Response:
        if not peers.enabled:
            raise OpenAIError(404, "This router has no peers (--peer, --discover-peers): it shares nothing.")
        if not origin:
            raise bad_request("Say who follows: ?origin=ID.")
        follower = peers.follow(origin, relay == "1")
        if follower is None:
            raise OpenAIError(409, "That origin is this router itself.", type="invalid_request_error")
        return StreamingResponse(peers.frames(follower), media_type="application/x-dpserve-peer")

    @app.get(SNAPSHOT_PATH)
    async def peer_snapshot(origin: str = "") -> Response:
        if origin == board.origin:
            raise OpenAIError(409, "That origin is this router itself.", type="invalid_request_error")
        return Response(await peers.snapshot(), media_type="application/x-msgpack")

    @app.get("/admin/receipts")
    async def receipts_list(limit: str = "100") -> JSONResponse:
        # The newest first; each: what the policy predicted, what the replica realized, the class.
        try:
            count = int(limit)
        except ValueError:
            count = -1
        if count < 0:
            raise OpenAIError(400, "`limit` must be a whole number, 0 or more.", param="limit")
        return JSONResponse({"receipts": state.receipts.recent(count), "summary": state.receipts.summary()})

    @app.get("/admin/usage")
    async def usage() -> JSONResponse:
        # Tenant names only, never keys: totals since start and per minute.
        return JSONResponse(flow.usage.to_dict())

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    async def status() -> JSONResponse:
        return JSONResponse(_status(state))

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(dashboard_html(_status(state)), headers={"cache-control": "no-store"})

    return app


def _status(state: RouterState) -> dict[str, Any]:
    gpus = state.gpus.status()
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
        **({"discovery": [source.to_dict(time.time()) for source in state.discovery]} if state.discovery else {}),
        **({"peers": state.peers.status()} if state.peers.enabled else {}),
        "flow": state.flow.status(),
        "routing_quality": state.receipts.summary(),
        **({"shadows": state.shadows.status()} if state.shadows is not None else {}),
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
        "degraded": list(replica.degraded),
        "ejections": replica.health.ejections,
        "in_flight": replica.in_flight,
        "peer_in_flight": replica.peer_in_flight,
        "running": replica.running,
        "waiting": replica.waiting,
        "capacity": replica.capacity or None,
        # Share of its slots seen idle between requests from the router; past 5% one may wait in its engine.
        "idle_between_requests": round(replica.learned.idle, 3),
        "kv_cache_usage": replica.kv_usage,
        "prefix_cache_hit_rate": hit_rate,
        "block_size": replica.block_size,
        "served_total": replica.served_total,
        "last_error": replica.last_error,
        "kv_events": kv_events,
        "lora": _lora_status(replica) if replica.lora.enabled else None,
    }


def _lora_status(replica: Replica) -> dict[str, Any]:
    lora = replica.lora
    return {
        "max_loras": lora.max_loras,
        "loaded": sorted(lora.loaded - lora.loading),
        "loading": sorted(lora.loading),
        "in_flight": dict(sorted(lora.in_flight.items())),
        "active": sorted(lora.active),
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
