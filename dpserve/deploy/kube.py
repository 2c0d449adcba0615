"""Kubernetes manifests for a GPU cluster: `dpserve kube` writes them as one multi-document YAML.

- a StatefulSet `vllm`: N pods, each asking for one GPU, behind the headless Service `vllm` (one DNS
  address per ready pod);
- the router Deployment `dpserve-router`, which finds the replicas through that Service's DNS name
  (`--discover`) and the GPU agents through theirs (`--discover-agents`), with a PodDisruptionBudget and
  a ClusterIP Service; with more than one router, the headless Service `dpserve-router-peers`, through
  which each router finds the others (`--discover-peers`) to share routing state;
- the DaemonSet `dpserve-agent` on every GPU node: NVML readings for the routers, no GPU taken;
- NetworkPolicies: only the routers (and Prometheus, for /metrics) reach the replicas' ports;
- optionally ServiceMonitors for the Prometheus Operator.

Pod Security Standards: the namespace enforces `baseline`; the routers meet `restricted`. The agents need the
host's process table, which no level short of `privileged` allows: they run in a namespace of their own
(`<namespace>-gpu-agent`) that says so, so the main namespace's level holds for everything in it.

Keys never appear here: the router reads them from the Secret `dpserve-keys`, the routers and vLLM the
replicas' key from the Secret `dpserve-replica-key`, both made by hand with kubectl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpserve.config import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    RouterSettings,
    check_lora_engine,
    check_tensor_parallel_size,
    lora_adapters,
)
from dpserve.deploy.compose import (
    ADAPTERS_DIR,
    DEFAULT_MODEL,
    DEFAULT_VLLM_IMAGE,
    HF_CACHE_DIR,
    KV_EVENTS_PORT,
    REPLICA_PORT,
    ROUTER_ENTRYPOINT,
    router_image,
)
from dpserve.deploy.yaml_text import dump
from dpserve.up.plan import LORA_RUNTIME_ENV, router_flags, vllm_engine_flags

DEFAULT_NAMESPACE = "dpserve"
DEFAULT_ROUTER_REPLICAS = 2
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_KEYS_SECRET = "dpserve-keys"
GPU_TAINT = "nvidia.com/gpu"
"""The taint GPU nodes usually carry (NVIDIA's GPU Operator, the managed clouds): tolerated by what runs there."""
GPU_NODE_LABEL = "nvidia.com/gpu.present"
"""Set by NVIDIA's GPU feature discovery on nodes with a GPU: where the agent runs."""
HF_TOKEN_SECRET = "hf-token"
API_KEYS_ENTRY = "api-keys"
ADMIN_KEYS_ENTRY = "admin-keys"
REPLICA_KEY_SECRET = "dpserve-replica-key"
REPLICA_KEY_ENTRY = "key"
"""The key vLLM requires on /v1 (VLLM_API_KEY) and the routers send it (DPSERVE_REPLICA_API_KEY)."""
DEFAULT_PROMETHEUS_NAMESPACE = "monitoring"
PROMETHEUS_POD_LABELS = {"app.kubernetes.io/name": "prometheus"}
"""How the Prometheus Operator (and kube-prometheus-stack) labels Prometheus' pods: allowed to scrape."""
AGENT_NAMESPACE_SUFFIX = "-gpu-agent"
PRE_STOP_S = {"router": 5, "vllm": 10}
"""How long a pod keeps serving after it is told to stop, before SIGTERM: for the Service's endpoints (the
router) or the routers' DNS discovery, re-read every 5 s (a replica), to drop it first."""

VLLM_NAME = "vllm"
ROUTER_NAME = "dpserve-router"
ROUTER_PEERS_NAME = "dpserve-router-peers"
AGENT_NAME = "dpserve-agent"
ADAPTERS_VOLUME = "lora-adapters"
ROUTER_PORT = 8080
ROUTER_SERVICE_PORT = 80
AGENT_PORT = 9400
MAX_MODEL_LEN = 8192
"""compose.yaml's default context length."""
STARTUP_PERIOD_S = 10
STARTUP_FAILURES = 180
"""10 s x 180: half an hour for the first start, which downloads the weights and compiles."""
ROUTER_USER = 65534
"""router/Dockerfile's USER (nobody)."""
ROUTER_CPU = 1
"""Cores requested per router process (`--router-workers` multiplies it)."""
ROUTER_MEMORY_GIB = (1, 3)
AGENT_CAPABILITIES = ("SYS_PTRACE", "DAC_READ_SEARCH")
"""What the agent adds to nothing (agent_security_context says why each)."""
"""Memory request and limit per router process: each holds its own KV index, about 1 GB at its default bound."""


@dataclass(frozen=True)
class KubeOptions:
    replicas: int
    model: str = DEFAULT_MODEL
    namespace: str = DEFAULT_NAMESPACE
    router_replicas: int = DEFAULT_ROUTER_REPLICAS
    router_workers: int = 1
    """Router processes per router pod (`--workers`) behind its one port: resources scale with them."""
    image: str = DEFAULT_VLLM_IMAGE
    router_image: str = router_image()
    """Runs `dpserve` (router and agent): router/Dockerfile's image tagged with this package's version, pushed
    where the cluster can pull it."""
    gpu_resource: str = DEFAULT_GPU_RESOURCE
    service_monitor: bool = False
    model_cache_pvc: str | None = None
    """An existing ReadWriteMany claim shared by every replica; none: each pod downloads into an emptyDir."""
    keys_secret: str = DEFAULT_KEYS_SECRET
    lora: tuple[str, ...] = ()
    """`NAME=PATH` adapters for the routers to load, PATH as the replica pods see it."""
    lora_pvc: str | None = None
    """An existing claim holding the adapters (one subfolder each), mounted read-only at ADAPTERS_DIR in the
    replica and router pods: ReadOnlyMany or ReadWriteMany, as the pods are on several nodes."""
    lora_affinity: bool = True
    enable_lora: bool = False
    """LoRA in the replicas without adapters given here (implied by `lora` and `lora_pvc`)."""
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    otlp_traces_endpoint: str | None = None
    """Where the routers and the vLLM pods export traces (OTLP): vLLM's spans nest under the router's."""
    prometheus_namespace: str = DEFAULT_PROMETHEUS_NAMESPACE
    """Where Prometheus runs: its pods (PROMETHEUS_POD_LABELS) may scrape the replicas and the agents."""
    tensor_parallel_size: int = 1
    """GPUs per vLLM pod (vLLM's flag): the pod asks for that many of `gpu_resource`, on one node."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas {self.replicas}: at least one vLLM replica")
        if self.router_replicas < 1:
            raise ValueError(f"--router-replicas {self.router_replicas}: at least one router")
        if self.router_workers < 1:
            raise ValueError(f"--router-workers {self.router_workers}: at least one worker")
        for flag, value in (
            ("--model", self.model),
            ("--namespace", self.namespace),
            ("--image", self.image),
            ("--router-image", self.router_image),
            ("--gpu-resource", self.gpu_resource),
            ("--model-cache-pvc", self.model_cache_pvc),
            ("--lora-pvc", self.lora_pvc),
            ("--prometheus-namespace", self.prometheus_namespace),
        ):
            if value is not None and not value.strip():
                raise ValueError(f"{flag} must not be empty")
        lora_adapters(self.lora)
        check_lora_engine(self.max_loras, self.max_lora_rank)
        check_tensor_parallel_size(self.tensor_parallel_size)

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora or self.lora_pvc)

    def flags(self) -> str:
        """The command line that writes these manifests, as their header says (defaults left out but these)."""
        flags = f"--replicas {self.replicas} --model {self.model}"
        size = self.tensor_parallel_size
        return flags + (f" --tensor-parallel-size {size}" if size != 1 else "")

    def dns_name(self, service: str, namespace: str | None = None) -> str:
        return f"{service}.{namespace or self.namespace}.svc.cluster.local"

    @property
    def agent_namespace(self) -> str:
        return self.namespace + AGENT_NAMESPACE_SUFFIX

    @property
    def router_peers(self) -> bool:
        """Whether the routers look for each other (`--discover-peers`): only when there is more than one."""
        return self.router_replicas > 1


def _labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": component, "app.kubernetes.io/part-of": "dpserve"}


def _metadata(options: KubeOptions, name: str, component: str, namespace: str | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": namespace or options.namespace, "labels": _labels(component)}


def _scrape(port: int) -> dict[str, str]:
    # For Prometheus set up to scrape annotated pods (the common kubernetes-pods job).
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def _http_probe(path: str, port: int, period_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period_s,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _gpu_tolerations() -> list[dict[str, str]]:
    return [{"key": GPU_TAINT, "operator": "Exists", "effect": "NoSchedule"}]


def _secret_env(name: str, secret: str, key: str, optional: bool) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": optional}}}


def _pod_security(level: str) -> dict[str, str]:
    """The Pod Security admission labels: pods below `level` are refused, and warned of at `kubectl apply`."""
    prefix = "pod-security.kubernetes.io/"
    return {f"{prefix}enforce": level, f"{prefix}enforce-version": "latest", f"{prefix}warn": level}


def namespace(options: KubeOptions) -> dict[str, Any]:
    # Baseline, not restricted: vLLM's image runs as root (see vllm_statefulset). The routers meet restricted.
    labels = {"app.kubernetes.io/part-of": "dpserve", **_pod_security("baseline")}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": options.namespace, "labels": labels}}


def agent_namespace(options: KubeOptions) -> dict[str, Any]:
    """The GPU agents' own namespace, at `privileged`: nothing else runs there."""
    why = (
        "dpserve-agent needs hostPID (NVML names GPU processes by host pid, which only the host's process "
        "table maps to pods and ports) and CAP_SYS_PTRACE with CAP_DAC_READ_SEARCH (to read another user's "
        "/proc/PID/fd), which the baseline level forbids. Kept here so the dpserve namespace enforces baseline."
    )
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": options.agent_namespace,
            "labels": {"app.kubernetes.io/part-of": "dpserve", **_pod_security("privileged")},
            "annotations": {"dpserve/pod-security": why},
        },
    }


