"""`dpserve kube` and the manifests it writes: checked against Kubernetes' own OpenAPI schemas
(kubernetes-validate bundles them; no cluster runs here), and for what the schemas cannot say: one GPU per
vLLM pod and none elsewhere, the router discovering the headless Service's pods, no key in the text, and
the pods' commands accepted by dpserve's own parser."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import ipaddress
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dpserve.cli import _overrides, build_parser, main
from dpserve.config import AgentSettings, RouterSettings, load_settings
from dpserve.deploy.kube import KubeOptions, render
from dpserve.replicas.discovery import parse_discovery_source
from dpserve.router.flow.access import load_keys
from dpserve.version import package_version
from tests.pod_security import violations

REPLICA_COUNTS = (1, 2, 8)
KUBERNETES_VERSIONS = ("1.33", "1.34")
CRD_GROUPS = ("monitoring.coreos.com/",)
"""Custom resources: no schema in Kubernetes' OpenAPI document."""
WORKLOADS = ("StatefulSet", "Deployment", "DaemonSet")
SECRET = "sk-test-secret-123"


def documents(options: KubeOptions) -> list[dict[str, Any]]:
    docs = [doc for doc in yaml.safe_load_all(render(options)) if doc is not None]
    assert all(isinstance(doc, dict) for doc in docs)
    return docs


