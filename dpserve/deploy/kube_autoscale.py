"""`dpserve kube --autoscale A:B`: the vLLM StatefulSet between A and B pods, as the routers' signal says.

Each router exports `dpserve_desired_replicas{model}`: the replicas the model's load needs, with hysteresis
and a cool-down applied inside the router (dpserve/router/scale/signal.py). The autoscaler scales the
StatefulSet to the largest any router asks for, directly: its own smoothing is kept short, so a scale-down
waits for the router's cool-down and hardly more.

- `--autoscaler keda` (the default): a KEDA ScaledObject with a `prometheus` trigger. KEDA scales from zero
  (activation above 0) and back to zero, and makes its own HorizontalPodAutoscaler from 1 up.
- `--autoscaler hpa`: a plain autoscaling/v2 HorizontalPodAutoscaler on the External metric
  `dpserve_desired_replicas`, which an external-metrics adapter (prometheus-adapter) serves from Prometheus
  (docs/deploy.md has its rule). One pod at least: an HPA scales to zero only with the HPAScaleToZero feature
  gate (alpha, off by default).

Only one of them is written: KEDA's own HPA and a second one would fight over the same StatefulSet.
"""

from __future__ import annotations

import json
from typing import Any

from dpserve.deploy.kube_options import LABEL_VALUE, VLLM_NAME, KubeOptions, metadata

KEDA_API_VERSION = "keda.sh/v1alpha1"
DESIRED_METRIC = "dpserve_desired_replicas"
POLLING_INTERVAL_S = 15
"""As often as the ServiceMonitor scrapes the routers: KEDA polling faster would read the same value."""
SCALE_DOWN_WINDOW_S = 30
"""The autoscaler's own hold before a scale-down (and KEDA's before scaling to zero): short, as the router's
cool-down (--scale-down-delay, never less than twice a replica's measured start-up) already held it. This only
rides over a missed scrape or a router restarting (two scrapes)."""
FALLBACK_FAILURES = 3
"""Prometheus unanswered this many polls in a row (45 s): KEDA holds what runs (its fallback)."""
COLD_START_FLAG = "--cold-start-wait"
COLD_START_WAIT_S = 300
"""With no replica running (`--autoscale 0:B`), the routers hold a request this long for the first one: the
signal reaches KEDA within about 30 s (a scrape, a poll), and a vLLM pod on a node with the image starts in 1 to
3 minutes with the weights in --model-cache-pvc. Under the OpenAI SDK's 10-minute default timeout, so a
client waits rather than retries."""
TOLERANCE = "0"
"""The HPA acts on any difference: the metric is a count, and its default 10% would ignore one replica more or
fewer from 10 replicas up. Kubernetes 1.33 takes it behind the HPAConfigurableTolerance gate (dropped
without it), 1.34 by default."""


def desired_query(options: KubeOptions) -> str:
    """The most replicas any router of this namespace asks for the served model. No `job` matcher: the
    ServiceMonitor's (the Service's name) and the common annotation-scraping job's differ, and the max is the
    same if both scrape the routers; the namespace label both give, and only the routers export the series."""
    selector = f"namespace={json.dumps(options.namespace)},model={json.dumps(options.served_model)}"
    return f"max({DESIRED_METRIC}{{{selector}}})"


def _target() -> dict[str, str]:
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": VLLM_NAME}


def hpa_behavior(options: KubeOptions) -> dict[str, Any]:
    """Up at once to what the routers ask for (all the way in one step); down after SCALE_DOWN_WINDOW_S, as
    many as asked. The smoothing is the router's: a second one here would only delay it."""
    at_once = [{"type": "Pods", "value": options.replicas, "periodSeconds": POLLING_INTERVAL_S}]
    return {
        "scaleUp": {"stabilizationWindowSeconds": 0, "tolerance": TOLERANCE, "policies": at_once},
        "scaleDown": {
            "stabilizationWindowSeconds": SCALE_DOWN_WINDOW_S,
            "tolerance": TOLERANCE,
            "policies": [{"type": "Percent", "value": 100, "periodSeconds": POLLING_INTERVAL_S}],
        },
    }