def _pre_stop(seconds: int) -> dict[str, Any]:
    # A sleep before SIGTERM: the pod leaves the endpoints (and DNS) while it still answers what reaches it.
    return {"preStop": {"exec": {"command": ["sleep", str(seconds)]}}}


def vllm_command(options: KubeOptions) -> list[str]:
    command = ["vllm", "serve", options.model, "--host", "0.0.0.0", "--port", str(REPLICA_PORT)]
    command += ["--gpu-memory-utilization", "0.90"]
    # The same engine flags as `dpserve up` and compose: prefix caching, KV events on tcp://*:5557 (which the
    # router subscribes to at each discovered pod's address), cached-token counts; LoRA when asked for.
    return command + vllm_engine_flags(
        None,
        KV_EVENTS_PORT,
        MAX_MODEL_LEN,
        enable_lora=options.lora_enabled,
        max_loras=options.max_loras,
        max_lora_rank=options.max_lora_rank,
        otlp_traces_endpoint=options.otlp_traces_endpoint,
        tensor_parallel_size=options.tensor_parallel_size,
    )


def _adapters_mounts(options: KubeOptions) -> list[dict[str, Any]]:
    return [{"name": ADAPTERS_VOLUME, "mountPath": ADAPTERS_DIR, "readOnly": True}] if options.lora_pvc else []


