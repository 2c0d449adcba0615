"""`dpserve kube --autoscale A:B`: a KEDA ScaledObject (or, with `--autoscaler hpa`, an HPA) scaling the vLLM
StatefulSet to the routers' `dpserve_desired_replicas`. The ScaledObject is checked against KEDA's own CRD
schema (vendored in tests/data/keda), the HPA and everything else against Kubernetes' (kubernetes-validate);
and for what no schema says: one autoscaler only, the StatefulSet's count left to it, the query naming the
series the routers export under the labels Prometheus gives them, stops that drain, and a first request that
waits for the first replica when none runs."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from dpserve.cli import build_parser, main
from dpserve.config import RouterSettings
from dpserve.deploy import grafana, kube_command, kube_options
from dpserve.deploy.kube import KubeOptions, render
from dpserve.deploy.kube_autoscale import (
    COLD_START_FLAG,
    COLD_START_WAIT_S,
    DESIRED_METRIC,
    POLLING_INTERVAL_S,
    SCALE_DOWN_WINDOW_S,
)
from tests.unit.test_kube import KUBERNETES_VERSIONS, documents, only, router_and_agent
from tests.unit.test_kube_tls import error_line, flag, vllm_container, written

ROOT = Path(__file__).resolve().parents[2]
KEDA_CRD = ROOT / "tests" / "data" / "keda" / "keda.sh_scaledobjects.yaml"
KEDA_CRD_SHA256 = "af35555862a83933b074af14ad439c4b4ceabaf4daa3e9338e9b23e36d308d80"
"""`git show v2.20.2:config/crd/bases/keda.sh_scaledobjects.yaml | sha256sum` in kedacore/keda (tests/data/keda)."""
CORE_KINDS_SKIPPED = ("keda.sh/",)
"""Not in Kubernetes' OpenAPI document: checked against KEDA's CRD instead."""
SCALE_SERIES = {
    "dpserve_desired_replicas",
    "dpserve_scale_replicas",
    "dpserve_scale_queue_depth",
    "dpserve_scale_queue_wait_seconds",
    "dpserve_scale_load_requests",
    "dpserve_scale_capacity_requests",
    "dpserve_scale_kv_usage_ratio",
    "dpserve_scale_slo_attainment_ratio",
    "dpserve_scale_startup_seconds",
    "dpserve_scale_changes_total",
}
"""What each router exports for its scale signal, per model: the dashboard's Elastic replicas row reads them."""


def autoscaled(low: int, high: int, **given: Any) -> KubeOptions:
    return KubeOptions(replicas=high, autoscale_min=low, **given)


def scaled_object(options: KubeOptions) -> dict[str, Any]:
    (found,) = only(documents(options), "ScaledObject")
    return found


def hpa(options: KubeOptions) -> dict[str, Any]:
    (found,) = only(documents(options), "HorizontalPodAutoscaler")
    return found


def router_command(docs: list[dict[str, Any]]) -> list[str]:
    deployment, _ = router_and_agent(docs)
    command: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    return command


# (a) KEDA's schema, vendored


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with no field it does not name (as `kubectl apply`'s strict field validation refuses them),
    but where it says any field goes (`metadata`, a free map, x-kubernetes-preserve-unknown-fields)."""
    schema = dict(schema)
    if "properties" in schema and "additionalProperties" not in schema:
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    for key in ("properties",):
        if key in schema:
            schema[key] = {name: _strict(child) for name, child in schema[key].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            schema[key] = _strict(schema[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            schema[key] = [_strict(child) for child in schema[key]]
    return schema


@pytest.fixture(scope="module")
def keda_validator() -> jsonschema.protocols.Validator:
    crd = yaml.safe_load(KEDA_CRD.read_text())
    assert (crd["spec"]["group"], crd["spec"]["names"]["kind"]) == ("keda.sh", "ScaledObject")
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


def keda_errors(validator: jsonschema.protocols.Validator, document: dict[str, Any]) -> list[str]:
    """The schema's errors, and its CEL rule (which jsonschema cannot run): min <= max."""
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]
    spec = document.get("spec", {})
    low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    if isinstance(low, int) and isinstance(high, int) and low > high:
        errors.append("spec: minReplicaCount must be less than or equal to maxReplicaCount")
    assert document.get("apiVersion") == "keda.sh/v1alpha1" and document.get("kind") == "ScaledObject"
    return errors


