"""The router's app, built from its parts. `Router` builds each part once, in order, and wires them through
their constructors (`parts.py` builds one part from the settings); its lifespan starts the parts that need
a running loop and pushes each one's stop on an exit stack, so they stop in the reverse order, whatever
failed on the way up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
from fastapi import FastAPI

from dpserve.config import RouterSettings, default_cache_dir
from dpserve.gpu.nvml import Nvml, load_nvml
from dpserve.kvindex.index import KvIndex
from dpserve.kvindex.recent import RecentRoutes
from dpserve.kvindex.text_prefix import ChunkTokens, TextPrefixIndex
from dpserve.policies import Need, Policy, make_policy
from dpserve.policies.bindings import SessionBindings
from dpserve.policies.slo import SloAware
from dpserve.replicas.access import KEY_REFUSED, reload_tls
from dpserve.replicas.discovery import DnsResolver, parse_discovery_source
from dpserve.replicas.kv_events import KvEventSubscriber, events_context
from dpserve.replicas.monitor import ReplicaMonitor
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.batch.room import batch_room
from dpserve.router.batch.routes import add_batch_routes
from dpserve.router.batch.runner import BatchCollector, BatchRunner
from dpserve.router.batch.store import BatchDb
from dpserve.router.control.admin import FleetControl, add_admin_routes
from dpserve.router.control.discovery import Discovery, DiscoveryCollector, SourceState
from dpserve.router.control.secret_files import Secret, SecretFiles
from dpserve.router.control.shutdown import Shutdown
from dpserve.router.control.sibling_relay import SiblingRelay, sibling_headers
from dpserve.router.control.status import RouterState, add_status_routes, replica_status
from dpserve.router.fleet.gpu_metrics import GpuCollector
from dpserve.router.flow.access import Guard, KeyRing, Keys, load_keys
from dpserve.router.flow.usage import UsageCollector
from dpserve.router.http.endpoints import PROXIED_ENDPOINTS
from dpserve.router.http.error_handlers import install_error_handlers
from dpserve.router.http.proxied_paths import HotPath, RouterApp
from dpserve.router.http.replica_reads import PooledReads
from dpserve.router.http.stored_responses import ResponseOwners
from dpserve.router.http.upstream_client import UpstreamPool
from dpserve.router.observe.control_cpu import ControlCpu, ControlCpuCollector
from dpserve.router.observe.metrics import RouterMetrics, RoutingStateCollector
from dpserve.router.observe.model_tokenizers import ModelTokenizers
from dpserve.router.observe.prompt_tokens import PromptTokenizer, RemoteTokenizer, TokenCache
from dpserve.router.observe.tracing import Tracing
from dpserve.router.parts import (
    adapter_folder_watch,
    admission_for,
    batch_store_for,
    catalog_for,
    flow_for,
    gpu_fleet,
    health_rules,
    kv_event_endpoints,
    local_tokenizer,
    origin_id,
    peer_links,
    policy_tuning,
    replica_access,
    scale_rules,
    selector_for,
    shadow_scorer,
    tenants_for,
    upstream_deadlines,
)
from dpserve.router.peers.board import FALL_SPREAD_S, PeerBoard
from dpserve.router.peers.links import PeerCollector, SuspectChecks
from dpserve.router.peers.routes import add_peer_routes
from dpserve.router.peers.wire import MAX_ROUTES
from dpserve.router.quality.latency_watch import SloBook, SloCollector
from dpserve.router.quality.receipt_log import ReceiptLog
from dpserve.router.quality.receipts import ReceiptBook, ReceiptCollector
from dpserve.router.quality.shadows import ShadowCollector
from dpserve.router.routing.adapter_loader import AdapterLoader
from dpserve.router.routing.dispatch import Dispatcher, OpenStreams, RetryRules
from dpserve.router.routing.features import FeatureBuilder
from dpserve.router.routing.proxied_endpoints import ProxiedEndpoints, Relaying, proxied_openapi_paths
from dpserve.router.scale.advisor import ScaleAdvisor, ScaleCollector
from dpserve.router.scale.cold_start import ColdStart
from dpserve.router.scale.routes import add_scale_routes

log = logging.getLogger("dpserve.router")


class Router:
    """Every part of one router. What needs no running loop is built here, in order, each part given what
    it uses; `lifespan` builds and starts the rest, and stops all of it."""

    def __init__(
        self,
        settings: RouterSettings,
        policy: Policy | None,
        rng: random.Random | None,
        nvml: Callable[[], Nvml],
        keys: Keys,
    ) -> None:
        self.settings = settings
        self.rng = rng
        self.keys = keys
        self.key_ring = KeyRing(keys)
        """The keys in force: the Guard's, replaced when a key file changes."""
        self.server_tls: ssl.SSLContext | None = None
        self.access = replica_access(settings)  # a missing key or certificate file fails here
        self.sources = [SourceState(parse_discovery_source(text)) for text in settings.discover]
        # A bad nameserver fails here.
        wants_dns = self.sources or settings.discover_agents or settings.discover_peers
        self.resolver = DnsResolver(settings.discover_nameserver) if wants_dns else None
        if not settings.replicas and not self.sources and not settings.cold_start_wait_s:
            raise ValueError(
                "no replicas: give --replica URL or --discover dns:NAME:PORT (or --cold-start-wait, for replicas "
                "added through /admin/replicas as the load needs them)"
            )
        registry = self.registry = ReplicaRegistry(
            settings.replicas, health_rules(settings), told_slots=settings.replica_max_num_seqs or 0
        )
        self.catalog = catalog_for(settings, registry)
        self.folder_watch = adapter_folder_watch(settings, self.catalog)
        self.policy = policy or make_policy(settings.routing_policy, rng, policy_tuning(settings))
        self.shadows = shadow_scorer(settings, registry)
        # What features are computed: the live policy's, and the shadows' (a kv_aware shadow beside a load
        # policy needs the prompt's blocks).
        self.needs = self.policy.needs | (self.shadows.needs if self.shadows is not None else frozenset())
        self.admission = admission_for(settings)
        self.flow = flow_for(settings, keys, self.admission)
        registry.on_change(self.admission.notify)
        self.metrics = self._metrics()
        self.chunk_tokens = ChunkTokens()  # taught by the receipts' answers, read by the text prefix features
        # A bad path fails here.
        self.receipt_log = ReceiptLog(settings.receipts_log) if settings.receipts_log else None
        self.receipts = ReceiptBook(
            settings.receipts_sample,
            settings.receipts_keep,
            chunk_tokens=self.chunk_tokens,
            on_closed=self.receipt_log.write if self.receipt_log is not None else None,
        )
        # A policy that predicts time reads requests' SLOs and learns from their answers.
        self.slo = SloBook(self.metrics) if isinstance(self.policy, SloAware) else None
        self.scale = ScaleAdvisor(registry, self.catalog, self.admission, scale_rules(settings), slo=self.slo)
        wait_s = settings.cold_start_wait_s
        self.cold_start = ColdStart(self.catalog, self.scale, wait_s) if wait_s > 0 else None
        self.gpus = gpu_fleet(settings, registry, nvml, self.resolver)
        self._indexes()
        self._peers()
        self.open_streams = OpenStreams()
        self._batches()
        on_drain = ((self.peers.drain,) if self.peers.enabled else ()) + ((self.batches.drain,) if self.batches else ())
        self.shutdown = Shutdown(self.open_streams, on_drain=on_drain)
        self.control_cpu = ControlCpu(peers=self.peers.cpu)
        self.state = RouterState(
            registry=registry,
            catalog=self.catalog,
            policy=self.policy,
            metrics=self.metrics,
            kv_index=self.kv_index,
            subscribers=[],
            gpus=self.gpus,
            shutdown=self.shutdown,
            started_at=time.time(),
            discovery=self.sources,
            peers=self.peers,
            flow=self.flow,
            receipts=self.receipts,
            shadows=self.shadows,
            slo=self.slo,
            siblings=settings.peer_siblings,
            key_ring=self.key_ring,
            control_cpu=self.control_cpu,
            batches=self.batches,
            scale=self.scale,
            cold_start_wait_s=settings.cold_start_wait_s,
        )
        self._collectors()
        self.hot_path = HotPath()
        endpoint = settings.otlp_traces_endpoint
        self.tracing = Tracing(endpoint) if endpoint else None
        self.selector = selector_for(
            settings, registry, self.catalog, self.policy, self.admission, self.metrics,
            self.kv_index, self.text_index, self.recent, rng, self.bindings,
        )  # fmt: skip
        # A back-off asked for longer than the default cap is honoured (one retry, then the cap).
        cap = max(RetryRules().backoff_cap_s, settings.retry_backoff_s)  # an instance: compiled, the class has a slot
        self.retry = RetryRules(settings.retries, settings.retry_backoff_s, cap)

    def _batches(self) -> None:
        """`/v1/batches`: the store (a bad path or an unreachable server fails here) and the runner that
        fills the room other requests leave with its lines."""
        settings, registry, admission = self.settings, self.registry, self.admission
        store = batch_store_for(settings)
        self.batch_db = BatchDb(store) if store is not None else None
        self.batches: BatchRunner | None = None
        if self.batch_db is None:
            return

        def room(running: int) -> int:
            healthy = registry.healthy()
            reserve, queued, urgent = settings.batch_reserve, admission.depth, admission.urgent_recently
            return batch_room(healthy, running, settings.batch_slots, reserve, queued, urgent)

        self.batches = BatchRunner(
            self.batch_db,
            lambda: self.hot_path,
            room,
            origin_id(),
            settings.batch_lease_s,
            settings.batch_poll_interval_s,
        )

    def _metrics(self) -> RouterMetrics:
        metrics = RouterMetrics(self.registry, self.policy.name)
        admission = self.admission
        metrics.queue_depth.set_function(lambda: admission.depth)
        metrics.queue_oldest_wait.set_function(admission.oldest_wait_s)
        return metrics

    def _indexes(self) -> None:
        """What the router knows of where prompts are cached: the KV events' index, what it routed in the
        last seconds, the routed text; and the session bindings."""
        settings, needs, policy_needs = self.settings, self.needs, self.policy.needs
        self.kv_endpoints = kv_event_endpoints(settings, self.registry)
        # With peers, this router's own routes and session bindings are also kept for them.
        outbox = MAX_ROUTES if settings.peering else 0
        self.recent = None
        if Need.KV_PREFIX in policy_needs:
            self.recent = RecentRoutes(time.monotonic, settings.recent_route_ttl_s, max_outbox=outbox)
        self.kv_index: KvIndex | None = None
        if Need.KV_PREFIX in needs:
            # Found by routing receipts: a prompt sent to a replica that then evicted it was still predicted
            # cached there for the routes' whole ttl (classed `evicted`), though the events had said so.
            forget = self.recent.forget if self.recent is not None else None
            self.kv_index = KvIndex(settings.kv_index_max_entries, on_removed=forget)
            if not self.kv_endpoints:
                log.warning("policy %s has no --kv-events to learn from: it routes on load only", self.policy.name)
        elif self.kv_endpoints:
            # Ingesting a stream costs ~250 µs of router CPU a request (docs/benchmarks/cost.md); the link alone
            # still tells a dead replica within seconds.
            log.info(
                "policy %s reads no KV blocks: the --kv-events streams are watched for liveness only", self.policy.name
            )
        text = Need.TEXT_PREFIX in policy_needs
        self.text_index = TextPrefixIndex(settings.prefix_index_max_chunks) if text else None
        self.local_tokenizer = local_tokenizer(settings)
        self.bindings = SessionBindings(time.monotonic, max_outbox=outbox) if Need.SESSION in policy_needs else None

    def _peers(self) -> None:
        settings = self.settings
        # Quotas hold across routers: each counts what its peers report.
        board = PeerBoard(
            self.registry, origin_id(), self.recent, self.bindings, self.kv_index,
            timeout_s=settings.peer_timeout_s, quotas=self.flow.quotas, fall_spread_s=FALL_SPREAD_S,
            held=self.scale,
        )  # fmt: skip
        self.peers = peer_links(settings, board, self.resolver, self.keys)
        if self.peers.enabled:  # what this router routes is news for its peers
            self.registry.on_counts(self.peers.counts_changed)
            self.scale.on_held_change(self.peers.news)
            if self.recent is not None:
                self.recent.on_news = self.peers.news
            if self.bindings is not None:
                self.bindings.on_news = self.peers.news

    def _collectors(self) -> None:
        """What /metrics reads at scrape time, besides the request metrics."""
        registry = self.metrics.registry
        registry.register(UsageCollector(self.flow.usage))
        registry.register(ReceiptCollector(self.receipts))
        if self.slo is not None:
            registry.register(SloCollector(self.slo))
        registry.register(ControlCpuCollector(self.control_cpu))
        registry.register(ScaleCollector(self.scale))
        if self.batches is not None:
            registry.register(BatchCollector(self.batches))
        if self.shadows is not None:
            registry.register(ShadowCollector(self.shadows))
        if self.gpus.enabled:
            registry.register(GpuCollector(self.gpus))
        if self.sources:
            registry.register(DiscoveryCollector(self.sources))
        if self.peers.enabled:
            registry.register(PeerCollector(self.peers))

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """Start everything that needs the loop, in order; each stop goes on the stack as its part starts."""
        async with contextlib.AsyncExitStack() as stack:
            if self.receipt_log is not None:
                stack.callback(self.receipt_log.close)
            if self.tracing is not None:
                stack.callback(self.tracing.stop)  # after the last request's spans ended
            # Peers and GPU agents; the replicas have their own session, with their key and TLS context.
            control = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0))
            stack.push_async_callback(control.close)
            replicas = self.access.client_session()
            stack.push_async_callback(replicas.close)
            # Hot path: a lean HTTP/1.1 client (http/upstream_client.py; measured in docs/benchmarks/overhead.md).
            settings = self.settings
            hot = UpstreamPool(
                upstream_deadlines(settings), max_response_bytes=settings.max_response_bytes, access=self.access
            )
            stack.callback(hot.close)
            reads = PooledReads(self.access, self.settings.probe_timeout_s)
            stack.callback(reads.close)
            secrets = self._secret_files(hot, reads, replicas)
            self.metrics.registry.register(secrets)
            secrets.start()
            stack.push_async_callback(secrets.stop)
            monitor = ReplicaMonitor(
                self.registry,
                self.catalog,
                reads,
                self.settings.probe_interval_s,
                held=lambda: self.admission.depth > 0,
                held_interval_s=self.settings.held_probe_interval_s,
                quiet_interval_s=self.settings.quiet_probe_interval_s,
                confirm_probes=self.settings.fail_threshold,
                linked_quiet_interval_s=self.settings.linked_quiet_probe_interval_s,
                probes_cpu=self.control_cpu.probes,
                scrapes_cpu=self.control_cpu.scrapes,
            )
            tokens = self._token_cache(replicas)
            relaying = self._relaying(hot, replicas, tokens)
            fleet = await self._kv_events(stack, monitor, replicas, tokens)
            relay = SiblingRelay(self.settings.peer_siblings, lambda: sibling_headers(self.key_ring))
            add_admin_routes(app, fleet, lambda replica: replica_status(replica, self.state), relay)
            add_scale_routes(app, self.scale)
            self.scale.start()
            stack.push_async_callback(self.scale.stop)
            self.shutdown.serving(asyncio.get_running_loop())
            await self._watch(stack, monitor, control, fleet)
            self.hot_path.serve(ProxiedEndpoints(relaying, PROXIED_ENDPOINTS))
            stack.callback(self.hot_path.stop)
            if self.batch_db is not None:
                stack.push_async_callback(self.batch_db.close)
            if self.batches is not None:
                self.batches.start()
                stack.push_async_callback(self.batches.stop)
            yield

    def _token_cache(self, replicas: aiohttp.ClientSession) -> TokenCache | None:
        """Prompts' tokens, for a policy that reads KV blocks: `--tokenizer DIR`'s, `--tokenizer remote`: the
        replicas', none given: each model's own found here, else the replicas' (`ModelTokenizers`)."""
        if Need.KV_PREFIX not in self.needs:
            return None
        remote = RemoteTokenizer(replicas)
        tokenizer: PromptTokenizer
        if self.local_tokenizer is not None:
            tokenizer = self.local_tokenizer
        elif self.settings.tokenizer == "remote":
            tokenizer = remote
        else:
            tokenizer = ModelTokenizers(remote, self._model_root, default_cache_dir())
        return TokenCache(tokenizer, self.settings.token_cache_entries)

    def _model_root(self, model: str) -> str | None:
        """Where the replicas serve `model` from, as their cards say (vLLM: its --model)."""
        root = self.catalog.model_cards(healthy_only=False).get(model, {}).get("root")
        return root if isinstance(root, str) else None

    def _relaying(self, hot: UpstreamPool, replicas: aiohttp.ClientSession, tokens: TokenCache | None) -> Relaying:
        """The hot path's parts: the dispatcher and what the exchanges need."""
        registry, catalog, metrics = self.registry, self.catalog, self.metrics
        adapters = AdapterLoader(registry, catalog, metrics)
        adapters.attach(replicas)
        dispatcher = Dispatcher(
            registry, catalog, self.selector, hot, metrics, self.retry, self.admission, self.open_streams,
            rng=self.rng, adapters=adapters,
        )  # fmt: skip
        features = FeatureBuilder(
            self.needs, registry, catalog, metrics, self.kv_index, self.text_index, tokens, self.bindings,
            self.chunk_tokens,
        )  # fmt: skip
        return Relaying(
            registry, catalog, features, dispatcher, metrics, ResponseOwners(),
            max_body_bytes=self.settings.max_body_bytes, flow=self.flow, receipts=self.receipts,
            shadows=self.shadows, tracing=self.tracing, access_log=self.settings.access_log, slo=self.slo,
            cold_start=self.cold_start,
        )  # fmt: skip

    def adopt_server_tls(self, context: ssl.SSLContext | None) -> None:
        """The context uvicorn serves HTTPS with (serve.py), for a changed certificate to be loaded into."""
        self.server_tls = context

    def _secret_files(self, hot: UpstreamPool, reads: PooledReads, replicas: aiohttp.ClientSession) -> SecretFiles:
        """What each secret's file changing puts in force (control/secret_files.py)."""
        settings = self.settings

        def keys() -> None:
            keys = load_keys(settings)
            if keys.enabled != self.key_ring.keys.enabled:
                raise ValueError("keys cannot be turned on or off by a file change: restart the router for that")
            tenants = tenants_for(settings, keys)
            self.key_ring.keys, self.flow.tenants = keys, tenants
            self.peers.use_admin_key(keys.admins[0] if keys.admins else None)

        def replica_key() -> None:
            access = replica_access(settings)
            hot.use_access(access)
            reads.use_access(access)
            replicas.headers.popall("Authorization", None)
            replicas.headers.update(access.headers)
            # Those that refused the old key are routable again: one that refuses this key too is told at once
            # (a request there is retried elsewhere), one restarted with it first is not left idle till a probe.
            for replica in self.registry.misconfigured():
                if replica.misconfigured == KEY_REFUSED:
                    self.registry.set_misconfigured(replica.id, None)

        def replica_tls() -> None:
            if self.access.tls is not None:
                ca, cert, key = (
                    settings.replica_ssl_ca_certs,
                    settings.replica_ssl_certfile,
                    settings.replica_ssl_keyfile,
                )
                reload_tls(self.access.tls, ca, cert, key)

        def server_tls() -> None:
            cert, key, ca = settings.ssl_certfile, settings.ssl_keyfile, settings.ssl_ca_certs
            for context in (self.server_tls, self.peers.tls):
                if context is not None:
                    reload_tls(context, ca, cert, key)

        def files(*paths: Path | None) -> list[Path]:
            return [path for path in paths if path is not None]

        return SecretFiles(
            [
                Secret(
                    "--api-key-file",
                    files(settings.api_key_file, settings.admin_key_file, settings.metrics_key_file),
                    keys,
                ),
                Secret("--tenant-file", files(settings.tenant_file), keys),
                Secret("--replica-api-key-file", files(settings.replica_api_key_file), replica_key),
                Secret(
                    "--replica-ssl-certfile",
                    files(settings.replica_ssl_ca_certs, settings.replica_ssl_certfile, settings.replica_ssl_keyfile),
                    replica_tls,
                ),
                Secret(
                    "--ssl-certfile",
                    files(settings.ssl_certfile, settings.ssl_keyfile, settings.ssl_ca_certs),
                    server_tls,
                ),
            ],
            settings.secret_check_interval_s,
        )

    async def _kv_events(
        self,
        stack: contextlib.AsyncExitStack,
        monitor: ReplicaMonitor,
        replicas: aiohttp.ClientSession,
        tokens: TokenCache | None,
    ) -> FleetControl:
        """The replicas' KV-event subscribers, started; the fleet control that adds and removes them."""
        zmq_context = events_context(max(len(self.registry), len(self.kv_endpoints)))
        stack.callback(zmq_context.destroy, linger=0)
        subscribers = self.state.subscribers
        cpu = self.control_cpu.kv_events
        subscribers.extend(
            KvEventSubscriber(self.kv_index, rid, endpoint, zmq_context, time.monotonic, monitor, cpu)
            for rid, endpoint in self.kv_endpoints.items()
        )
        self.metrics.registry.register(RoutingStateCollector(self.kv_index, subscribers, self.text_index, tokens))

        async def stop_subscribers() -> None:  # those added at run time too
            for subscriber in list(subscribers):
                await subscriber.stop()

        stack.push_async_callback(stop_subscribers)
        for subscriber in subscribers:
            subscriber.start()
        return FleetControl(self.registry, monitor, subscribers, self.kv_index, zmq_context, replicas, cpu)

    async def _watch(
        self,
        stack: contextlib.AsyncExitStack,
        monitor: ReplicaMonitor,
        control: aiohttp.ClientSession,
        fleet: FleetControl,
    ) -> None:
        """What watches the fleet: GPUs, the adapter folder, the probes, discovery, the peers; each read
        once before serving where the first request depends on it."""
        gpus, settings = self.gpus, self.settings
        if gpus.local is not None:
            # First reading before serving: /status has the GPUs at once, and a host without one
            # logs its single `no NVIDIA GPU found: ...` line at start.
            await asyncio.to_thread(gpus.local.sample_once)
            gpus.refresh()
            gpus.local.start()
            stack.push_async_callback(gpus.local.stop)
        if gpus.agents is not None:  # polled from the start, not waited for: an agent may be slow or gone
            gpus.agents.start(control)
            stack.push_async_callback(gpus.agents.stop)
        if self.folder_watch is not None:
            await self.folder_watch.refresh()  # the folder's adapters listed and servable from the first request
            self.folder_watch.start()
            stack.push_async_callback(self.folder_watch.stop)
        await monitor.probe_all()
        monitor.start()
        stack.push_async_callback(monitor.stop)
        if self.resolver is not None:
            # The first answer before serving: discovered replicas are probed as they are added.
            interval, kv_port = settings.discover_interval_s, settings.discover_kv_port
            discovery = Discovery(self.sources, self.resolver, fleet, interval, kv_port)
            await discovery.refresh()
            discovery.start()
            stack.push_async_callback(discovery.stop)
        peers = self.peers
        peers.attach(control)
        if peers.enabled:
            # Before serving (uvicorn listens only once this returns): a restarted router routes as its
            # peers do from its first request.
            await peers.load_from_a_peer(settings.warm_start_timeout_s)
            peers.on_suspect = SuspectChecks(self.registry, monitor, settings.fail_threshold, settings.probe_interval_s)
            peers.start()
            stack.push_async_callback(peers.stop)