def _adapters_volumes(options: KubeOptions) -> list[dict[str, Any]]:
    if not options.lora_pvc:
        return []
    return [{"name": ADAPTERS_VOLUME, "persistentVolumeClaim": {"claimName": options.lora_pvc, "readOnly": True}}]


def vllm_statefulset(options: KubeOptions) -> dict[str, Any]:
    size = options.tensor_parallel_size
    gpu = {options.gpu_resource: size}
    cache: dict[str, Any] = (
        {"persistentVolumeClaim": {"claimName": options.model_cache_pvc}}
        if options.model_cache_pvc
        else {"emptyDir": {}}
    )
    container = {
        "name": "vllm",
        "image": options.image,
        "command": vllm_command(options),
        "ports": [
            {"name": "http", "containerPort": REPLICA_PORT},
            {"name": "kv-events", "containerPort": KV_EVENTS_PORT},
        ],
        "env": [
            _secret_env("HF_TOKEN", HF_TOKEN_SECRET, "token", optional=True),
            # vLLM reads VLLM_API_KEY as it reads --api-key (off the command line): /v1 wants it, /health and
            # /metrics do not. The routers send the same key.
            _secret_env("VLLM_API_KEY", REPLICA_KEY_SECRET, REPLICA_KEY_ENTRY, optional=False),
            # With LoRA, the router loads adapters at run time (POST /v1/load_lora_adapter).
            *({"name": name, "value": value} for name, value in LORA_RUNTIME_ENV.items() if options.lora_enabled),
        ],
        # One GPU per pod, or K (--tensor-parallel-size): the pod is the unit of data parallelism, and the device
        # plugin pins its GPUs, all on one node. CPU and memory grow with its ranks (one process each).
        "resources": {"requests": {"cpu": str(4 * size), "memory": f"{24 * size}Gi", **gpu}, "limits": dict(gpu)},
        "startupProbe": _http_probe("/health", REPLICA_PORT, STARTUP_PERIOD_S, STARTUP_FAILURES),
        "readinessProbe": _http_probe("/health", REPLICA_PORT, 5, 3),
        "livenessProbe": _http_probe("/health", REPLICA_PORT, 10, 6),
        "lifecycle": _pre_stop(PRE_STOP_S["vllm"]),
        # Baseline and a little more. Not restricted: vllm/vllm-openai runs as root (its one user; its caches
        # are under /root) and writes to its root filesystem (compile caches), so neither runAsNonRoot nor
        # readOnlyRootFilesystem. It needs no capability: the GPU comes as a device, not a privilege.
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "hf-cache", "mountPath": HF_CACHE_DIR},
            *_adapters_mounts(options),
        ],
    }
    labels = _labels(VLLM_NAME)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(options, VLLM_NAME, VLLM_NAME),
        "spec": {
            "replicas": options.replicas,
            "serviceName": VLLM_NAME,
            # Replicas are independent: start and replace them all at once, not one after another.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": _scrape(REPLICA_PORT)},
                "spec": {
                    # The preStop sleep, then vLLM's own shutdown.
                    "terminationGracePeriodSeconds": 60,
                    # Nothing here talks to the Kubernetes API.
                    "automountServiceAccountToken": False,
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "tolerations": _gpu_tolerations(),
                    "containers": [container],
                    "volumes": [
                        # PyTorch shares tensors between vLLM's processes through /dev/shm (compose: ipc host).
                        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
                        {"name": "hf-cache", **cache},
                        *_adapters_volumes(options),
                    ],
                },
            },
        },
    }


