"""`dpserve sim`: one simulator replica (one engine, or `--data-parallel-size` of them behind one server),
wired from the settings and served by uvicorn."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn
import zmq
from starlette.applications import Starlette

from dpserve.config import SimSettings
from dpserve.sim.api import SimApi, SimModel
from dpserve.sim.cache import PrefixCache
from dpserve.sim.dp import EngineGroup
from dpserve.sim.engine import LatencyModel, SimEngine
from dpserve.sim.kv_publisher import KvEventBindError, KvEventPublisher
from dpserve.sim.metrics import EngineMetrics, SimMetrics
from dpserve.sim.tokenizer import SimTokenizer, make_tokenizer
from dpserve.tiny_model import TINY_MODEL_NAME

log = logging.getLogger("dpserve.sim")


@dataclass
class Simulator:
    api: SimApi
    publishers: list[KvEventPublisher]
    """One per engine, in rank order (none without --kv-events)."""

    def app(self) -> Starlette:
        app = self.api.app()

        @contextlib.asynccontextmanager
        async def lifespan(_: Starlette) -> AsyncIterator[None]:
            try:
                yield
            finally:
                self.close()

        app.router.lifespan_context = lifespan
        return app

    def close(self) -> None:
        """Close its KV-event publishers."""
        for publisher in self.publishers:
            publisher.close()


def sim_model_name(settings: SimSettings) -> str:
    return settings.served_model_name or settings.model or TINY_MODEL_NAME


def build_simulator(
    settings: SimSettings,
    index: int = 0,
    tokenizer: SimTokenizer | None = None,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
) -> Simulator:
    """Replica `index` of `--count` (0: the only one): its engines seeded from --seed + index x engines and
    publishing on the --kv-events endpoint offset by as much, plus their rank. `tokenizer` (stateless) may be
    shared by replicas; `context`: the ZMQ context for the publishers (none: the process's shared one)."""
    name = sim_model_name(settings)
    latency = LatencyModel(
        prefill_s_per_token=settings.sim_prefill_ms_per_token / 1000,
        decode_s_per_token=settings.sim_decode_ms_per_token / 1000,
        batch_slowdown=settings.sim_batch_slowdown,
        jitter=settings.sim_jitter,
        speed=settings.sim_speed,
    )
    size = settings.sim_data_parallel_size
    caches = [PrefixCache(settings.sim_num_blocks, settings.sim_block_size) for _ in range(size)]
    metrics = SimMetrics(name, caches[0], settings.sim_max_num_seqs)
    engines: list[SimEngine] = []
    publishers: list[KvEventPublisher] = []
    try:
        for rank, cache in enumerate(caches):
            observer: EngineMetrics = metrics if rank == 0 else metrics.engine(rank, cache, settings.sim_max_num_seqs)
            endpoint, offset = settings.sim_kv_events, index * size + rank
            publisher = (
                KvEventPublisher(endpoint, data_parallel_rank=rank, offset=offset, context=context)
                if endpoint
                else None
            )
            publishers.extend([publisher] if publisher else [])
            engine = SimEngine(
                cache,
                latency,
                settings.sim_max_num_seqs,
                seed=settings.sim_seed + offset,
                observer=observer,
                publish=publisher.publish if publisher else None,
            )
            observer.watch(engine)
            engines.append(engine)
    except BaseException:
        for built in publishers:
            built.close()
        raise
    # Each publisher is its rank's, in rank order.
    metrics.count_published(dict(enumerate(publishers)))
    model = SimModel(name=name, max_model_len=settings.max_model_len, root=f"dpserve-sim/{name}")
    tokenizer = tokenizer or make_tokenizer(settings.sim_tokenizer)
    api = SimApi(model, tokenizer, EngineGroup(engines), metrics, settings.sim_api_key)
    return Simulator(api, publishers)


def serve_sim(settings: SimSettings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.sim_count > 1:
        serve_fleet(settings)
        return
    try:
        simulator = build_simulator(settings)
    except KvEventBindError as exc:
        raise SystemExit(f"dpserve sim: {exc}") from None
    log.info(
        "sim %s on %s:%d (%s, KV events: %s, key: %s)",
        simulator.api.model.name,
        settings.host,
        settings.port,
        engine_summary(settings),
        " ".join(publisher.endpoint for publisher in simulator.publishers) or "off",
        "required on /v1" if settings.sim_api_key else "none",
    )
    uvicorn.run(
        simulator.app(),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        loop="uvloop",
        http="httptools",
    )


def engine_summary(settings: SimSettings) -> str:
    return (
        f"{settings.sim_data_parallel_size} engine(s) of {settings.sim_num_blocks} blocks of "
        f"{settings.sim_block_size} tokens, max {settings.sim_max_num_seqs} seqs; speed {settings.sim_speed:g}"
    )


def serve_fleet(settings: SimSettings) -> None:
    """`--count N`: N replicas in this process, one uvicorn server listening on all their ports."""
    from dpserve.sim.fleet import FleetError, build_fleet, port_span

    started = time.monotonic()
    try:
        fleet = build_fleet(settings)
    except (FleetError, KvEventBindError) as exc:
        raise SystemExit(f"dpserve sim: {exc}") from None
    events = [publisher.endpoint for simulator in fleet.simulators for publisher in simulator.publishers]
    log.info(
        "sim %s: %d replicas on %s ports %s, built in %.2f s (each %s, KV events: %s, key: %s)",
        fleet.simulators[0].api.model.name,
        len(fleet.simulators),
        settings.host,
        port_span(fleet.ports),
        time.monotonic() - started,
        engine_summary(settings),
        f"{events[0]} .. {events[-1]} ({len(events)})" if events else "off",
        "required on /v1" if settings.sim_api_key else "none",
    )
    config = uvicorn.Config(
        fleet, log_level=settings.log_level, access_log=settings.access_log, loop="uvloop", http="httptools"
    )
    uvicorn.Server(config).run(sockets=fleet.sockets)