def create_app(
    settings: RouterSettings,
    *,
    policy: Policy | None = None,
    rng: random.Random | None = None,
    nvml: Callable[[], Nvml] = load_nvml,
    keys: Keys | None = None,
) -> RouterApp:
    """`nvml` loads the NVML library (the `pynvml` module); tests pass a fake, as these hosts have no GPU.
    `keys`: API and admin keys, read from the settings when not given."""
    keys = keys if keys is not None else load_keys(settings)
    router = Router(settings, policy, rng, nvml, keys)
    app = RouterApp(router.hot_path, title="dpserve router", lifespan=router.lifespan, docs_url=None, redoc_url=None)
    app.state.shutdown = router.shutdown
    app.state.adopt_server_tls = router.adopt_server_tls
    app.add_middleware(Guard, ring=router.key_ring, max_header_bytes=settings.max_header_bytes)
    install_error_handlers(app)
    _document_proxied(app)
    add_status_routes(app, router.state)
    add_peer_routes(app, router.peers)
    if router.batch_db is not None and router.batches is not None:
        add_batch_routes(
            app,
            router.batch_db,
            router.batches,
            router.flow,
            settings.batch_file_max_bytes,
            settings.batch_file_max_lines,
        )
    return app


def _document_proxied(app: FastAPI) -> None:
    """Adds the proxied endpoints, which FastAPI never sees, to the OpenAPI document."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            generate()["paths"].update(proxied_openapi_paths(PROXIED_ENDPOINTS))
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI documents this override