def vllm_service(options: KubeOptions) -> dict[str, Any]:
    # Headless: the name resolves to every ready pod's address, which is what the router's --discover reads.
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(options, VLLM_NAME, VLLM_NAME),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": _labels(VLLM_NAME),
            "ports": [
                {"name": "http", "port": REPLICA_PORT, "targetPort": REPLICA_PORT},
                {"name": "kv-events", "port": KV_EVENTS_PORT, "targetPort": KV_EVENTS_PORT},
            ],
        },
    }


def router_command(options: KubeOptions) -> list[str]:
    # The other router pods, by the peers' headless Service: one address per pod, ready or starting.
    peers = (f"dns:{options.dns_name(ROUTER_PEERS_NAME)}:{ROUTER_PORT}",) if options.router_peers else ()
    settings = RouterSettings(
        host="0.0.0.0",
        port=ROUTER_PORT,
        workers=options.router_workers,
        discover_peers=peers,
        lora=options.lora,
        # The router lists the adapters' folder (one adapter per subfolder) as the replicas see it.
        lora_dir=ADAPTERS_DIR if options.lora_pvc else None,
        lora_affinity=options.lora_affinity,
        otlp_traces_endpoint=options.otlp_traces_endpoint,
    )
    command = [*ROUTER_ENTRYPOINT, *router_flags(settings, [])]
    command += ["--discover", f"dns:{options.dns_name(VLLM_NAME)}:{REPLICA_PORT}"]
    command += ["--discover-kv-port", str(KV_EVENTS_PORT)]
    # GPUs are read from the agents: the router's pods have none.
    command += ["--discover-agents", f"dns:{options.dns_name(AGENT_NAME, options.agent_namespace)}:{AGENT_PORT}"]
    return command


