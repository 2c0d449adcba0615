"""One simulator replica (one engine, or `--data-parallel-size` of them behind one API), wired from the
settings: what `dpserve sim` serves alone, and each of a `--count` fleet's replicas (dpserve.sim.fleet)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
from starlette.applications import Starlette

from dpserve.config import SimSettings
from dpserve.sim.api import SimApi, SimModel
from dpserve.sim.cache import PrefixCache
from dpserve.sim.dp import EngineGroup
from dpserve.sim.engine import LatencyModel, SimEngine
from dpserve.sim.kv_publisher import KvEventPublisher
from dpserve.sim.metrics import EngineMetrics, SimMetrics
from dpserve.sim.tokenizer import SimTokenizer, make_tokenizer
from dpserve.tiny_model import TINY_MODEL_NAME


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
                scheduling_policy=settings.sim_scheduling_policy,
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
