"""Running the router app under uvicorn."""

from __future__ import annotations

import logging
import sys

import prometheus_client
import uvicorn

from dpserve.config import Settings
from dpserve.router.access import check_bind, load_keys
from dpserve.router.app import create_app


def serve_router(settings: Settings) -> int:
    """Serves until stopped; 2 with one line on stderr when the settings are wrong."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Process-wide switch (hence here, not in the app factory): no `*_created` series per counter.
    prometheus_client.disable_created_metrics()
    try:
        keys = load_keys(settings)
        check_bind(settings.host, keys, settings.insecure)
        app = create_app(settings, keys=keys)
    except ValueError as exc:  # a bad --replica, --kv-events, --tokenizer or key, or an unsafe bind
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
        # On SIGTERM uvicorn stops listening at once, then requests in flight (streams too) get this
        # long to finish before they are cut.
        timeout_graceful_shutdown=settings.shutdown_grace_s,
    )
    return 0
