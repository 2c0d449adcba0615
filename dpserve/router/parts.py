"""Each part of the router built from the settings: one function per part, called by `app.py` in order."""

from __future__ import annotations

import logging
import os
import random
import secrets
import socket
import sqlite3
import ssl
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from dpserve.config import RouterSettings, default_data_dir
from dpserve.gpu.health import GpuHealthRules, GpuHealthTracker
from dpserve.gpu.local_processes import ReplicaProcesses
from dpserve.gpu.nvml import Nvml
from dpserve.gpu.placement import ReplicaClue, parse_replica_spec
from dpserve.gpu.sampler import GpuSampler
from dpserve.kvindex.index import KvIndex
from dpserve.kvindex.recent import RecentRoutes
from dpserve.kvindex.text_prefix import TextPrefixIndex
from dpserve.policies import Need, Policy, PolicyTuning, make_policy
from dpserve.policies.balance import BalanceGuard
from dpserve.policies.bindings import SessionBindings
from dpserve.policies.kv_aware import KvAwareWeights
from dpserve.replicas.access import ReplicaAccess, load_replica_access
from dpserve.replicas.adapter_folder import AdapterFolder, AdapterFolderWatch
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.discovery import DnsResolver, parse_discovery_source
from dpserve.replicas.health import HealthRules
from dpserve.replicas.kv_events import engine_endpoint, parse_kv_event_source
from dpserve.replicas.registry import ReplicaRegistry, split_engine_count, split_replica_name
from dpserve.router.batch.store import BatchStore
from dpserve.router.fleet.agents import GpuAgents
from dpserve.router.fleet.gpus import GpuFleet
from dpserve.router.flow.access import Keys
from dpserve.router.flow.admission import Admission
from dpserve.router.flow.gate import Flow
from dpserve.router.flow.quotas import QuotaBook
from dpserve.router.flow.tenants import Tenants
from dpserve.router.flow.usage import UsageBook
from dpserve.router.http.upstream_client import Deadlines
from dpserve.router.observe.metrics import RouterMetrics
from dpserve.router.observe.prompt_tokens import LocalTokenizer
from dpserve.router.peers.board import PeerBoard
from dpserve.router.peers.links import PeerLinks, peer_tls
from dpserve.router.quality.shadows import ShadowScorer
from dpserve.router.routing.selection import PrefixLookup, Selector
from dpserve.router.scale.signal import ScaleRules

log = logging.getLogger("dpserve.router")


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
        slo_inner=settings.slo_inner_policy,
        slo_headroom=settings.slo_headroom,
        slo_first=settings.vllm_priority,
    )


def scale_rules(settings: RouterSettings) -> ScaleRules:
    return ScaleRules(
        target=settings.scale_target,
        spread=settings.scale_spread,
        down_delay_s=settings.scale_down_delay_s,
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
        slo_reserve=settings.slo_reserve,
        engine_queue=settings.engine_queue,
    )


def tenants_for(settings: RouterSettings, keys: Keys) -> Tenants:
    """The tenants' rules (`--tenant`, then `--tenant-file`'s lines) and the names of the keys."""
    specs = list(settings.tenants)
    if settings.tenant_file is not None:
        try:
            lines = settings.tenant_file.read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"--tenant-file {settings.tenant_file}: {exc.strerror}") from None
        specs += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    return Tenants.from_specs(specs, keys.user_names, open_access=not keys.enabled)