def test_the_vendored_keda_crd_is_the_released_one() -> None:
    assert hashlib.sha256(KEDA_CRD.read_bytes()).hexdigest() == KEDA_CRD_SHA256
    readme = (KEDA_CRD.parent / "README.md").read_text()
    assert KEDA_CRD_SHA256 in readme and "v2.20.2" in readme


@pytest.mark.parametrize("low", [0, 1, 3])
@pytest.mark.parametrize("url", [None, "https://prometheus.example:9443/prom"])
def test_the_scaled_object_validates_against_kedas_schema(
    low: int, url: str | None, keda_validator: jsonschema.protocols.Validator
) -> None:
    document = scaled_object(autoscaled(low, 8, prometheus_url=url, service_monitor=True))
    assert keda_errors(keda_validator, document) == []


@pytest.mark.parametrize(
    "path, value",
    [
        (("spec", "minReplicas"), 0),  # misspelt: KEDA's is minReplicaCount
        (("spec", "maxReplicaCount"), "8"),  # a string for an integer
        (("spec", "minReplicaCount"), 9),  # above the most (the CRD's CEL rule)
        (("spec", "triggers"), []),  # none
        (("spec", "fallback", "behavior"), "hold"),  # not one of the enum
        (("spec", "advanced", "horizontalPodAutoscalerConfig", "behavior", "scaleUp", "window"), 0),
    ],
)
def test_the_keda_schema_check_rejects_a_broken_scaled_object(
    path: tuple[str, ...], value: Any, keda_validator: jsonschema.protocols.Validator
) -> None:
    """The check above can fail: each of these is refused."""
    broken = copy.deepcopy(scaled_object(autoscaled(0, 8)))
    *parents, last = path
    node = broken
    for key in parents:
        node = node[key]
    node[last] = value
    assert keda_errors(keda_validator, broken) != []


def test_a_trigger_metadata_value_must_be_a_string(keda_validator: jsonschema.protocols.Validator) -> None:
    broken = copy.deepcopy(scaled_object(autoscaled(0, 8)))
    broken["spec"]["triggers"][0]["metadata"]["threshold"] = 1
    assert keda_errors(keda_validator, broken) != []


# (b) Kubernetes' schemas: the HPA, and everything else with autoscaling


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("autoscaler", ["keda", "hpa"])
@pytest.mark.parametrize("tls", [False, True])
def test_every_other_document_validates_against_the_kubernetes_schema(version: str, autoscaler: str, tls: bool) -> None:
    options = autoscaled(0, 4, autoscaler=autoscaler, tls=tls)
    kinds = set()
    for doc in documents(options):
        kinds.add(doc["kind"])
        if doc["apiVersion"].startswith(CORE_KINDS_SKIPPED):
            continue
        kubernetes_validate.validate(doc, version, strict=True)
    assert ("HorizontalPodAutoscaler" in kinds) == (autoscaler == "hpa")
    assert ("ScaledObject" in kinds) == (autoscaler == "keda")


def test_the_schema_check_rejects_a_broken_hpa() -> None:
    document = hpa(autoscaled(1, 4, autoscaler="hpa"))
    misspelt = copy.deepcopy(document)
    misspelt["spec"]["metrics"][0]["external"]["metrics"] = misspelt["spec"]["metrics"][0]["external"].pop("metric")
    mistyped = copy.deepcopy(document)
    mistyped["spec"]["maxReplicas"] = "four"
    for broken in (misspelt, mistyped):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


# (c) What the autoscaler does


@pytest.mark.parametrize("autoscaler", ["keda", "hpa"])
def test_one_autoscaler_targets_the_statefulset_which_leaves_its_count_to_it(autoscaler: str) -> None:
    docs = documents(autoscaled(1, 6, autoscaler=autoscaler))
    (statefulset,) = only(docs, "StatefulSet")
    # No count in the manifest: `kubectl apply` would set it back every time, fighting the autoscaler.
    assert "replicas" not in statefulset["spec"]
    scalers = only(docs, "ScaledObject") + only(docs, "HorizontalPodAutoscaler")
    assert len(scalers) == 1, "KEDA makes its own HPA: a second one would fight it"
    (scaler,) = scalers
    target = scaler["spec"]["scaleTargetRef"]
    assert target == {"apiVersion": statefulset["apiVersion"], "kind": "StatefulSet", "name": "vllm"}
    assert target["name"] == statefulset["metadata"]["name"]
    assert scaler["metadata"]["namespace"] == statefulset["metadata"]["namespace"]
    spec = scaler["spec"]
    low, high = (
        (spec["minReplicaCount"], spec["maxReplicaCount"])
        if autoscaler == "keda"
        else (
            spec["minReplicas"],
            spec["maxReplicas"],
        )
    )
    assert (low, high) == (1, 6)


