"""The Grafana dashboard the `monitoring` profile provisions: monitoring/grafana/dashboards/dpserve.json.

Panels read the router's `dpserve_*` series and the replicas' own `vllm:*` series (labelled `replica`
by Prometheus, as the router labels them), from the Prometheus the `datasource` variable picks (the one the
compose stack provisions by default), for the models and replicas the `model` and `replica` variables pick
(all by default). Regenerate with `python -m dpserve.deploy.grafana`.

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
PROVISIONED_UID = "prometheus"
"""The uid of the datasource the compose stack provisions: the `datasource` variable's default."""
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
REPLICA = 'replica=~"$replica"'
MODEL = 'model=~"$model"'
RATE = "[$__rate_interval]"
EVENT_SERIES = frozenset(
    {"dpserve_scale_startup_seconds", "dpserve_scale_changes_total", "dpserve_scale_slo_attainment_ratio"}
)
"""Series a router exports only once something happened: a replica started on its signal, the desired count
changed, a request with an SLO came to a router whose policy reads SLOs. A fixed fleet may never have them."""
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
                "Healthy replicas",
                (Query(f"sum(max by (replica) (dpserve_replica_healthy{{{REPLICA}}}))", "healthy"),),
                kind="stat",
            ),
            Panel(
                "Requests/s by status",
                (Query(f"sum by (status) (rate(dpserve_requests_total{{{MODEL},{REPLICA}}}{RATE}))", "{{status}}"),),
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
            Panel(
                "Queue wait (admission)",
                _quantiles("dpserve_queue_wait_seconds", ""),
                unit="s",
                description="How long requests waited in the router's queue for a replica with room (0: none).",
            ),
            Panel(
                "Refused by the router/s, by status",
                (
                    Query(
                        f'sum by (status) (rate(dpserve_requests_total{{{MODEL},replica="none"}}{RATE}))',
                        "{{status}}",
                    ),
                ),
                unit="reqps",
                description="Answered by the router itself: 429 (queue full or timed out, quota), 503 (no replica), "
                "4xx for bad requests.",
            ),
            Panel(
                "Tokens/s per tenant",
                (Query(f"sum by (tenant) (rate(dpserve_tenant_tokens_total{RATE}))", "{{tenant}}"),),
                description="Prompt and completion tokens of each tenant's answered requests (all routers).",
            ),
            Panel(
                "SLO goodput and attainment, by tenant",
                (
                    Query(
                        f'sum by (tenant) (rate(dpserve_slo_requests_total{{{MODEL},outcome="met"}}{RATE}))',
                        "met/s {{tenant}}",
                    ),
                    Query(
                        f'sum by (tenant) (rate(dpserve_slo_requests_total{{{MODEL},outcome="met"}}{RATE}))'
                        f" / sum by (tenant) (rate(dpserve_slo_requests_total{{{MODEL}}}{RATE}))",
                        "attainment {{tenant}}",
                    ),
                ),
                description="Requests with an SLO (x-slo-ttft-ms, x-slo-tpot-ms, or the tenant's) that met it per "
                "second (goodput), and the share that did; refused ones count as not met.",
            ),
            Panel(
                "TTFT prediction error per replica (predicted - realized)",
                tuple(
                    Query(
                        f"histogram_quantile({q}, sum by (le, replica) "
                        f"(rate(dpserve_ttft_prediction_error_seconds_bucket{{{REPLICA}}}{RATE})))",
                        f"p{round(q * 100)} {{{{replica}}}}",
                    )
                    for q in (0.1, 0.5, 0.9)
                ),
                unit="s",
                description="How far the slo policy's predicted time to first token was from each stream's own "
                "(above 0: predicted too long).",
            ),
            Panel(
                "Routing decisions/s by reason",
                (Query(f"sum by (reason) (rate(dpserve_routing_decision_reasons_total{RATE}))", "{{reason}}"),),
                unit="reqps",
                description="Why the policy chose as it did: cache_hit, no_match, balance, ...",
            ),
        ),
    ),
    (
        "Replicas",
        (
            Panel(
                "In flight per replica (router)",
                (Query(f"sum by (replica) (dpserve_replica_in_flight_requests{{{REPLICA}}})", "{{replica}}"),),
                description="Requests the routers have sent to each replica and not yet finished (all routers).",
            ),
            Panel(
                "Running and waiting per replica (vLLM)",
                (
                    Query(f"sum by (replica) (vllm:num_requests_running{{{REPLICA}}})", "running {{replica}}"),
                    Query(f"sum by (replica) (vllm:num_requests_waiting{{{REPLICA}}})", "waiting {{replica}}"),
                ),
            ),
            Panel(
                "Routing decisions/s per replica",
                (Query(f"sum by (replica) (rate(dpserve_routing_decisions_total{{{REPLICA}}}{RATE}))", "{{replica}}"),),
                unit="reqps",
            ),
            Panel(
                "KV-cache usage per replica",
                (Query(f"sum by (replica) (vllm:kv_cache_usage_perc{{{REPLICA}}})", "{{replica}}"),),
                unit="percentunit",
            ),
            Panel(
                "Prefix-cache hit rate",
                (
                    Query(
                        f"sum by (replica) (rate(vllm:prefix_cache_hits_total{{{REPLICA}}}{RATE}))"
                        f" / sum by (replica) (rate(vllm:prefix_cache_queries_total{{{REPLICA}}}{RATE}))",
                        "{{replica}}",
                    ),
                    Query(
                        f"sum(rate(vllm:prefix_cache_hits_total{{{REPLICA}}}{RATE}))"
                        f" / sum(rate(vllm:prefix_cache_queries_total{{{REPLICA}}}{RATE}))",
                        "the replicas shown",
                    ),
                ),
                unit="percentunit",
                description="Prompt tokens found in the prefix cache over prompt tokens looked up (vLLM's counters).",
            ),
            Panel(
                "Time to first token per replica (vLLM)",
                _quantiles("vllm:time_to_first_token_seconds", f"{{{REPLICA}}}", by="replica")[:2],
                unit="s",
            ),
            Panel(
                "Generated tokens/s per replica",
                (Query(f"sum by (replica) (rate(vllm:generation_tokens_total{{{REPLICA}}}{RATE}))", "{{replica}}"),),
            ),
        ),
    ),
    (
        "Elastic replicas",
        (
            Panel(
                "Replicas by state",
                (Query(f"sum by (state) (max by (model, state) (dpserve_scale_replicas{{{MODEL}}}))", "{{state}}"),),
                description="The models' replicas as the routers see them: ready, starting, draining.",
            ),
            Panel(
                "Desired vs ready replicas",
                (
                    Query(f"max by (model) (dpserve_desired_replicas{{{MODEL}}})", "desired {{model}}"),
                    Query(f'max by (model) (dpserve_scale_replicas{{{MODEL},state="ready"}})', "ready {{model}}"),
                ),
                description="What the load needs (the most any router asks for: what KEDA or an HPA scales to, "
                "and dpserve up), beside what serves.",
            ),
            Panel(
                "Desired-count changes, by direction",
                (
                    Query(
                        f"sum by (direction) (max by (model, direction) "
                        f"(increase(dpserve_scale_changes_total{{{MODEL}}}{RATE})))",
                        "{{direction}}",
                    ),
                ),
                description="Ups and downs of the desired count (the busiest router's): frequent ones are flapping.",
            ),
            Panel(
                "Replica start-up",
                (Query(f"max by (model) (dpserve_scale_startup_seconds{{{MODEL}}})", "{{model}}"),),
                unit="s",
                description="From the signal asking for a replica to its serving (median of the last 5): how far "
                "ahead a rising load is met, and at least half the scale-down delay.",
            ),
            Panel(
                "Load vs capacity (requests)",
                (
                    Query(f"max by (model) (dpserve_scale_load_requests{{{MODEL}}})", "load {{model}}"),
                    Query(
                        f"max by (model) (dpserve_scale_capacity_requests{{{MODEL}}})"
                        f' * on (model) max by (model) (dpserve_scale_replicas{{{MODEL},state="ready"}})',
                        "capacity {{model}}",
                    ),
                ),
                description="Requests running or waiting on the replicas (every client's), against what the ready "
                "replicas run at once as measured (one replica's capacity times the ready ones).",
            ),
            Panel(
                "Queued in the routers",
                (Query(f"sum by (model) (dpserve_scale_queue_depth{{{MODEL}}})", "{{model}}"),),
                description="Requests waiting in the routers (for room, or for a replica to start), all routers.",
            ),
            Panel(
                "Oldest queued request's wait",
                (Query(f"max by (model) (dpserve_scale_queue_wait_seconds{{{MODEL}}})", "{{model}}"),),
                unit="s",
                description="A long wait asks for one more replica, whatever the capacity says.",
            ),
            Panel(
                "KV-cache usage and SLO attainment (scale inputs)",
                (
                    Query(f"max by (model) (dpserve_scale_kv_usage_ratio{{{MODEL}}})", "KV usage {{model}}"),
                    Query(f"min by (model) (dpserve_scale_slo_attainment_ratio{{{MODEL}}})", "SLO met {{model}}"),
                ),
                unit="percentunit",
                description="Mean KV-cache usage of the ready replicas (the highest router's view), and the share "
                "of requests with an SLO that met it over the last minute (the lowest): either asks for one more "
                "replica past its bound.",
            ),
        ),
    ),
    (
        "GPUs (NVML, sampled by the router)",
        tuple(
            Panel(
                title, (Query(f"max by ({GPU_SERIES}) ({metric}{{{REPLICA}}})", "GPU {{gpu}} {{replica}}"),), unit=unit
            )
            for title, metric, unit in (
                ("GPU utilization", "dpserve_gpu_utilization_ratio", "percentunit"),
                ("GPU memory used", "dpserve_gpu_memory_used_bytes", "bytes"),
                ("GPU power", "dpserve_gpu_power_watts", "watt"),
                ("GPU temperature", "dpserve_gpu_temperature_celsius", "celsius"),
            )
        ),
    ),
)


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    """A multi-value variable of a label's values, `All` by default (which matches every value, empty too)."""
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def templating() -> dict[str, Any]:
    """The dashboard's variables: which Prometheus, which models, which replicas."""
    return {
        "list": [
            {
                "name": "datasource",
                "label": "Prometheus",
                "type": "datasource",
                "query": "prometheus",
                "current": {"selected": True, "text": PROVISIONED_UID, "value": PROVISIONED_UID},
            },
            _variable("model", "Model", "label_values(dpserve_requests_total, model)"),
            _variable("replica", "Replica", "label_values(dpserve_replica_healthy, replica)"),
        ]
    }


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
        "templating": templating(),
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
