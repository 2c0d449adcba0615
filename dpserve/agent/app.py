"""The agent's HTTP app: GET /gpus (JSON for routers), /metrics (DCGM-like Prometheus text), /health."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Callable

import prometheus_client
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dpserve.agent.exporter import AgentCollector
from dpserve.agent.poller import AgentPoller
from dpserve.agent.reading import reading_json
from dpserve.config import AgentSettings
from dpserve.gpu.listeners import Reachable, reachable
from dpserve.gpu.nvml import Nvml, load_nvml
from dpserve.gpu.sampler import GpuSampler


def create_agent_app(
    settings: AgentSettings,
    nvml: Callable[[], Nvml] = load_nvml,
    lookup: Callable[[int], Reachable] = reachable,
) -> Starlette:
    """`nvml` loads the NVML library (tests and GPU-less rehearsals pass a fake); `lookup` tells where a
    GPU process listens (tests pass one that needs no /proc)."""
    hostname = settings.hostname or socket.gethostname()
    poller = AgentPoller(GpuSampler(nvml, settings.interval_s), settings.interval_s, lookup)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(lambda: poller.latest, hostname))

    async def gpus(_: Request) -> JSONResponse:
        return JSONResponse(reading_json(poller.latest, hostname))

    async def metrics(_: Request) -> Response:
        return Response(prometheus_client.generate_latest(registry), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    async def health(_: Request) -> JSONResponse:
        # Up while serving: a host without a GPU (or whose driver failed) still answers, and says so in /gpus.
        return JSONResponse({"status": "ok"})

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await poller.start()
        try:
            yield
        finally:
            await poller.stop()

    app = Starlette(
        routes=[Route("/gpus", gpus), Route("/metrics", metrics), Route("/health", health)], lifespan=lifespan
    )
    app.state.poller = poller
    return app
