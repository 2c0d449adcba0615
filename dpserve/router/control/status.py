"""What the router says of itself: /health, /ready, /v1/models, /status and its page, /metrics, the
receipts and usage it keeps; all read from `RouterState`, complete when the app is built."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import HTMLResponse, JSONResponse, Response

from dpserve.kvindex.index import KvIndex
from dpserve.policies import Policy
from dpserve.policies.latency import ReplicaLatency
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.kv_events import KvEventSubscriber
from dpserve.replicas.registry import Replica, ReplicaRegistry
from dpserve.router.batch.runner import BatchRunner, progress_status
from dpserve.router.control.dashboard import dashboard_html
from dpserve.router.control.discovery import SourceState
from dpserve.router.control.shutdown import Shutdown
from dpserve.router.control.sibling_relay import sibling_headers
from dpserve.router.control.worker_status import WorkerStatus
from dpserve.router.fleet.gpus import GpuFleet
from dpserve.router.flow.access import KeyRing, Keys
from dpserve.router.flow.gate import Flow
from dpserve.router.http.errors import OpenAIError
from dpserve.router.observe.control_cpu import ControlCpu
from dpserve.router.observe.metrics import RouterMetrics
from dpserve.router.observe.worker_metrics import WorkerMetrics
from dpserve.router.peers.links import PeerLinks
from dpserve.router.quality.latency_watch import SloBook
from dpserve.router.quality.receipts import ReceiptBook
from dpserve.router.quality.shadows import ShadowScorer
from dpserve.router.scale.advisor import ScaleAdvisor


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
    slo: SloBook | None = None
    """Requests' SLOs and the latency models, when the policy predicts time (`--policy slo`)."""
    siblings: tuple[str, ...] = ()
    """With `--workers`: the other workers' private URLs (one scrape, one /status answers for all of them)."""
    control_cpu: ControlCpu = field(default_factory=ControlCpu)
    key_ring: KeyRing = field(default_factory=lambda: KeyRing(Keys()))
    """The keys in force, one of which the sibling workers are read with."""
    batches: BatchRunner | None = None
    """`/v1/batches`' runner (None with `--batch-store off`)."""
    scale: ScaleAdvisor | None = None
    """The desired-replicas signal (`/admin/scale`)."""
    cold_start_wait_s: float = 0.0
    """`--cold-start-wait`: with it, a router with no replica serving is still ready (requests wait for one)."""


def add_status_routes(app: FastAPI, state: RouterState) -> None:
    def sibling_key() -> dict[str, str]:
        return sibling_headers(state.key_ring)

    workers = WorkerMetrics(state.metrics.registry, state.siblings, sibling_key)
    statuses = WorkerStatus(state.siblings, sibling_key)

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
        # Scaled to zero, it still takes requests: they wait for the replica they make the signal ask for.
        ready = (healthy > 0 or state.cold_start_wait_s > 0) and not draining
        body = {
            "ready": ready,
            "healthy_replicas": healthy,
            "replicas": len(state.registry),
            "draining": draining,
        }
        return JSONResponse(body, status_code=200 if ready else 503)

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
        return JSONResponse(state.flow.usage.to_dict())

    @app.get("/metrics")
    async def prometheus_metrics(scope: str = "router") -> Response:
        return Response(await workers.scrape(scope), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    async def status(scope: str = "router") -> JSONResponse:
        return JSONResponse(await statuses.whole(_status(state), scope))

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        whole = await statuses.whole(_status(state), "router")
        return HTMLResponse(dashboard_html(whole), headers={"cache-control": "no-store"})


def _status(state: RouterState) -> dict[str, Any]:
    gpus = state.gpus.status()
    combined = state.gpus.replica_gpus()
    replicas = []
    streams = {subscriber.replica_id: subscriber for subscriber in state.subscribers}
    for replica in state.registry:
        entry = replica_status(replica, state, streams)
        entry["gpus"] = [gpu for gpu in gpus["devices"] if gpu["replica"] == replica.id]
        # Its GPUs as one (a tensor-parallel replica has several): utilization the busiest, memory summed.
        entry["gpu"] = combined[replica.id].to_dict() if replica.id in combined else None
        replicas.append(entry)
    return {
        "policy": state.policy.name,
        "pid": os.getpid(),
        "uptime_s": round(time.time() - state.started_at, 1),
        "replicas": replicas,
        "gpus": gpus,
        **({"discovery": [source.to_dict(time.time()) for source in state.discovery]} if state.discovery else {}),
        **({"peers": state.peers.status()} if state.peers.enabled else {}),
        "flow": state.flow.status(),
        "routing_quality": state.receipts.summary(),
        # CPU seconds since start by background part, and the whole process's (`dpserve bench scale` splits).
        "control_plane_cpu_s": {part: round(s, 3) for part, s in state.control_cpu.seconds().items()},
        **({"shadows": state.shadows.status()} if state.shadows is not None else {}),
        **({"slo": state.slo.summary()} if state.slo is not None else {}),
        **({"batches": progress_status(state.batches)} if state.batches is not None else {}),
        **({"scale": _scale_status(state)} if state.scale is not None else {}),
    }


def _scale_status(state: RouterState) -> dict[str, Any]:
    assert state.scale is not None
    status = state.scale.status()
    status["history"] = status["history"][-10:]
    return {**status, "cold_start_wait_s": state.cold_start_wait_s}


def replica_status(
    replica: Replica, state: RouterState, streams: Mapping[str, KvEventSubscriber] | None = None
) -> dict[str, Any]:
    """`streams`: the subscribers by replica, when every replica is asked for (else each looks its own up)."""
    hit_rate = replica.prefix_cache_hits / replica.prefix_cache_queries if replica.prefix_cache_queries else None
    kv_events = None
    if streams is not None:
        subscriber = streams.get(replica.id)
    else:
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
        "misconfigured": replica.misconfigured,  # why it refuses the router itself (its key, TLS); never the key
        "reachable": replica.health.healthy,  # it passes its health probes, whatever its key, TLS or drain say
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
        "latency": latency_status(replica.latency),
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


def latency_status(latency: ReplicaLatency) -> dict[str, Any]:
    """A replica's learned latency model: its weights, what it learned from, how far off it has been."""
    error = latency.median_error()
    return {
        "ttft_weights": [round(w, 6) for w in latency.ttft.weights],
        "ttft_answers": latency.ttft.samples,
        "ttft_scale": round(latency.ttft_scale, 4),
        "tpot_weights": [round(w, 6) for w in latency.tpot.weights],
        "tpot_answers": latency.tpot.samples,
        "ttft_median_error": None if error is None else round(error, 4),
        "prefilling": latency.prefilling,
        "prefill_tokens": latency.prefill_tokens,
        "slo_bound": latency.slo_bound,
    }
