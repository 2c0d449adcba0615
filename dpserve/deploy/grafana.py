"""The Grafana dashboard the `monitoring` profile provisions: monitoring/grafana/dashboards/dpserve.json.

Panels read the router's `dpserve_*` series and the replicas' own `vllm:*` series (labelled `replica`
by Prometheus, as the router labels them). Regenerate with `python -m dpserve.deploy.grafana`.

Several routers (peers) may be scraped: each reports every replica's health and every GPU, so those are
taken once per replica or GPU (`max by`), and in-flight counts, each router's own, are added up.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARD_FILE = Path("monitoring/grafana/dashboards/dpserve.json")
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
RATE = "[$__rate_interval]"
GPU_SERIES = "gpu, uuid, replica, host"
"""The router's labels of one GPU's series (router/fleet/gpu_metrics.py): the same GPU, whichever router read it."""


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    description: str = ""
    kind: str = "timeseries"


def _quantiles(metric: str, selector: str, by: str = "") -> tuple[Query, ...]:
    group = f"le{', ' + by if by else ''}"
    suffix = f" {{{{{by}}}}}" if by else ""
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{selector}{RATE})))",
            f"p{round(q * 100)}{suffix}",
        )
        for q in (0.5, 0.9, 0.99)
    )


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "Router",
        (
            Panel(
                "Healthy replicas", (Query("sum(max by (replica) (dpserve_replica_healthy))", "healthy"),), kind="stat"
            ),
            Panel(
                "Requests/s by status",
                (Query(f"sum by (status) (rate(dpserve_requests_total{RATE}))", "{{status}}"),),
                unit="reqps",
            ),
            Panel(
                "Time to first token (streams, at the router)",
                _quantiles("dpserve_time_to_first_byte_seconds", '{stream="true"}'),
                unit="s",
            ),
            Panel(
                "Request duration (at the router)",
                _quantiles("dpserve_request_duration_seconds", ""),
                unit="s",
            ),
        ),
    ),
    (
        "Replicas",
        (
            Panel(
                "In flight per replica (router)",
                (Query("sum by (replica) (dpserve_replica_in_flight_requests)", "{{replica}}"),),
                description="Requests the routers have sent to each replica and not yet finished (all routers).",
            ),
            Panel(
                "Running and waiting per replica (vLLM)",
                (
                    Query("sum by (replica) (vllm:num_requests_running)", "running {{replica}}"),
                    Query("sum by (replica) (vllm:num_requests_waiting)", "waiting {{replica}}"),
                ),
            ),
            Panel(
                "Routing decisions/s per replica",
                (Query(f"sum by (replica) (rate(dpserve_routing_decisions_total{RATE}))", "{{replica}}"),),
                unit="reqps",
            ),
            Panel(
                "KV-cache usage per replica",
                (Query("sum by (replica) (vllm:kv_cache_usage_perc)", "{{replica}}"),),
                unit="percentunit",
            ),
            Panel(
                "Prefix-cache hit rate",
                (
                    Query(
                        f"sum by (replica) (rate(vllm:prefix_cache_hits_total{RATE}))"
                        f" / sum by (replica) (rate(vllm:prefix_cache_queries_total{RATE}))",
                        "{{replica}}",
                    ),
                    Query(
                        f"sum(rate(vllm:prefix_cache_hits_total{RATE}))"
                        f" / sum(rate(vllm:prefix_cache_queries_total{RATE}))",
                        "all replicas",
                    ),
                ),
                unit="percentunit",
                description="Prompt tokens found in the prefix cache over prompt tokens looked up (vLLM's counters).",
            ),
            Panel(
                "Time to first token per replica (vLLM)",
                _quantiles("vllm:time_to_first_token_seconds", "", by="replica")[:2],
                unit="s",
            ),
            Panel(
                "Generated tokens/s per replica",
                (Query(f"sum by (replica) (rate(vllm:generation_tokens_total{RATE}))", "{{replica}}"),),
            ),
        ),
    ),
    (
        "GPUs (NVML, sampled by the router)",
        (
            Panel(
                "GPU utilization",
                (Query(f"max by ({GPU_SERIES}) (dpserve_gpu_utilization_ratio)", "GPU {{gpu}} {{replica}}"),),
                unit="percentunit",
            ),
            Panel(
                "GPU memory used",
                (Query(f"max by ({GPU_SERIES}) (dpserve_gpu_memory_used_bytes)", "GPU {{gpu}} {{replica}}"),),
                unit="bytes",
            ),
            Panel(
                "GPU power",
                (Query(f"max by ({GPU_SERIES}) (dpserve_gpu_power_watts)", "GPU {{gpu}} {{replica}}"),),
                unit="watt",
            ),
            Panel(
                "GPU temperature",
                (Query(f"max by ({GPU_SERIES}) (dpserve_gpu_temperature_celsius)", "GPU {{gpu}} {{replica}}"),),
                unit="celsius",
            ),
        ),
    ),
)


def _panel_json(panel: Panel, panel_id: int, x: int, y: int, width: int) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": width, "h": 8},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}} if panel.kind == "timeseries" else {},
        "targets": [
            {"refId": chr(ord("A") + index), "datasource": DATASOURCE, "expr": query.expr, "legendFormat": query.legend}
            for index, query in enumerate(panel.queries)
        ],
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    for title, row in ROWS:
        panels.append(
            {
                "id": len(panels) + 1,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
                "panels": [],
            }
        )
        y += 1
        for index, panel in enumerate(row):
            x = (index % 4) * 6
            if index and index % 4 == 0:
                y += 8
            panels.append(_panel_json(panel, len(panels) + 1, x, y, 6))
        y += 8
    return {
        "uid": "dpserve",
        "title": "dpserve",
        "tags": ["dpserve", "vllm"],
        "timezone": "browser",
        "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "schemaVersion": 39,
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def metric_names(document: dict[str, Any]) -> set[str]:
    """The dpserve_* and vllm:* series the dashboard's queries read."""
    names: set[str] = set()
    for panel in document["panels"]:
        for target in panel.get("targets", ()):
            names.update(re.findall(r"\b(?:dpserve_|vllm:)[a-zA-Z0-9_:]+", target["expr"]))
    return names


if __name__ == "__main__":
    sys.stdout.write(render())