def test_without_autoscale_the_count_is_fixed_and_nothing_scales_it() -> None:
    docs = documents(KubeOptions(replicas=3))
    (statefulset,) = only(docs, "StatefulSet")
    assert statefulset["spec"]["replicas"] == 3
    assert only(docs, "ScaledObject") == only(docs, "HorizontalPodAutoscaler") == []
    assert COLD_START_FLAG not in router_command(docs)


def _selector(query: str) -> tuple[str, dict[str, str]]:
    """`max(NAME{a="x",b="y"})`: the series' name and its equality matchers."""
    found = re.fullmatch(r"max\((\w+)\{(.*)\}\)", query)
    assert found, query
    pairs = re.findall(r'(\w+)=("(?:[^"\\]|\\.)*")(?:,|$)', found[2])
    assert ",".join(f"{k}={v}" for k, v in pairs) == found[2], "only equality matchers"
    return found[1], {key: json.loads(value) for key, value in pairs}


@pytest.mark.parametrize("namespace", ["dpserve", "inference-prod"])
def test_keda_scales_to_the_most_any_router_of_the_namespace_asks_for_the_model(namespace: str) -> None:
    options = autoscaled(0, 8, namespace=namespace, service_monitor=True)
    docs = documents(options)
    (scaler,) = only(docs, "ScaledObject")
    (trigger,) = scaler["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    metadata = trigger["metadata"]
    # The metric over the pods, against 1: the count is the metric. Active (from zero) above 0.
    assert (metadata["threshold"], metadata["activationThreshold"]) == ("1", "0")
    name, matchers = _selector(metadata["query"])
    assert name == DESIRED_METRIC == "dpserve_desired_replicas"
    assert matchers == {"namespace": namespace, "model": options.model}
    # The routers' ServiceMonitor scrapes them in that namespace: Prometheus labels the series with it.
    monitors = {m["metadata"]["name"]: m for m in only(docs, "ServiceMonitor")}
    assert monitors["dpserve-router"]["spec"]["namespaceSelector"] == {"matchNames": [namespace]}
    # The default Prometheus: the operator's Service, in the namespace its NetworkPolicies name.
    assert metadata["serverAddress"] == "http://prometheus-operated.monitoring.svc.cluster.local:9090"
    assert scaler["spec"]["pollingInterval"] <= 15


def test_the_query_names_the_served_model_and_the_given_prometheus() -> None:
    options = autoscaled(
        0, 2, vllm_args=("--served-model-name", 'q "7b"', "alias"), prometheus_url="http://prom.obs:9090"
    )
    metadata = scaled_object(options)["spec"]["triggers"][0]["metadata"]
    assert _selector(metadata["query"])[1]["model"] == 'q "7b"'
    assert metadata["serverAddress"] == "http://prom.obs:9090"
    assert options.served_model == 'q "7b"'
    assert dataclasses.replace(options, vllm_args=("--served-model-name=qwen",)).served_model == "qwen"
    other_namespace = autoscaled(0, 2, prometheus_namespace="obs")
    address = scaled_object(other_namespace)["spec"]["triggers"][0]["metadata"]["serverAddress"]
    assert address == "http://prometheus-operated.obs.svc.cluster.local:9090"


@pytest.mark.parametrize("autoscaler", ["keda", "hpa"])
def test_the_autoscalers_own_smoothing_is_short_the_routers_cool_down_does_it(autoscaler: str) -> None:
    options = autoscaled(0, 8, autoscaler=autoscaler)
    if autoscaler == "keda":
        spec = scaled_object(options)["spec"]
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert spec["cooldownPeriod"] == SCALE_DOWN_WINDOW_S  # to zero, as down
    else:
        behavior = hpa(options)["spec"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
    # Up to the routers' count in one step.
    assert behavior["scaleUp"]["policies"] == [{"type": "Pods", "value": 8, "periodSeconds": POLLING_INTERVAL_S}]
    # Down after two scrapes: far shorter than the HPA's default 300 s, and than the router's own delay.
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == SCALE_DOWN_WINDOW_S <= 2 * POLLING_INTERVAL_S
    assert {behavior[way]["tolerance"] for way in ("scaleUp", "scaleDown")} == {"0"}


def test_a_prometheus_outage_holds_what_runs() -> None:
    fallback = scaled_object(autoscaled(0, 8))["spec"]["fallback"]
    assert fallback["behavior"] == "currentReplicasIfHigher" and fallback["replicas"] == 1
    assert scaled_object(autoscaled(3, 8))["spec"]["fallback"]["replicas"] == 3


def test_the_hpa_reads_the_external_metric_and_keeps_one_pod_at_least(capsys: pytest.CaptureFixture[str]) -> None:
    docs = written(["kube", "--autoscale", "0:4", "--autoscaler", "hpa"], capsys)
    (scaler,) = only(docs, "HorizontalPodAutoscaler")
    spec = scaler["spec"]
    # A plain HPA scales to zero only behind the HPAScaleToZero feature gate: one at least.
    assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 4)
    (metric,) = spec["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    # Qwen/... holds a '/', which no label selector takes: the namespace (the adapter's rule) scopes it.
    assert metric["external"]["metric"] == {"name": DESIRED_METRIC}
    assert COLD_START_FLAG not in router_command(docs), "a pod always runs: no request waits for one"
    named = hpa(autoscaled(2, 4, autoscaler="hpa", vllm_args=("--served-model-name", "qwen-7b")))
    selector = named["spec"]["metrics"][0]["external"]["metric"]["selector"]
    assert selector == {"matchLabels": {"model": "qwen-7b"}}
    assert named["spec"]["minReplicas"] == 2


def test_from_zero_the_routers_hold_the_first_request_for_the_first_replica() -> None:
    command = router_command(documents(autoscaled(0, 4)))
    assert float(flag(command, COLD_START_FLAG)) == COLD_START_WAIT_S
    # Longer than the signal takes to reach KEDA (a scrape, a poll) and a vLLM pod's start, shorter than the
    # OpenAI SDK's 600 s default timeout, so a client waits rather than retries.
    assert 2 * POLLING_INTERVAL_S + 120 < COLD_START_WAIT_S < 600
    # The router's own parser takes the command; the flag is the router's (landing beside this change: until
    # it has, it is the one thing left unknown).
    args, unknown = build_parser().parse_known_args(command[1:])
    assert args.command == "router" and unknown in ([], [COLD_START_FLAG, str(COLD_START_WAIT_S)])
    assert COLD_START_FLAG not in router_command(documents(autoscaled(1, 4)))


def test_the_routers_signal_takes_the_pods_batch_limit_until_it_sees_one_full() -> None:
    told = router_command(documents(autoscaled(0, 4, vllm_args=("--max-num-seqs", "16"))))
    assert flag(told, "--replica-max-num-seqs") == "16"
    assert "--replica-max-num-seqs" not in router_command(documents(autoscaled(0, 4)))  # vLLM's default: unknown


@pytest.mark.parametrize("given", [None, 45])
def test_a_scaled_down_pod_drains_what_it_runs_and_the_budget_allows_none_left(given: int | None) -> None:
    docs = documents(autoscaled(0, 4, shutdown_timeout=given))
    container = vllm_container(docs)
    (statefulset,) = only(docs, "StatefulSet")
    spec = statefulset["spec"]["template"]["spec"]
    drain = int(flag(container["command"], "--shutdown-timeout"))
    # Scale-downs are routine: streams get 5 minutes unless told otherwise; the grace period covers the
    # preStop sleep (longer than the routers' DNS re-read: none sends the pod anything new), the drain and the
    # teardown, and stays under the cluster autoscaler's 10 minutes.
    assert drain == (kube_options.AUTOSCALE_SHUTDOWN_TIMEOUT_S if given is None else given)
    sleep = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert sleep > RouterSettings().discover_interval_s
    assert sleep + drain + 10 <= spec["terminationGracePeriodSeconds"] <= 600
    # A budget of maxUnavailable, never minAvailable: with none or one pod, a drain is not blocked.
    budgets = {b["metadata"]["name"]: b["spec"] for b in only(docs, "PodDisruptionBudget")}
    assert budgets["vllm"]["maxUnavailable"] == 1 and "minAvailable" not in budgets["vllm"]


def test_with_tls_the_routers_name_every_pod_the_autoscaler_may_start() -> None:
    command = router_command(documents(autoscaled(0, 3, tls=True)))
    replicas = [value for name, value in itertools.pairwise(command) if name == "--replica"]
    assert [spec.split("=", 1)[0] for spec in replicas] == ["vllm-0", "vllm-1", "vllm-2"]


# (d) The command line


def test_the_cli_writes_the_autoscaled_manifests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "k8s.yaml"
    assert main(["kube", "--autoscale", "0:4", "--service-monitor", "-o", str(path)]) == 0
    assert "0 to 4 replica(s)" in capsys.readouterr().err
    text = path.read_text()
    assert text == render(autoscaled(0, 4, service_monitor=True))
    assert text.startswith("# Generated by `dpserve kube --autoscale 0:4 --model ")
    assert "KEDA" in text.split("apiVersion", 1)[0] and "--cold-start-wait" in text.split("apiVersion", 1)[0]
    hpa_text = render(autoscaled(0, 4, autoscaler="hpa"))
    header = hpa_text.split("apiVersion", 1)[0]
    assert "--autoscale 0:4 --model" in header and "--autoscaler hpa" in header
    assert "prometheus-adapter" in header and "one pod at least" in header and "--service-monitor" in header


@pytest.mark.parametrize("bad", ["4:2", "0:0", "two", "3", "1:", ":4", "-1:4", "1.5:4"])
def test_a_bad_autoscale_range_is_refused_by_argparse(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["kube", f"--autoscale={bad}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--autoscale" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "argv, wanted",
    [
        (["--replicas", "2", "--autoscale", "0:4"], "not allowed with argument"),
        ([], "one of the arguments --replicas --autoscale is required"),
        (["--replicas", "2", "--autoscaler", "bogus"], "invalid choice"),
    ],
)
def test_replicas_or_autoscale_one_of_them(argv: list[str], wanted: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["kube", *argv])
    assert exited.value.code == 2
    assert wanted in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, wanted",
    [
        (["--replicas", "2", "--autoscaler", "hpa"], "--autoscaler hpa"),
        (["--replicas", "2", "--prometheus-url", "http://p:9090"], "--prometheus-url"),
        (["--autoscale", "0:2", "--autoscaler", "hpa", "--prometheus-url", "http://p:9090"], "--prometheus-url"),
        (["--autoscale", "0:2", "--prometheus-url", "prometheus:9090"], "--prometheus-url"),
    ],
)
def test_autoscaling_flags_out_of_place_are_refused_by_name(
    argv: list[str], wanted: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert wanted in error_line(["kube", *argv], capsys)


def test_the_light_parser_offers_the_autoscalers_the_options_take() -> None:
    assert kube_command.AUTOSCALERS == kube_options.AUTOSCALERS
    with pytest.raises(ValueError, match="--autoscale 3:2"):
        autoscaled(3, 2)
    with pytest.raises(ValueError, match="--replicas and --autoscale"):
        kube_command.kube_options(2, autoscale=(0, 4))


# (e) The dashboard


def test_the_dashboard_shows_the_signal_keda_reads_and_every_input() -> None:
    document = grafana.dashboard()
    rows = [panel for panel in document["panels"] if panel["type"] == "row"]
    assert "Elastic replicas" in [row["title"] for row in rows]
    start = document["panels"].index(next(row for row in rows if row["title"] == "Elastic replicas"))
    row = []
    for panel in document["panels"][start + 1 :]:
        if panel["type"] == "row":
            break
        row.append(panel)
    titles = {panel["title"] for panel in row}
    assert {"Replicas by state", "Desired vs ready replicas"} <= titles
    read = grafana.metric_names({"panels": row})
    assert read == SCALE_SERIES
    # Those a fixed fleet may never export (the integration test leaves them out) are the row's.
    assert grafana.EVENT_SERIES <= read
    assert _selector(scaled_object(autoscaled(0, 2))["spec"]["triggers"][0]["metadata"]["query"])[0] in read
    # Every panel follows the model variable.
    assert all('model=~"$model"' in t["expr"] for panel in row for t in panel["targets"])