def router_deployment(options: KubeOptions) -> dict[str, Any]:
    labels = _labels(ROUTER_NAME)
    container = {
        "name": "router",
        "image": options.router_image,
        # Tagged with the package's version, never `latest`: a tag is pulled once per node, and a local build
        # loaded into the nodes (kind load) is used as is.
        "imagePullPolicy": "IfNotPresent",
        "command": router_command(options),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
        # Bound to 0.0.0.0, the router refuses to start without API keys: the Secret must exist.
        "env": [
            _secret_env("DPSERVE_API_KEYS", options.keys_secret, API_KEYS_ENTRY, optional=False),
            # Routers follow each other with the admin key: with peers it must be there.
            _secret_env("DPSERVE_ADMIN_KEYS", options.keys_secret, ADMIN_KEYS_ENTRY, optional=not options.router_peers),
            # The key the vLLM pods require, sent with every request to them.
            _secret_env("DPSERVE_REPLICA_API_KEY", REPLICA_KEY_SECRET, REPLICA_KEY_ENTRY, optional=False),
        ],
        "resources": router_resources(options),
        # /ready answers 503 until a replica is healthy: a router with nothing behind it takes no traffic.
        "readinessProbe": _http_probe("/ready", ROUTER_PORT, 5, 2),
        "livenessProbe": _http_probe("/health", ROUTER_PORT, 10, 3),
        "lifecycle": _pre_stop(PRE_STOP_S["router"]),
        # Pod Security `restricted`, and a read-only root filesystem.
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": ROUTER_USER,
            "runAsGroup": ROUTER_USER,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # The root filesystem is read-only; whatever a library spools to a temporary file goes here.
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *_adapters_mounts(options)],
    }
    spread = {
        "weight": 100,
        "podAffinityTerm": {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(options, ROUTER_NAME, ROUTER_NAME),
        "spec": {
            "replicas": options.router_replicas,
            # A new router is ready before an old one is told to stop: a rolling restart never runs short.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": _scrape(ROUTER_PORT)},
                "spec": {
                    # Routers on different nodes where there are nodes enough: one node's loss leaves one.
                    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [spread]}},
                    # Longer than the preStop sleep and the router's own 30 s drain of in-flight requests on
                    # SIGTERM together: a stopping router finishes what it holds.
                    "terminationGracePeriodSeconds": 45,
                    "automountServiceAccountToken": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": ROUTER_USER,
                        "runAsGroup": ROUTER_USER,
                        "fsGroup": ROUTER_USER,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}, *_adapters_volumes(options)],
                },
            },
        },
    }


def router_resources(options: KubeOptions) -> dict[str, Any]:
    """One router process's share, times its workers: each is a process of its own, with its own KV index
    (up to about 1 GB at its default bound of 2M blocks). No CPU limit: a throttled router adds latency to
    every request it relays."""
    workers = options.router_workers
    request, limit = (f"{gib * workers}Gi" for gib in ROUTER_MEMORY_GIB)
    return {"requests": {"cpu": str(ROUTER_CPU * workers), "memory": request}, "limits": {"memory": limit}}


def router_disruption_budget(options: KubeOptions) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(options, ROUTER_NAME, ROUTER_NAME),
        "spec": {"minAvailable": 1, "selector": {"matchLabels": _labels(ROUTER_NAME)}},
    }


