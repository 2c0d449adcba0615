"""Running the router app under uvicorn."""

from __future__ import annotations

import logging
import sys

import prometheus_client
import uvicorn

from dpserve.config import Settings
from dpserve.router.app import create_app


def serve_router(settings: Settings) -> int:
    """Serves until stopped; 2 with one line on stderr when the settings are wrong."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Process-wide switch (hence here, not in the app factory): no `*_created` series per counter.
    prometheus_client.disable_created_metrics()
    try:
        app = create_app(settings)
    except ValueError as exc:  # a bad --replica, --kv-events or --tokenizer
        print(f"dpserve router: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        access_log=settings.access_log,
        log_level=settings.log_level,
        # Streams in flight get this long to finish when the router is asked to stop.
        timeout_graceful_shutdown=30,
    )
    return 0