def flow_for(settings: RouterSettings, keys: Keys, admission: Admission) -> Flow:
    """Tenants from the named keys and `--tenant` rules; quotas and usage books; the admission queue."""
    if settings.engine_queue < 0:
        raise ValueError(f"--engine-queue {settings.engine_queue}: 0 or more requests per replica")
    if not 0 <= settings.batch_reserve < 1:
        raise ValueError(f"--batch-reserve {settings.batch_reserve:g}: a share from 0 up to (not including) 1")
    if not 0 <= settings.slo_reserve < 1:
        raise ValueError(f"--slo-reserve {settings.slo_reserve:g}: a share from 0 up to (not including) 1")
    tenants = tenants_for(settings, keys)
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
    """Replica id -> ZMQ endpoint, from `--kv-events URL=ENDPOINT` (the URL must be a known replica; for a
    data-parallel server, ENDPOINT is its `--kv-events-config` one and each engine's is offset by its rank)."""
    endpoints: dict[str, str] = {}
    for text in settings.kv_events:
        url, endpoint = parse_kv_event_source(text)
        replicas = registry.at_url(url)
        if not replicas:
            raise ValueError(f"--kv-events names {url}, which is not one of the router's --replica URLs")
        for replica in replicas:
            endpoints[replica.id] = engine_endpoint(endpoint, replica.rank)
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
    processes = ReplicaProcesses(sorted({r.url for r in registry if not r.gpu_hint}))

    def clues() -> list[ReplicaClue]:
        pids = processes.pids()
        replicas = list(registry)
        engines = Counter(r.url for r in replicas)  # a data-parallel server's engines share its URL
        return [
            ReplicaClue(r.id, r.gpu_hint, pids.get(r.url, frozenset()), (r.rank or 0, engines[r.url])) for r in replicas
        ]

    return GpuSampler(nvml, settings.gpu_interval_s, clues=clues)


def check_base_url(url: str, flag: str, expected: str) -> None:
    """A service's base URL: http(s), a host, no path (the router appends its own)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
        raise ValueError(f"{flag} {url!r}: expected {expected}")


def check_replica_specs(specs: Sequence[str]) -> None:
    """Each `--replica [NAME=]URL[@gpu=N][@dp=N]` as the registry will read it, its URL a base URL: a
    ValueError naming the flag for the first that is not, before anything starts (a replica at `notaurl`
    would only ever fail its probes)."""
    for spec in specs:
        _, rest = split_replica_name(spec)
        url, _ = parse_replica_spec(split_engine_count(rest)[0])
        check_base_url(url, "--replica", "a replica's base URL, [NAME=]URL[@gpu=N], e.g. http://10.0.0.2:8000")


OTLP_SCHEMES = ("http", "https", "grpc", "grpcs")


def check_otlp_endpoint(endpoint: str | None) -> None:
    """`--otlp-traces-endpoint`: a URL the exporters take (http(s) with a path for OTLP/HTTP, grpc://) or gRPC's
    bare HOST:PORT; a ValueError naming the flag otherwise (the exporter would only fail in the background)."""
    if endpoint is None:
        return
    if "://" not in endpoint:
        host, _, port = endpoint.rpartition(":")
        if host and port.isdigit() and not any(char.isspace() or char in "/@" for char in host):
            return
    else:
        parts = urlsplit(endpoint)
        if parts.scheme in OTLP_SCHEMES and parts.hostname and not any(char.isspace() for char in endpoint):
            return
    raise ValueError(
        f"--otlp-traces-endpoint {endpoint!r}: expected a collector's URL, e.g. grpc://10.0.0.5:4317, "
        "http://10.0.0.5:4318/v1/traces or 10.0.0.5:4317"
    )


def batch_store_for(settings: RouterSettings) -> BatchStore | None:
    """`--batch-store`: off, PostgreSQL, a SQLite file, or by default a SQLite file per port under the data
    directory (the workers of one router share it; another router on this host has its own)."""
    where = (settings.batch_store or "").strip()
    if where.lower() == "off":
        return None
    if not where:
        where = str(default_data_dir() / f"batches-{settings.port}.sqlite3")
    try:
        return BatchStore(where)
    except (OSError, sqlite3.Error) as exc:
        raise ValueError(f"--batch-store {where}: {exc}") from None


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
        tls=_peer_tls(settings),
    )


def _peer_tls(settings: RouterSettings) -> ssl.SSLContext | None:
    """A router serving HTTPS reaches its peers over it, verified against its --ssl-ca-certs (links.py)."""
    try:
        return peer_tls(settings.ssl_ca_certs, settings.ssl_certfile, settings.ssl_keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"TLS to peers (--ssl-certfile, --ssl-keyfile, --ssl-ca-certs): {exc}") from None


def replica_access(settings: RouterSettings) -> ReplicaAccess:
    """The key and TLS context every client to the replicas uses; a bad file fails here, before serving."""
    return load_replica_access(
        settings.replica_api_key,
        settings.replica_api_key_file,
        settings.replica_ssl_ca_certs,
        settings.replica_ssl_certfile,
        settings.replica_ssl_keyfile,
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