def only(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """Each workload with its pod template's spec."""
    for doc in docs:
        if doc["kind"] in WORKLOADS:
            yield doc, doc["spec"]["template"]["spec"]


def containers(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for workload, spec in pod_specs(docs):
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            yield workload, container


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def template_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def headless_service_for(docs: list[dict[str, Any]], workload: dict[str, Any]) -> dict[str, Any]:
    found = [
        svc
        for svc in only(docs, "Service")
        if svc["spec"].get("clusterIP") == "None" and selects(svc["spec"]["selector"], template_labels(workload))
    ]
    assert len(found) == 1, f"one headless Service selecting {workload['metadata']['name']}'s pods"
    return found[0]


def gpu_quantity(resources: dict[str, Any], part: str, resource: str) -> int | None:
    value = resources.get(part, {}).get(resource)
    return None if value is None else int(str(value))


def router_and_agent(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    (deployment,) = only(docs, "Deployment")
    (daemonset,) = only(docs, "DaemonSet")
    return deployment, daemonset


def parse_pod_command(command: list[str]) -> Any:
    """A pod's `dpserve ...` command through dpserve's own parser, as `main` would parse it."""
    assert command[0] == "dpserve"
    return build_parser().parse_args(command[1:])


# (a) The Kubernetes schemas


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("replicas", REPLICA_COUNTS)
def test_every_document_validates_against_the_kubernetes_schema(replicas: int, version: str) -> None:
    # One router and one worker each, or `replicas` routers of `replicas` workers (the peers' Service too).
    options = KubeOptions(
        replicas=replicas,
        service_monitor=True,
        model_cache_pvc="models",
        router_replicas=replicas,
        router_workers=replicas,
    )
    validated = 0
    for doc in documents(options):
        if doc["apiVersion"].startswith(CRD_GROUPS):
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, version, strict=True)
            continue
        # strict: no field the schema does not know (a misspelt key would otherwise pass unnoticed).
        kubernetes_validate.validate(doc, version, strict=True)
        validated += 1
    assert validated >= (9 if options.router_replicas > 1 else 8)


def test_the_schema_check_rejects_a_broken_manifest() -> None:
    """The check above can fail: a misspelt field and a wrongly typed one are caught."""
    (statefulset,) = only(documents(KubeOptions(replicas=2)), "StatefulSet")
    misspelt = copy.deepcopy(statefulset)
    misspelt["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSIONS[0], strict=True)
    mistyped = copy.deepcopy(statefulset)
    mistyped["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(mistyped, KUBERNETES_VERSIONS[0], strict=True)


def test_every_object_but_the_namespaces_is_in_the_namespace_and_the_agents_in_their_own() -> None:
    docs = documents(KubeOptions(replicas=2, namespace="llm", service_monitor=True))
    ns, agent_ns = only(docs, "Namespace")
    assert (ns["metadata"]["name"], agent_ns["metadata"]["name"]) == ("llm", "llm-gpu-agent")
    assert docs[:2] == [ns, agent_ns], "the Namespaces first, so that `kubectl apply` creates them before the rest"
    placed = {(doc["kind"], doc["metadata"]["name"]): doc["metadata"]["namespace"] for doc in docs[2:]}
    agents = {key: namespace for key, namespace in placed.items() if key[1] == "dpserve-agent"}
    assert set(agents) == {("DaemonSet", "dpserve-agent"), ("Service", "dpserve-agent")} | {
        ("NetworkPolicy", "dpserve-agent"),
        ("ServiceMonitor", "dpserve-agent"),
    }
    assert set(agents.values()) == {"llm-gpu-agent"}
    assert {namespace for key, namespace in placed.items() if key not in agents} == {"llm"}


def test_every_mount_names_a_volume_of_its_pod_and_every_selector_its_pods() -> None:
    """What the schema cannot see: references inside a workload."""
    docs = documents(KubeOptions(replicas=2, model_cache_pvc="models"))
    for workload, spec in pod_specs(docs):
        volumes = {volume["name"] for volume in spec.get("volumes", [])}
        for container in spec["containers"]:
            assert {m["name"] for m in container.get("volumeMounts", [])} <= volumes
        assert selects(workload["spec"]["selector"]["matchLabels"], template_labels(workload))


# (b) GPUs


@pytest.mark.parametrize("gpu_resource", ["nvidia.com/gpu", "nvidia.com/mig-3g.40gb"])
@pytest.mark.parametrize("replicas", REPLICA_COUNTS)
def test_each_vllm_pod_takes_exactly_one_gpu_and_nothing_else_takes_any(replicas: int, gpu_resource: str) -> None:
    docs = documents(KubeOptions(replicas=replicas, gpu_resource=gpu_resource))
    (statefulset,) = only(docs, "StatefulSet")
    assert statefulset["spec"]["replicas"] == replicas
    assert statefulset["spec"]["podManagementPolicy"] == "Parallel"
    vllm = statefulset["spec"]["template"]["spec"]["containers"]
    assert len(vllm) == 1 and "initContainers" not in statefulset["spec"]["template"]["spec"]
    resources = vllm[0]["resources"]
    assert resources["limits"] == {gpu_resource: 1}
    assert gpu_quantity(resources, "requests", gpu_resource) == 1
    assert {"cpu", "memory"} <= set(resources["requests"])
    others = [(w, c) for w, c in containers(docs) if w is not statefulset]
    assert {w["kind"] for w, _ in others} == {"Deployment", "DaemonSet"}
    for workload, container in others:
        for part in ("requests", "limits"):
            asked = set(container.get("resources", {}).get(part, {}))
            gpus = {name for name in asked if name == gpu_resource or name.startswith("nvidia.com/")}
            assert not gpus, f"{workload['metadata']['name']} asks for {gpus} in {part}"


def test_vllm_pods_wait_half_an_hour_for_the_first_start_and_are_scraped() -> None:
    (statefulset,) = only(documents(KubeOptions(replicas=2)), "StatefulSet")
    pod = statefulset["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": port}
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 1800
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": port}
    annotations = pod["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]


def test_vllm_serves_the_model_with_kv_events_where_the_router_subscribes() -> None:
    docs = documents(KubeOptions(replicas=2, model="meta-llama/Llama-3.1-8B-Instruct"))
    (statefulset,) = only(docs, "StatefulSet")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    port = int(command[command.index("--port") + 1])
    assert command[command.index("--host") + 1] == "0.0.0.0"
    config = yaml.safe_load(command[command.index("--kv-events-config") + 1])  # JSON is YAML
    assert config["enable_kv_cache_events"] is True and config["publisher"] == "zmq"
    endpoint = re.fullmatch(r"tcp://\*:(\d+)", config["endpoint"])  # bound on every address of the pod
    assert endpoint is not None
    kv_port = int(endpoint.group(1))
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": port, "kv-events": kv_port}
    deployment, _ = router_and_agent(docs)
    args = parse_pod_command(deployment["spec"]["template"]["spec"]["containers"][0]["command"])
    settings = load_settings(RouterSettings, _overrides(args), env={})
    assert settings.discover_kv_port == kv_port
    assert (settings.routing_policy, settings.slo_inner_policy) == ("slo", "kv_aware")


@pytest.mark.parametrize("pvc", [None, "hf-models"])
def test_the_model_cache_is_the_given_claim_or_a_bounded_empty_dir(pvc: str | None) -> None:
    (statefulset,) = only(documents(KubeOptions(replicas=2, model_cache_pvc=pvc)), "StatefulSet")
    spec = statefulset["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    cache = volumes[mounts["/root/.cache/huggingface"]]
    if pvc:
        assert cache["persistentVolumeClaim"] == {"claimName": pvc}
    else:
        assert cache["emptyDir"] == {"sizeLimit": "100Gi"}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"]


# (c) Discovery through the headless Services


@pytest.mark.parametrize("namespace", ["dpserve", "inference-prod"])
def test_the_router_discovers_the_headless_service_of_the_vllm_pods(namespace: str) -> None:
    docs = documents(KubeOptions(replicas=4, namespace=namespace))
    (statefulset,) = only(docs, "StatefulSet")
    service = headless_service_for(docs, statefulset)
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"].get("publishNotReadyAddresses", False) is False
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    deployment, _ = router_and_agent(docs)
    args = parse_pod_command(deployment["spec"]["template"]["spec"]["containers"][0]["command"])
    (source,) = [parse_discovery_source(text) for text in args.discover]
    assert source.kind == "dns"
    assert source.name == f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert source.port == ports["http"]["port"] == ports["http"]["targetPort"]
    assert source.port in {p["containerPort"] for p in container["ports"]}
    assert args.discover_kv_port == ports["kv-events"]["port"]


@pytest.mark.parametrize("namespace", ["dpserve", "inference-prod"])
def test_several_routers_find_each_other_through_their_own_headless_service(namespace: str) -> None:
    docs = documents(KubeOptions(replicas=2, namespace=namespace, router_replicas=3))
    deployment, _ = router_and_agent(docs)
    service = headless_service_for(docs, deployment)
    assert service["metadata"]["name"] == "dpserve-router-peers"
    # A starting router (not ready yet) must find its peers, and be found, to fetch their state.
    assert service["spec"]["publishNotReadyAddresses"] is True
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = parse_pod_command(container["command"])
    (source,) = [parse_discovery_source(text) for text in args.discover_peers]
    assert source.kind == "dns"
    assert source.name == f"dpserve-router-peers.{namespace}.svc.cluster.local"
    (port,) = service["spec"]["ports"]
    assert source.port == port["port"] == port["targetPort"] == args.port
    assert source.port in {p["containerPort"] for p in container["ports"]}
    settings = load_settings(RouterSettings, _overrides(args), env={})
    assert settings.discover_peers == (f"dns:dpserve-router-peers.{namespace}.svc.cluster.local:{args.port}",)


def test_one_router_has_no_peers_to_find() -> None:
    docs = documents(KubeOptions(replicas=2, router_replicas=1))
    deployment, _ = router_and_agent(docs)
    args = parse_pod_command(deployment["spec"]["template"]["spec"]["containers"][0]["command"])
    assert args.discover_peers is None and args.peers is None
    assert "dpserve-router-peers" not in {s["metadata"]["name"] for s in only(docs, "Service")}


def test_the_peers_service_is_not_scraped_twice_by_the_service_monitor() -> None:
    docs = documents(KubeOptions(replicas=2, router_replicas=2, service_monitor=True))
    (monitor,) = [m for m in only(docs, "ServiceMonitor") if m["metadata"]["name"] == "dpserve-router"]
    selected = [
        s for s in only(docs, "Service") if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert [s["metadata"]["name"] for s in selected] == ["dpserve-router"]


@pytest.mark.parametrize("workers", [1, 4])
def test_router_workers_run_behind_the_pods_port_with_resources_to_match(workers: int) -> None:
    deployment, _ = router_and_agent(documents(KubeOptions(replicas=2, router_workers=workers)))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = parse_pod_command(container["command"])
    assert load_settings(RouterSettings, _overrides(args), env={}).workers == workers
    if workers == 1:
        assert args.workers is None  # the default is not written out
    resources = container["resources"]
    assert resources == {
        "requests": {"cpu": str(workers), "memory": f"{workers}Gi"},
        "limits": {"memory": f"{3 * workers}Gi"},
    }


def test_the_router_discovers_the_agents_headless_service() -> None:
    docs = documents(KubeOptions(replicas=2, namespace="llm"))
    deployment, daemonset = router_and_agent(docs)
    service = headless_service_for(docs, daemonset)
    agent = parse_pod_command(daemonset["spec"]["template"]["spec"]["containers"][0]["command"])
    router = parse_pod_command(deployment["spec"]["template"]["spec"]["containers"][0]["command"])
    (source,) = [parse_discovery_source(text) for text in router.discover_agents]
    assert source.name == f"{service['metadata']['name']}.llm-gpu-agent.svc.cluster.local"
    assert service["metadata"]["namespace"] == "llm-gpu-agent"
    assert source.port == agent.port
    assert source.port in {p["port"] for p in service["spec"]["ports"]}


# (d) Keys


def test_no_secret_object_and_no_key_in_the_manifest(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("DPSERVE_API_KEYS", "DPSERVE_ADMIN_KEYS", "API_KEYS", "ADMIN_KEYS", "HF_TOKEN"):
        monkeypatch.setenv(name, f"{SECRET}-{name}")
    assert main(["kube", "--replicas", "2", "--service-monitor"]) == 0
    text = capsys.readouterr().out
    assert text == render(KubeOptions(replicas=2, service_monitor=True))
    assert SECRET not in text
    docs = [doc for doc in yaml.safe_load_all(text) if doc]
    assert not only(docs, "Secret")
    for workload, container in containers(docs):
        for env in container.get("env", []):
            if re.search(r"KEY|TOKEN|SECRET|PASSWORD", env["name"]):
                assert "value" not in env, f"{workload['metadata']['name']}: {env['name']} has a value"
                assert set(env["valueFrom"]) == {"secretKeyRef"}


def _mounted_file(pod_spec: dict[str, Any], path: str) -> tuple[str, str]:
    """The Secret and its entry a file in the pod's one container comes from."""
    folder, _, name = path.rpartition("/")
    (container,) = pod_spec["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
    assert mount["readOnly"] is True and "subPath" not in mount, "a changed Secret reaches the file"
    (volume,) = [v for v in pod_spec["volumes"] if v["name"] == mount["name"]]
    items = {item["path"]: item["key"] for item in volume["secret"].get("items", [])}
    return volume["secret"]["secretName"], items.get(name, name)


def test_the_router_reads_its_keys_from_files_of_the_secret_the_header_says_to_create(tmp_path: Path) -> None:
    options = KubeOptions(replicas=2)
    text = render(options)
    create = next(line for line in text.splitlines() if f"create secret generic {options.keys_secret}" in line)
    assert create.startswith("#")
    entries = dict(re.findall(r"--from-file=([a-z-]+)=(\S+)", create))
    deployment, _ = router_and_agent(documents(options))
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert not [e for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})], "files only"
    settings = load_settings(RouterSettings, _overrides(parse_pod_command(container["command"])), env={})
    files = {"api_key_file": settings.api_key_file, "admin_key_file": settings.admin_key_file}
    found = {name: _mounted_file(spec, str(path)) for name, path in files.items()}
    assert {secret for secret, _ in found.values()} == {options.keys_secret}
    assert {entry for _, entry in found.values()} == set(entries)
    # A missing Secret (or entry) holds the pod back: a router on 0.0.0.0 without keys would not start.
    volumes = [v["secret"] for v in spec["volumes"] if "secret" in v]
    assert all(not volume.get("optional", False) and volume["defaultMode"] == 0o440 for volume in volumes)
    # What the header's files hold, as the kubelet mounts them, is what the router loads as its keys.
    (tmp_path / "api-keys").write_text("team-a:key-one-1234\nkey-two-5678\n")
    (tmp_path / "admin-keys").write_text("admin-key-1234\n")
    local = dataclasses.replace(
        settings, api_key_file=tmp_path / "api-keys", admin_key_file=tmp_path / "admin-keys", replica_api_key_file=None
    )
    keys = load_keys(local)
    assert keys.admins == (b"admin-key-1234",) and "team-a" in keys.user_names


@pytest.mark.engine
def test_vllm_requires_the_replica_key_the_header_says_to_create_and_every_router_sends_it() -> None:
    options = KubeOptions(replicas=2, namespace="llm")
    text = render(options)
    create = next(line for line in text.splitlines() if "create secret generic dpserve-replica-key" in line)
    assert create.startswith("#") and "-n llm " in create
    (literal,) = re.findall(r"--from-literal=([a-z-]+)=\$\(openssl rand -hex 32\)", create)
    docs = documents(options)
    deployment, _ = router_and_agent(docs)
    (statefulset,) = only(docs, "StatefulSet")
    (vllm,) = statefulset["spec"]["template"]["spec"]["containers"]
    (env,) = [e for e in vllm["env"] if e["name"] == "VLLM_API_KEY"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "dpserve-replica-key", "key": literal, "optional": False}
    # The routers read it from a file of the same Secret's entry.
    spec = deployment["spec"]["template"]["spec"]
    settings = load_settings(RouterSettings, _overrides(parse_pod_command(spec["containers"][0]["command"])), env={})
    assert _mounted_file(spec, str(settings.replica_api_key_file)) == ("dpserve-replica-key", literal)
    # VLLM_API_KEY is what vLLM reads when no --api-key is given (its source says so; importing vLLM takes
    # seconds): the key stays off its command line.
    assert "--api-key" not in vllm["command"]
    spec_ = importlib.util.find_spec("vllm")
    assert spec_ and spec_.origin
    register = Path(spec_.origin).parent / "entrypoints" / "serve" / "middleware" / "register.py"
    assert "args.api_key or [envs.VLLM_API_KEY]" in register.read_text()


# (e) The pods' commands through dpserve's parser


def test_the_router_command_parses_and_listens_where_it_is_probed() -> None:
    docs = documents(KubeOptions(replicas=2, namespace="llm", router_replicas=3))
    deployment, _ = router_and_agent(docs)
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = parse_pod_command(container["command"])
    assert args.command == "router"
    assert args.discover == ["dns:vllm.llm.svc.cluster.local:8000"]
    assert args.discover_agents == ["dns:dpserve-agent.llm-gpu-agent.svc.cluster.local:9400"]
    assert args.host == "0.0.0.0"
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": args.port}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": args.port}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(args.port)
    assert container["securityContext"]["runAsNonRoot"] is True
    # The clients' Service (the peers' headless one selects the same pods).
    (service,) = [
        s
        for s in only(docs, "Service")
        if selects(s["spec"]["selector"], pod["metadata"]["labels"]) and s["spec"].get("clusterIP") != "None"
    ]
    assert service["spec"]["type"] == "ClusterIP"
    (port,) = service["spec"]["ports"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port["port"] == 80 and named[port["targetPort"]] == args.port
    (budget,) = [b for b in only(docs, "PodDisruptionBudget") if b["metadata"]["name"] == "dpserve-router"]
    assert budget["spec"]["minAvailable"] == 1
    assert selects(budget["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    affinity = pod["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert affinity[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert selects(affinity[0]["podAffinityTerm"]["labelSelector"]["matchLabels"], pod["metadata"]["labels"])


def test_the_agent_command_parses_and_names_the_node() -> None:
    _, daemonset = router_and_agent(documents(KubeOptions(replicas=2)))
    pod = daemonset["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = parse_pod_command(container["command"])
    assert args.command == "agent"
    settings = load_settings(AgentSettings, _overrides(args), env={})
    # The kubelet expands $(NODE_NAME) from the container's env: the node's name, from the downward API.
    variable = re.fullmatch(r"\$\((\w+)\)", settings.hostname or "")
    assert variable is not None
    env = {e["name"]: e for e in container["env"]}
    assert env[variable.group(1)]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
    assert pod["spec"]["hostPID"] is True
    # As compose's agent, which test_compose_docker shows reading a root and a non-root replica's sockets.
    assert container["securityContext"]["runAsUser"] == 0
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE", "DAC_READ_SEARCH"]}
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": settings.port}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(settings.port)


@pytest.mark.parametrize("enabled", [False, True])
def test_service_monitors_select_services_by_a_named_port(enabled: bool) -> None:
    docs = documents(KubeOptions(replicas=2, service_monitor=enabled))
    monitors = only(docs, "ServiceMonitor")
    if not enabled:
        assert not monitors
        return
    services = only(docs, "Service")
    scraped = set()
    for monitor in monitors:
        (service,) = [
            s for s in services if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        names = {p["name"] for p in service["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= names
        scraped.add(service["metadata"]["name"])
    assert {"dpserve-router", "dpserve-agent"} <= scraped


# (f) The command line


def test_the_cli_writes_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "dpserve.k8s.yaml"
    argv = ["kube", "--replicas", "3", "--namespace", "llm", "--router-image", "registry.local/dpserve:1", "-o"]
    assert main([*argv, str(path)]) == 0
    assert capsys.readouterr().out == ""
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    (statefulset,) = only(docs, "StatefulSet")
    assert statefulset["spec"]["replicas"] == 3
    assert {c["image"] for w, c in containers(docs) if w is not statefulset} == {"registry.local/dpserve:1"}


@pytest.mark.parametrize(
    "flags",
    [
        ["--replicas", "0"],
        ["--replicas", "-1"],
        ["--replicas", "2", "--router-replicas", "0"],
        ["--replicas", "2", "--router-workers", "0"],
    ],
)
def test_the_cli_rejects_bad_counts_with_exit_2(
    flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "out.yaml"
    assert main(["kube", *flags, "-o", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1 and captured.err.startswith("dpserve kube: ")
    assert not path.exists()


def test_the_cli_passes_router_replicas_and_workers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kube", "--replicas", "2", "--router-replicas", "3", "--router-workers", "2"]) == 0
    text = capsys.readouterr().out
    assert text == render(KubeOptions(replicas=2, router_replicas=3, router_workers=2))
    deployment, _ = router_and_agent([doc for doc in yaml.safe_load_all(text) if doc])
    args = parse_pod_command(deployment["spec"]["template"]["spec"]["containers"][0]["command"])
    assert (deployment["spec"]["replicas"], args.workers) == (3, 2)
    assert args.discover_peers == ["dns:dpserve-router-peers.dpserve.svc.cluster.local:8080"]


def test_the_cli_requires_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["kube"])
    assert exit_.value.code == 2
    assert "--replicas" in capsys.readouterr().err


# (g) LoRA adapters


def _lora_flags(command: list[str]) -> list[str]:
    start = command.index("--enable-lora")
    return command[start : start + 5]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_a_lora_claim_is_mounted_read_only_in_the_replica_and_router_pods(version: str) -> None:
    options = KubeOptions(replicas=2, lora_pvc="adapters", lora=("sql=/adapters/sql-v2",), max_loras=4)
    docs = documents(options)
    for doc in docs:
        if not doc["apiVersion"].startswith(CRD_GROUPS):
            kubernetes_validate.validate(doc, version, strict=True)
    (statefulset,) = only(docs, "StatefulSet")
    deployment, daemonset = router_and_agent(docs)
    for workload in (statefulset, deployment):
        spec = workload["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/adapters"]
        assert mount["readOnly"] is True
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert volume["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
    assert "/adapters" not in str(daemonset)
    (vllm,) = statefulset["spec"]["template"]["spec"]["containers"]
    # The router loads adapters at run time: vLLM allows it, and is given no --lora-modules.
    assert _lora_flags(vllm["command"]) == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16"]
    assert not any(arg.startswith("--lora-modules") for arg in vllm["command"])
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in vllm["env"]
    args = parse_pod_command(deployment["spec"]["template"]["spec"]["containers"][0]["command"])
    read = load_settings(RouterSettings, _overrides(args), env={})
    assert (read.lora_dir, read.lora_adapters, read.lora_affinity) == ("/adapters", {"sql": "/adapters/sql-v2"}, True)


def test_no_lora_unless_asked_for_and_enable_lora_without_a_claim() -> None:
    plain = render(KubeOptions(replicas=2))
    assert "lora" not in plain.lower() and "/adapters" not in plain
    docs = documents(KubeOptions(replicas=2, enable_lora=True, max_lora_rank=64, lora_affinity=False))
    (statefulset,) = only(docs, "StatefulSet")
    (vllm,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert _lora_flags(vllm["command"]) == ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "64"]
    assert "/adapters" not in str(docs)
    deployment, _ = router_and_agent(docs)
    args = parse_pod_command(deployment["spec"]["template"]["spec"]["containers"][0]["command"])
    assert (args.lora_dir, args.lora_affinity) == (None, False)  # on|off parses to a bool


def test_the_cli_passes_lora_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--lora-pvc", "adapters", "--lora", "sql=/adapters/sql", "--lora-affinity", "off"]
    flags += ["--max-loras", "3", "--max-lora-rank", "32"]
    assert main(["kube", "--replicas", "2", *flags]) == 0
    expected = KubeOptions(
        replicas=2, lora_pvc="adapters", lora=("sql=/adapters/sql",), lora_affinity=False, max_loras=3, max_lora_rank=32
    )
    assert capsys.readouterr().out == render(expected)
    assert main(["kube", "--replicas", "2", "--enable-lora"]) == 0
    assert capsys.readouterr().out == render(KubeOptions(replicas=2, enable_lora=True))
    for bad in (["--max-loras", "0"], ["--max-lora-rank", "-8"], ["--lora-pvc", " "]):
        path = tmp_path / "out.yaml"
        assert main(["kube", "--replicas", "2", *bad, "-o", str(path)]) == 2
        captured = capsys.readouterr()
        assert len(captured.err.strip().splitlines()) == 1 and captured.err.startswith("dpserve kube: ")
        assert not path.exists()
    with pytest.raises(SystemExit) as exit_:
        main(["kube", "--replicas", "2", "--lora", "sql="])
    assert exit_.value.code == 2 and "PATH is empty" in capsys.readouterr().err


def test_a_tracing_endpoint_goes_to_the_routers_and_every_vllm_pod(capsys: pytest.CaptureFixture[str]) -> None:
    endpoint = "http://otel-collector.observability:4317"
    assert main(["kube", "--replicas", "2", "--otlp-traces-endpoint", endpoint]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    traced = {}
    for workload, container in containers(docs):
        command = container.get("command", []) + container.get("args", [])
        traced[workload["kind"]] = _flag_values(command, "--otlp-traces-endpoint")
    # The vLLM pods and the routers; the GPU agents serve readings only.
    assert traced == {"StatefulSet": [endpoint], "Deployment": [endpoint], "DaemonSet": []}
    plain = "\n".join(str(c.get("command")) for _, c in containers(documents(KubeOptions(replicas=2))))
    assert "otlp" not in plain


def _flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[index + 1] for index, arg in enumerate(argv) if arg == flag]


# (f) Locked down: Pod Security levels, network policies, disruptions


def _namespaces(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {ns["metadata"]["name"]: ns for ns in only(docs, "Namespace")}


def _enforced(namespace: dict[str, Any]) -> str:
    level: str = namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
    return level


@pytest.mark.parametrize("lora_pvc", [None, "adapters"])
def test_every_pod_meets_the_level_its_namespace_enforces_and_the_routers_restricted(lora_pvc: str | None) -> None:
    docs = documents(KubeOptions(replicas=2, namespace="llm", lora_pvc=lora_pvc, model_cache_pvc="models"))
    namespaces = _namespaces(docs)
    assert _enforced(namespaces["llm"]) == "baseline"
    levels = {}
    for workload, spec in pod_specs(docs):
        level = _enforced(namespaces[workload["metadata"]["namespace"]])
        assert violations(spec, level) == [], (workload["metadata"]["name"], level)
        levels[workload["metadata"]["name"]] = level
    assert levels == {"vllm": "baseline", "dpserve-router": "baseline", "dpserve-agent": "privileged"}
    deployment, daemonset = router_and_agent(docs)
    assert violations(deployment["spec"]["template"]["spec"], "restricted") == []
    # vLLM's image runs as root: baseline, with no capability and no escalation, but not restricted.
    (statefulset,) = only(docs, "StatefulSet")
    vllm_spec = statefulset["spec"]["template"]["spec"]
    assert violations(vllm_spec, "restricted") == ["vllm: runAsNonRoot not true"]
    (vllm,) = vllm_spec["containers"]
    assert vllm["securityContext"]["allowPrivilegeEscalation"] is False
    assert vllm["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # The agent is what baseline refuses, and its namespace says why, in its own words for each privilege.
    assert violations(daemonset["spec"]["template"]["spec"], "baseline") == [
        "hostPID: true (host namespaces)",
        "agent: capabilities added beyond baseline's: ['DAC_READ_SEARCH', 'SYS_PTRACE']",
    ]
    why = namespaces["llm-gpu-agent"]["metadata"]["annotations"]["dpserve/pod-security"]
    assert all(word in why for word in ("hostPID", "SYS_PTRACE", "DAC_READ_SEARCH", "baseline"))
    assert [doc["metadata"]["name"] for doc in docs if doc["metadata"].get("namespace") == "llm-gpu-agent"] == [
        "dpserve-agent"
    ] * 3, "nothing but the agent in the privileged namespace"


def test_the_pod_security_checks_refuse_what_each_level_forbids() -> None:
    container = {"name": "c", "securityContext": {}}
    assert violations({"containers": [container]}, "privileged") == []
    assert violations({"containers": [container]}, "baseline") == []
    for bad in (
        {"hostNetwork": True},
        {"hostIPC": True},
        {"volumes": [{"name": "v", "hostPath": {"path": "/"}}]},
        {"securityContext": {"seccompProfile": {"type": "Unconfined"}}},
        {"securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}},
    ):
        assert violations({"containers": [container], **bad}, "baseline"), bad
    for bad_context in (
        {"privileged": True},
        {"capabilities": {"add": ["SYS_ADMIN"]}},
        {"procMount": "Unmasked"},
        {"seLinuxOptions": {"type": "spc_t"}},
    ):
        assert violations({"containers": [{"name": "c", "securityContext": bad_context}]}, "baseline"), bad_context
    assert violations({"containers": [{"name": "c", "ports": [{"containerPort": 80, "hostPort": 80}]}]}, "baseline")
    restricted = {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert violations({"containers": [{"name": "c", "securityContext": restricted}]}, "restricted") == []
    for field in restricted:
        lacking = {key: value for key, value in restricted.items() if key != field}
        assert violations({"containers": [{"name": "c", "securityContext": lacking}]}, "restricted"), field
    volume = {"name": "v", "nfs": {"server": "x", "path": "/"}}
    spec = {"containers": [{"name": "c", "securityContext": restricted}], "volumes": [volume]}
    assert violations(spec, "baseline") == [] and violations(spec, "restricted") == ["volume v: ['nfs']"]
    with pytest.raises(ValueError, match="no Pod Security level"):
        violations(spec, "strict")


Peer = tuple[dict[str, str], dict[str, str]] | str
"""A connection's other end: a pod (its namespace's labels, its labels), or an address outside the cluster."""


def _matches(selector: dict[str, Any], peer: Peer) -> bool:
    """One `from`/`to` entry, as Kubernetes reads it: an address block, or pods (an empty selector: all)."""
    if "ipBlock" in selector:
        block = selector["ipBlock"]
        if not isinstance(peer, str) or ipaddress.ip_address(peer) not in ipaddress.ip_network(block["cidr"]):
            return False
        return not any(ipaddress.ip_address(peer) in ipaddress.ip_network(cidr) for cidr in block.get("except", []))
    if isinstance(peer, str):
        return False
    namespace_labels, pod_labels = peer
    wanted = (selector["namespaceSelector"]["matchLabels"], selector["podSelector"]["matchLabels"])
    return all(
        all(labels.get(key) == value for key, value in selector_labels.items())
        for selector_labels, labels in zip(wanted, (namespace_labels, pod_labels), strict=True)
    )


def _allows(policy: dict[str, Any], direction: str, peer: Peer, port: int, protocol: str = "TCP") -> bool:
    """Whether `policy` lets a connection in (Ingress, from `peer`) or out (Egress, to `peer`) on `port`."""
    if direction not in policy["spec"]["policyTypes"]:
        return True
    key, side = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for rule in policy["spec"].get(key, []):
        if "ports" in rule and not any(p["port"] == port and p["protocol"] == protocol for p in rule["ports"]):
            continue
        if side not in rule or any(_matches(selector, peer) for selector in rule[side]):
            return True
    return False


def _admits(policy: dict[str, Any], namespace_labels: dict[str, str], pod_labels: dict[str, str], port: int) -> bool:
    return _allows(policy, "Ingress", (namespace_labels, pod_labels), port)


def _policies(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The one policy guarding each workload's pods, by the workload's name."""
    policies = only(docs, "NetworkPolicy")
    guarding = {}
    for workload, _ in pod_specs(docs):
        found = [
            p
            for p in policies
            if selects(p["spec"]["podSelector"]["matchLabels"], template_labels(workload))
            and p["metadata"]["namespace"] == workload["metadata"]["namespace"]
        ]
        assert len(found) == 1, f"{workload['metadata']['name']} is behind exactly one policy"
        guarding[workload["metadata"]["name"]] = found[0]
    return guarding


def _ns(name: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": name}


PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}
DNS = (_ns("kube-system"), {"k8s-app": "kube-dns", "pod-template-hash": "x"})


def test_network_policies_let_only_the_routers_reach_the_replicas_and_prometheus_scrape() -> None:
    options = KubeOptions(replicas=2, namespace="llm", prometheus_namespace="obs")
    docs = documents(options)
    guarding = _policies(docs)
    vllm, router, agent = guarding["vllm"], guarding["dpserve-router"], guarding["dpserve-agent"]
    deployment, daemonset = router_and_agent(docs)
    (statefulset,) = only(docs, "StatefulSet")
    assert vllm["metadata"]["namespace"] == "llm"
    llm, obs = _ns("llm"), _ns("obs")
    router_pod, agent_pod, vllm_pod = (template_labels(w) for w in (deployment, daemonset, statefulset))
    for port in (8000, 5557):
        assert _admits(vllm, llm, router_pod, port)
        assert not _admits(vllm, llm, agent_pod, port) and not _admits(vllm, llm, vllm_pod, port)
        assert not _admits(vllm, llm, {"app": "anything"}, port) and not _admits(vllm, llm, {}, port)
        assert not _admits(vllm, _ns("other"), router_pod, port), "routers elsewhere"
    assert _admits(vllm, obs, PROMETHEUS, 8000) and not _admits(vllm, obs, PROMETHEUS, 5557)
    assert not _admits(vllm, llm, PROMETHEUS, 8000), "Prometheus in its own namespace only"
    assert not _admits(vllm, llm, router_pod, 8080), "only the replicas' two ports"
    # The routers take their own namespace's pods (the default), each other and Prometheus, on their one port.
    assert _admits(router, llm, {"app": "chat"}, 8080) and not _admits(router, llm, {"app": "chat"}, 9000)
    assert _admits(router, llm, router_pod, 8080) and _admits(router, obs, PROMETHEUS, 8080)
    assert not _admits(router, _ns("other"), {"app": "chat"}, 8080), "pods of other namespaces"
    assert not _allows(router, "Ingress", "203.0.113.9", 8080), "nothing from outside the cluster"
    # The agents answer routers and Prometheus only.
    assert agent["metadata"]["namespace"] == "llm-gpu-agent"
    assert _admits(agent, llm, router_pod, 9400) and _admits(agent, obs, PROMETHEUS, 9400)
    assert not _admits(agent, llm, vllm_pod, 9400)
    ports = {p["containerPort"] for p in statefulset["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports == {8000, 5557}


def test_egress_replicas_reach_dns_only_routers_their_fleet_and_agents_nothing() -> None:
    options = KubeOptions(replicas=2, namespace="llm", router_replicas=2)
    docs = documents(options)
    guarding = _policies(docs)
    vllm, router, agent = guarding["vllm"], guarding["dpserve-router"], guarding["dpserve-agent"]
    assert all(p["spec"]["policyTypes"] == ["Ingress", "Egress"] for p in guarding.values())
    deployment, daemonset = router_and_agent(docs)
    (statefulset,) = only(docs, "StatefulSet")
    llm, agents_ns = _ns("llm"), _ns("llm-gpu-agent")
    router_pod, agent_pod, vllm_pod = (template_labels(w) for w in (deployment, daemonset, statefulset))
    for protocol in ("UDP", "TCP"):
        assert _allows(vllm, "Egress", DNS, 53, protocol) and _allows(router, "Egress", DNS, 53, protocol)
        assert not _allows(agent, "Egress", DNS, 53, protocol), "the agents look nothing up"
    for address, port in (("203.0.113.9", 443), ("10.0.0.1", 53), ("1.1.1.1", 53)):
        for policy in (vllm, router, agent):
            assert not _allows(policy, "Egress", address, port), (policy["metadata"]["name"], address, port)
    assert not _allows(vllm, "Egress", (llm, router_pod), 8080), "a replica calls no router"
    assert not _allows(vllm, "Egress", (llm, vllm_pod), 8000), "nor another replica"
    # The routers: the replicas' two ports, the peers' port, the agents' readings; nothing else.
    assert _allows(router, "Egress", (llm, vllm_pod), 8000) and _allows(router, "Egress", (llm, vllm_pod), 5557)
    assert _allows(router, "Egress", (llm, router_pod), 8080)
    assert _allows(router, "Egress", (agents_ns, agent_pod), 9400)
    assert not _allows(router, "Egress", (llm, vllm_pod), 22) and not _allows(router, "Egress", (llm, {}), 8000)
    # The policy the router's own peers pass: each router may reach, and be reached by, the others.
    assert _admits(router, llm, router_pod, 8080)


@pytest.mark.parametrize("egress", [[], ["--vllm-egress", "0.0.0.0/0:443"]])
def test_vllm_stays_off_hugging_face_unless_its_pods_may_reach_it(
    egress: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["kube", "--replicas", "1", *egress]) == 0
    text = capsys.readouterr().out
    (statefulset,) = only([doc for doc in yaml.safe_load_all(text) if doc], "StatefulSet")
    env = {e["name"]: e.get("value") for e in statefulset["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env.get("HF_HUB_OFFLINE") == (None if egress else "1")
    assert ("--vllm-egress 0.0.0.0/0:443" in text.partition("apiVersion")[0]) == (not egress), "the header says how"


def test_egress_as_told_and_to_the_tracing_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--vllm-egress", "0.0.0.0/0:443", "--vllm-egress", "10.20.0.0/16"]
    flags += ["--otlp-traces-endpoint", "http://otel-collector.observability:4317"]
    assert main(["kube", "--replicas", "2", "--namespace", "llm", *flags]) == 0
    docs = [doc for doc in yaml.safe_load_all(capsys.readouterr().out) if doc]
    guarding = _policies(docs)
    vllm, router = guarding["vllm"], guarding["dpserve-router"]
    assert _allows(vllm, "Egress", "203.0.113.9", 443) and not _allows(vllm, "Egress", "203.0.113.9", 80)
    assert _allows(vllm, "Egress", "10.20.3.4", 80) and not _allows(vllm, "Egress", "10.21.3.4", 80)
    assert not _allows(router, "Egress", "203.0.113.9", 443), "only the replicas were told"
    collector = (_ns("observability"), {"app": "otel-collector"})
    for policy in (vllm, router):
        assert _allows(policy, "Egress", collector, 4317) and not _allows(policy, "Egress", collector, 4318)
    address = KubeOptions(replicas=1, otlp_traces_endpoint="http://10.9.8.7:4318")
    (vllm_policy, *_) = only(documents(address), "NetworkPolicy")
    assert _allows(vllm_policy, "Egress", "10.9.8.7", 4318) and not _allows(vllm_policy, "Egress", "10.9.8.8", 4318)
    for bad in ("example.com:443", "10.0.0.0/8:0", "10.0.0.0/33"):
        assert main(["kube", "--replicas", "1", "--vllm-egress", bad]) == 2
        assert capsys.readouterr().err.startswith(f"dpserve kube: --vllm-egress {bad!r}")


@pytest.mark.parametrize(
    ("clients", "admitted", "refused"),
    [
        (["ingress-nginx"], [(_ns("ingress-nginx"), {"app": "x"})], [(_ns("llm"), {"app": "chat"}), "203.0.113.9"]),
        (
            ["apps:app=chat,tier=web"],
            [(_ns("apps"), {"app": "chat", "tier": "web", "more": "x"})],
            [(_ns("apps"), {"app": "chat"}), (_ns("llm"), {"app": "chat", "tier": "web"})],
        ),
        (["*"], [(_ns("any"), {}), "203.0.113.9"], []),
    ],
)
def test_router_clients_as_told_and_always_their_peers_and_prometheus(
    clients: list[str], admitted: list[Peer], refused: list[Peer], capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [arg for text in clients for arg in ("--router-clients", text)]
    assert main(["kube", "--replicas", "2", "--namespace", "llm", *flags]) == 0
    docs = [doc for doc in yaml.safe_load_all(capsys.readouterr().out) if doc]
    router = _policies(docs)["dpserve-router"]
    deployment, _ = router_and_agent(docs)
    for peer in [*admitted, (_ns("llm"), template_labels(deployment)), (_ns("monitoring"), PROMETHEUS)]:
        assert _allows(router, "Ingress", peer, 8080), peer
    for peer in refused:
        assert not _allows(router, "Ingress", peer, 8080), peer
    for port in (8000, 9400):
        assert not _allows(router, "Ingress", (_ns("any"), {}), port)


@pytest.mark.parametrize("bad", ["", "Bad_NS", "apps:", "apps:app", "apps:app=a b", "apps:=x"])
def test_a_bad_router_clients_selector_is_refused_by_name(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kube", "--replicas", "1", "--router-clients", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dpserve kube: --router-clients {bad!r}") and len(err.splitlines()) == 1


def test_routers_roll_and_stop_without_dropping_a_request_and_drains_take_one_replica_at_a_time() -> None:
    docs = documents(KubeOptions(replicas=3))
    deployment, _ = router_and_agent(docs)
    (statefulset,) = only(docs, "StatefulSet")
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    settings = RouterSettings()
    for workload in (deployment, statefulset):
        spec = workload["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        sleep = container["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep[0] == "sleep" and int(sleep[1]) >= 5
        # The preStop sleep, then the router's drain of what it holds (vLLM's shutdown), within the grace.
        assert spec["terminationGracePeriodSeconds"] > int(sleep[1]) + settings.shutdown_grace_s
        assert spec["automountServiceAccountToken"] is False
    # The replicas' sleep outlasts a router's DNS re-read, so no router picks a replica that is stopping.
    (vllm,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert int(vllm["lifecycle"]["preStop"]["exec"]["command"][1]) > settings.discover_interval_s
    budgets = {b["metadata"]["name"]: b["spec"] for b in only(docs, "PodDisruptionBudget")}
    assert budgets["vllm"] == {"maxUnavailable": 1, "selector": {"matchLabels": template_labels(statefulset)}}
    assert budgets["dpserve-router"]["minAvailable"] == 1


def test_images_are_tagged_with_the_package_version_never_latest() -> None:
    docs = documents(KubeOptions(replicas=2))
    images = {c["image"]: c.get("imagePullPolicy") for _, c in containers(docs)}
    version = package_version()
    assert images == {"vllm/vllm-openai:v0.32.0": None, f"dpserve-router:{version}": "IfNotPresent"}
    assert f"Router and agent run dpserve-router:{version}" in render(KubeOptions(replicas=2))


def test_the_cli_passes_the_prometheus_namespace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kube", "--replicas", "1", "--prometheus-namespace", "obs"]) == 0
    docs = [doc for doc in yaml.safe_load_all(capsys.readouterr().out) if doc]
    peers = [
        peer for p in only(docs, "NetworkPolicy") for rule in p["spec"]["ingress"] for peer in rule.get("from", [])
    ]
    scrapers = [
        peer for peer in peers if peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    ]
    # The replicas, the routers and the agents let it scrape them.
    assert len(scrapers) == 3 and all(
        peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "obs"} for peer in scrapers
    )


# (h) Replicas wider than one GPU


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("gpu_resource", ["nvidia.com/gpu", "nvidia.com/mig-3g.40gb"])
def test_tensor_parallel_pods_take_k_gpus_and_still_validate(version: str, gpu_resource: str) -> None:
    options = KubeOptions(replicas=4, tensor_parallel_size=2, gpu_resource=gpu_resource, service_monitor=True)
    docs = documents(options)
    for doc in docs:
        if not doc["apiVersion"].startswith(CRD_GROUPS):
            kubernetes_validate.validate(doc, version, strict=True)
    (statefulset,) = only(docs, "StatefulSet")
    assert statefulset["spec"]["replicas"] == 4  # pods, that is replicas: 8 GPUs in all
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    resources = container["resources"]
    assert resources["limits"] == {gpu_resource: 2}
    assert gpu_quantity(resources, "requests", gpu_resource) == 2
    assert (resources["requests"]["cpu"], resources["requests"]["memory"]) == ("8", "48Gi")
    command = container["command"]
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    namespaces = _namespaces(docs)
    assert violations(statefulset["spec"]["template"]["spec"], _enforced(namespaces["dpserve"])) == []
    # Nothing else asks for a GPU, and one GPU a pod stays as it was.
    for workload, other in containers(docs):
        if workload is not statefulset:
            assert not any(name.startswith("nvidia.com/") for name in other.get("resources", {}).get("limits", {}))
    (single,) = only(documents(KubeOptions(replicas=4)), "StatefulSet")
    (one,) = single["spec"]["template"]["spec"]["containers"]
    assert "--tensor-parallel-size" not in one["command"] and one["resources"]["limits"] == {"nvidia.com/gpu": 1}


def test_the_cli_passes_the_tensor_parallel_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kube", "--replicas", "4", "--tensor-parallel-size", "2"]) == 0
    text = capsys.readouterr().out
    assert text == render(KubeOptions(replicas=4, tensor_parallel_size=2))
    assert (
        "Generated by `dpserve kube --replicas 4 --model Qwen/Qwen2.5-1.5B-Instruct --tensor-parallel-size 2`" in text
    )
    assert main(["kube", "--replicas", "4", "--tensor-parallel-size", "0"]) == 2
    assert "at least 1 GPU per replica" in capsys.readouterr().err
