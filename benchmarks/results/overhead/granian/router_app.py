"""The router's ASGI app for another server (granian): replicas from DPSERVE_REPLICAS (a comma list)."""

import os

import prometheus_client

from dpserve.config import RouterSettings
from dpserve.router.app import create_app

prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated upstream
replicas = tuple(os.environ["DPSERVE_REPLICAS"].split(","))
settings = RouterSettings(replicas=replicas, policy="round_robin", gpu_interval_s=0, log_level="warning")
app = create_app(settings)
