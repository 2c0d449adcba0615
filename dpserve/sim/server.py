"""`dpserve sim`: one simulator replica, or `--count` of them in this process (dpserve.sim.fleet), served by
uvicorn. The one module that serves: the replica and the fleet only build, and import nothing of this."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import uvicorn

from dpserve.config import SimSettings
from dpserve.sim.fleet import FleetError, build_fleet, port_span
from dpserve.sim.kv_publisher import KvEventBindError
from dpserve.sim.replica import build_simulator

log = logging.getLogger("dpserve.sim")


def serve_sim(settings: SimSettings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.sim_startup_s:
        log.info("sim: starting for %g s (--startup), as vLLM loading its model", settings.sim_startup_s)
        time.sleep(settings.sim_startup_s)
    if settings.sim_count > 1:
        serve_fleet(settings)
        return
    certfile, keyfile = tls_files(settings)
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
    server(simulator.app(), settings, certfile, keyfile, host=settings.host, port=settings.port).run()


def server(app: Any, settings: SimSettings, certfile: str | None, keyfile: str | None, **where: Any) -> uvicorn.Server:
    """uvicorn serving `app` as every simulator is served; `where`: its host and port (none: given sockets)."""
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        access_log=settings.access_log,
        loop="uvloop",
        http="httptools",
        ssl_certfile=certfile,
        ssl_keyfile=keyfile,
        **where,
    )
    return uvicorn.Server(config)


def tls_files(settings: SimSettings) -> tuple[str | None, str | None]:
    """uvicorn's HTTPS files (--ssl-certfile, --ssl-keyfile), checked readable first: a clear error, not a
    traceback from deep in the ssl module."""
    files = {"--ssl-certfile": settings.sim_ssl_certfile, "--ssl-keyfile": settings.sim_ssl_keyfile}
    for flag, path in files.items():
        if path is not None and not os.access(path, os.R_OK):
            raise SystemExit(f"dpserve sim: {flag} {path}: cannot be read")
    certfile, keyfile = (str(path) if path is not None else None for path in files.values())
    return certfile, keyfile


def engine_summary(settings: SimSettings) -> str:
    return (
        f"{settings.sim_data_parallel_size} engine(s) of {settings.sim_num_blocks} blocks of "
        f"{settings.sim_block_size} tokens, max {settings.sim_max_num_seqs} seqs; speed {settings.sim_speed:g}"
    )


def serve_fleet(settings: SimSettings) -> None:
    """`--count N`: N replicas in this process, one uvicorn server listening on all their ports."""
    started = time.monotonic()
    certfile, keyfile = tls_files(settings)
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
    server(fleet, settings, certfile, keyfile).run(sockets=fleet.sockets)