def vllm_disruption_budget(options: KubeOptions) -> dict[str, Any]:
    """A node drain takes one replica at a time: the others keep serving (and it cannot block a drain)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(options, VLLM_NAME, VLLM_NAME),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _labels(VLLM_NAME)}},
    }


def router_service(options: KubeOptions) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(options, ROUTER_NAME, ROUTER_NAME),
        "spec": {
            "type": "ClusterIP",
            "selector": _labels(ROUTER_NAME),
            "ports": [{"name": "http", "port": ROUTER_SERVICE_PORT, "targetPort": "http"}],
        },
    }


def router_peers_service(options: KubeOptions) -> dict[str, Any]:
    """Headless, for the routers themselves: their names resolve to every router pod's address. Not-ready
    pods too, so a starting router finds its peers (and is found) before it passes its readiness probe.
    Labelled apart from `dpserve-router`, so that its ServiceMonitor scrapes each router once."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(options, ROUTER_PEERS_NAME, ROUTER_PEERS_NAME),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": _labels(ROUTER_NAME),
            "ports": [{"name": "http", "port": ROUTER_PORT, "targetPort": ROUTER_PORT}],
        },
    }


def agent_command() -> list[str]:
    # $(NODE_NAME): expanded by the kubelet from the env below, so readings name the node, not the pod.
    return ["dpserve", "agent", "--port", str(AGENT_PORT), "--hostname", "$(NODE_NAME)"]


def agent_daemonset(options: KubeOptions) -> dict[str, Any]:
    labels = _labels(AGENT_NAME)
    container = {
        "name": "agent",
        "image": options.router_image,
        "imagePullPolicy": "IfNotPresent",
        "command": agent_command(),
        "ports": [{"name": "http", "containerPort": AGENT_PORT}],
        "env": [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            # NVML without taking a GPU: the NVIDIA runtime mounts the driver's library for every GPU, and
            # `utility` is NVML only (no CUDA). No GPU resource is requested, so vLLM keeps all of them.
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
            {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"},
        ],
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "readinessProbe": _http_probe("/health", AGENT_PORT, 10, 3),
        "livenessProbe": _http_probe("/health", AGENT_PORT, 20, 3),
        "securityContext": agent_security_context(),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _metadata(options, AGENT_NAME, AGENT_NAME, options.agent_namespace),
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": _scrape(AGENT_PORT)},
                "spec": {
                    # The host's process table: NVML reports host PIDs, mapped here to pods and listening ports.
                    # No way around it short of the kubelet's pod-resources socket, a hostPath (as privileged).
                    "hostPID": True,
                    "automountServiceAccountToken": False,
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "nodeSelector": {GPU_NODE_LABEL: "true"},
                    "tolerations": _gpu_tolerations(),
                    "containers": [container],
                },
            },
        },
    }


def agent_security_context() -> dict[str, Any]:
    """Root with CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH, nothing else: listing another user's /proc/PID/fd (which
    ports a GPU process listens on) needs the second, reading its links the first (unless that process runs
    as root with no more capabilities than the agent). Capabilities are root's only: a non-root user gets none
    of them. It cannot gain more, and writes nothing. Compose's agent is the same (test_compose_docker.py)."""
    return {
        "runAsUser": 0,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": list(AGENT_CAPABILITIES)},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def agent_service(options: KubeOptions) -> dict[str, Any]:
    # Headless: the routers' --discover-agents reads one address per agent pod.
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(options, AGENT_NAME, AGENT_NAME, options.agent_namespace),
        "spec": {
            "clusterIP": "None",
            "selector": _labels(AGENT_NAME),
            "ports": [{"name": "http", "port": AGENT_PORT, "targetPort": AGENT_PORT}],
        },
    }


