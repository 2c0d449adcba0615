"""Running the agent under uvicorn."""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable

import prometheus_client
import uvicorn

from dpserve.agent.app import create_agent_app
from dpserve.config import AgentSettings
from dpserve.gpu.nvml import Nvml, load_nvml


def nvml_loader(spec: str | None) -> Callable[[], Nvml]:
    """pynvml, or `MODULE:CALLABLE` (a stand-in for a host without a GPU). ValueError when it cannot load."""
    if not spec:
        return load_nvml
    module_name, _, attribute = spec.partition(":")
    try:
        loader: Callable[[], Nvml] = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"--nvml {spec}: {exc}") from None
    return loader


def serve_agent(settings: AgentSettings) -> int:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated upstream
    try:
        app = create_agent_app(settings, nvml_loader(settings.nvml))
    except ValueError as exc:
        print(f"dpserve agent: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        access_log=settings.access_log,
        log_level=settings.log_level,
    )
    return 0
