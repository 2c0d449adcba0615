"""`dpserve sim`: one simulator replica, wired from the settings and served by uvicorn."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette

from dpserve.config import SimSettings
from dpserve.sim.api import SimApi, SimModel
from dpserve.sim.cache import PrefixCache
from dpserve.sim.engine import LatencyModel, SimEngine
from dpserve.sim.kv_publisher import KvEventPublisher
from dpserve.sim.metrics import SimMetrics
from dpserve.sim.tokenizer import make_tokenizer
from dpserve.tiny_model import TINY_MODEL_NAME

log = logging.getLogger("dpserve.sim")


@dataclass
class Simulator:
    api: SimApi
    publisher: KvEventPublisher | None

    def app(self) -> Starlette:
        app = self.api.app()
        publisher = self.publisher

        @contextlib.asynccontextmanager
        async def lifespan(_: Starlette) -> AsyncIterator[None]:
            try:
                yield
            finally:
                if publisher is not None:
                    publisher.close()

        app.router.lifespan_context = lifespan
        return app


def sim_model_name(settings: SimSettings) -> str:
    return settings.served_model_name or settings.model or TINY_MODEL_NAME


def build_simulator(settings: SimSettings) -> Simulator:
    name = sim_model_name(settings)
    cache = PrefixCache(settings.sim_num_blocks, settings.sim_block_size)
    latency = LatencyModel(
        prefill_s_per_token=settings.sim_prefill_ms_per_token / 1000,
        decode_s_per_token=settings.sim_decode_ms_per_token / 1000,
        batch_slowdown=settings.sim_batch_slowdown,
        jitter=settings.sim_jitter,
        speed=settings.sim_speed,
    )
    publisher = KvEventPublisher(settings.sim_kv_events) if settings.sim_kv_events else None
    metrics = SimMetrics(name, cache, settings.sim_max_num_seqs)
    engine = SimEngine(
        cache,
        latency,
        settings.sim_max_num_seqs,
        seed=settings.sim_seed,
        observer=metrics,
        publish=publisher.publish if publisher else None,
    )
    metrics.watch(engine)
    model = SimModel(name=name, max_model_len=settings.max_model_len, root=f"dpserve-sim/{name}")
    api = SimApi(model, make_tokenizer(settings.sim_tokenizer), engine, metrics, settings.sim_api_key)
    return Simulator(api, publisher)


def serve_sim(settings: SimSettings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    simulator = build_simulator(settings)
    log.info(
        "sim %s on %s:%d (%d blocks of %d tokens, max %d seqs, speed %g, KV events: %s, API key: %s)",
        simulator.api.model.name,
        settings.host,
        settings.port,
        settings.sim_num_blocks,
        settings.sim_block_size,
        settings.sim_max_num_seqs,
        settings.sim_speed,
        settings.sim_kv_events or "off",
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