def _network_policy(options: KubeOptions, name: str, namespace: str, ingress: list[dict[str, Any]]) -> dict[str, Any]:
    """Ingress to `name`'s pods only as `ingress` says (egress is not limited: vLLM downloads weights)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(options, name, name, namespace),
        "spec": {"podSelector": {"matchLabels": _labels(name)}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _ports(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def _prometheus_pods(options: KubeOptions) -> dict[str, Any]:
    namespace_labels = {"kubernetes.io/metadata.name": options.prometheus_namespace}
    return {
        "namespaceSelector": {"matchLabels": namespace_labels},
        "podSelector": {"matchLabels": PROMETHEUS_POD_LABELS},
    }


def _router_pods(options: KubeOptions) -> dict[str, Any]:
    namespace_labels = {"kubernetes.io/metadata.name": options.namespace}
    return {
        "namespaceSelector": {"matchLabels": namespace_labels},
        "podSelector": {"matchLabels": _labels(ROUTER_NAME)},
    }


def network_policies(options: KubeOptions) -> list[dict[str, Any]]:
    """The replicas' API (which has no key of the client's) and KV events only from the routers, their
    /metrics from Prometheus; the agents' readings to the routers and Prometheus; the routers' one port to
    any client. The agents read /proc, not the replicas' ports, so they need no way in. Probes come from
    the kubelet, on the node, which network policies do not stop."""
    return [
        _network_policy(
            options,
            VLLM_NAME,
            options.namespace,
            [
                {"from": [_router_pods(options)], "ports": _ports(REPLICA_PORT, KV_EVENTS_PORT)},
                {"from": [_prometheus_pods(options)], "ports": _ports(REPLICA_PORT)},
            ],
        ),
        _network_policy(options, ROUTER_NAME, options.namespace, [{"ports": _ports(ROUTER_PORT)}]),
        _network_policy(
            options,
            AGENT_NAME,
            options.agent_namespace,
            [{"from": [_router_pods(options), _prometheus_pods(options)], "ports": _ports(AGENT_PORT)}],
        ),
    ]


def service_monitor(options: KubeOptions, name: str) -> dict[str, Any]:
    """The Prometheus Operator's CRD (monitoring.coreos.com/v1): scrape the Service `name`'s `http` port."""
    namespace = options.agent_namespace if name == AGENT_NAME else options.namespace
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _metadata(options, name, name, namespace),
        "spec": {
            "selector": {"matchLabels": _labels(name)},
            "namespaceSelector": {"matchNames": [namespace]},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
        },
    }


def documents(options: KubeOptions) -> list[dict[str, Any]]:
    docs = [
        namespace(options),
        agent_namespace(options),
        vllm_statefulset(options),
        vllm_service(options),
        vllm_disruption_budget(options),
        router_deployment(options),
        router_disruption_budget(options),
        router_service(options),
        *([router_peers_service(options)] if options.router_peers else []),
        agent_daemonset(options),
        agent_service(options),
        *network_policies(options),
    ]
    if options.service_monitor:
        docs += [service_monitor(options, name) for name in (ROUTER_NAME, AGENT_NAME, VLLM_NAME)]
    return docs


def render(options: KubeOptions) -> str:
    ns = options.namespace
    header = (
        f"Generated by `dpserve kube {options.flags()}`; regenerate rather than edit.\n"
        "Create the Secrets first (they are never written here):\n"
        f"  kubectl create namespace {ns}\n"
        f"  kubectl -n {ns} create secret generic {options.keys_secret} "
        f'--from-literal={API_KEYS_ENTRY}="$API_KEYS" --from-literal={ADMIN_KEYS_ENTRY}="$ADMIN_KEYS"  # key1,key2\n'
        f"  kubectl -n {ns} create secret generic {REPLICA_KEY_SECRET} "
        f"--from-literal={REPLICA_KEY_ENTRY}=$(openssl rand -hex 32)  # vLLM's key, which only the routers send\n"
        f"  kubectl -n {ns} create secret generic {HF_TOKEN_SECRET} --from-literal=token=hf_...  "
        "# gated models only\n"
        "then: kubectl apply -f THIS_FILE\n"
        f"Router and agent run {options.router_image} (router/Dockerfile): push it where the cluster pulls from\n"
        "and pass --router-image REGISTRY/dpserve-router:TAG, or load it into each node (kind load, ctr import)."
    )
    docs = documents(options)
    return "---\n".join([dump(docs[0], header), *(dump(document) for document in docs[1:])])