def _floor(options: KubeOptions) -> int:
    """The fewest pods an HPA keeps (KEDA's own HPA too): one, unless more are asked for."""
    return max(options.autoscale_min or 0, 1)


def scaled_object(options: KubeOptions) -> dict[str, Any]:
    trigger = {
        "type": "prometheus",
        # The metric over the pods it scales, against 1: the HPA's count is the metric itself.
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": options.prometheus_address,
            "query": desired_query(options),
            "threshold": "1",
            # From zero as soon as a router asks for one (a request waits: --cold-start-wait).
            "activationThreshold": "0",
            # No router says anything of the model (none has seen it, or it is idle and forgotten): none is
            # needed. KEDA's default, spelled out.
            "ignoreNullValues": "true",
        },
    }
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": "ScaledObject",
        "metadata": metadata(options, VLLM_NAME, VLLM_NAME),
        "spec": {
            "scaleTargetRef": _target(),
            "pollingInterval": POLLING_INTERVAL_S,
            "cooldownPeriod": SCALE_DOWN_WINDOW_S,
            "minReplicaCount": options.autoscale_min,
            "maxReplicaCount": options.replicas,
            # Prometheus down: what runs stays (never below one), so requests keep an answer while the signal
            # is blind; a serving pod is never taken away for want of a reading.
            "fallback": {
                "failureThreshold": FALLBACK_FAILURES,
                "replicas": _floor(options),
                "behavior": "currentReplicasIfHigher",
            },
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": hpa_behavior(options)}},
            "triggers": [trigger],
        },
    }


def horizontal_pod_autoscaler(options: KubeOptions) -> dict[str, Any]:
    metric: dict[str, Any] = {"name": DESIRED_METRIC}
    model = options.served_model
    # A label selector's value cannot hold '/' (Qwen/Qwen2.5-7B-Instruct): then the namespace alone, which
    # the adapter's rule scopes by, picks the series (one dpserve kube, so one model, per namespace).
    if LABEL_VALUE.fullmatch(model):
        metric["selector"] = {"matchLabels": {"model": model}}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(options, VLLM_NAME, VLLM_NAME),
        "spec": {
            "scaleTargetRef": _target(),
            # Not 0: a plain HPA cannot scale to zero without the HPAScaleToZero feature gate.
            "minReplicas": _floor(options),
            "maxReplicas": options.replicas,
            "metrics": [
                {
                    "type": "External",
                    "external": {"metric": metric, "target": {"type": "AverageValue", "averageValue": "1"}},
                }
            ],
            "behavior": hpa_behavior(options),
        },
    }


def autoscaler_documents(options: KubeOptions) -> list[dict[str, Any]]:
    """The ScaledObject or the HPA: never both."""
    if not options.autoscaled:
        return []
    return [scaled_object(options) if options.autoscaler == "keda" else horizontal_pod_autoscaler(options)]


def cold_start_flags(options: KubeOptions) -> list[str]:
    """The routers' flags when no replica may be running: a request waits for the first to start."""
    return [COLD_START_FLAG, str(COLD_START_WAIT_S)] if options.scales_to_zero else []


def autoscale_header(options: KubeOptions) -> str:
    """What the cluster needs for the autoscaler, in the file's header."""
    if not options.autoscaled:
        return ""
    low, high = options.autoscale_min, options.replicas
    if options.autoscaler == "keda":
        text = (
            f"Autoscaling {low} to {high} vLLM pods with KEDA (install it first: its CRDs), which reads "
            f"{DESIRED_METRIC} from\n{options.prometheus_address} (--prometheus-url)"
        )
    else:
        text = (
            f"Autoscaling {_floor(options)} to {high} vLLM pods with an HPA: an external-metrics adapter "
            f"(prometheus-adapter) must serve\n{DESIRED_METRIC} (docs/deploy.md has its rule)"
        )
        text += "; a plain HPA keeps one pod at least" if low == 0 else ""
    text += ".\n"
    if not options.service_monitor:
        text += "Prometheus must scrape the routers, with their namespace label: pass --service-monitor (or a job\n"
        text += "of your own, docs/deploy.md).\n"
    if options.scales_to_zero:
        text += f"No pod while idle: the first request waits up to {COLD_START_WAIT_S} s ({COLD_START_FLAG}).\n"
    return text
