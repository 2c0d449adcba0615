"""Kubernetes manifests for a GPU cluster: `dpserve kube` writes them as one multi-document YAML.

- a StatefulSet `vllm`: N pods, each asking for one GPU, behind the headless Service `vllm` (one DNS
  address per ready pod);
- the router Deployment `dpserve-router`, which finds the replicas through that Service's DNS name
  (`--discover`; with `--tls`, each pod by its own name there, which its certificate covers) and the GPU
  agents through theirs (`--discover-agents`), with a PodDisruptionBudget and a ClusterIP Service; with more
  than one router, the headless Service `dpserve-router-peers`, through which each router finds the others
  (`--discover-peers`) to share routing state;
- the DaemonSet `dpserve-agent` on every GPU node: NVML readings for the routers, no GPU taken;
- NetworkPolicies, ingress and egress (kube_network.py): only the routers (and Prometheus, for /metrics) reach
  the replicas, which reach nothing but DNS unless told;
- optionally ServiceMonitors for the Prometheus Operator, and cert-manager Certificates for `--tls`;
- with `--autoscale A:B`, a KEDA ScaledObject or an HPA on the routers' desired-replicas signal
  (kube_autoscale.py).

Pod Security Standards: the namespace enforces `baseline`; the routers meet `restricted`. The agents need the
host's process table, which no level short of `privileged` allows: they run in a namespace of their own
(`<namespace>-gpu-agent`) that says so, so the main namespace's level holds for everything in it.

Keys never appear here: the routers read theirs as files from the Secret `dpserve-keys`, and the replicas' key
from the Secret `dpserve-replica-key`, which vLLM reads from its environment (its only way but the command line);
both made by hand with kubectl. With `--tls` the certificates come from Secrets too (kube_tls.py). With
`--metrics-key` the routers' /metrics wants the key in `dpserve-keys`'s entry `metrics-keys`, which their
ServiceMonitor sends.

Stops: each pod sleeps in preStop while the routers (or the Service) drop it, then drains what it runs (the
router's --shutdown-grace, vLLM's --shutdown-timeout) within a grace period longer than both together. An
autoscaler's scale-down stops vLLM pods the same way, with a longer drain by default (KubeOptions.drain_s).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpserve.config import RouterSettings
from dpserve.deploy.compose import (
    ADAPTERS_DIR,
    HF_CACHE_DIR,
    KV_EVENTS_PORT,
    REPLICA_PORT,
    ROUTER_DATA_DIR,
    ROUTER_DRAIN_S,
    ROUTER_ENTRYPOINT,
)
from dpserve.deploy.kube_autoscale import autoscale_header, autoscaler_documents, cold_start_flags
from dpserve.deploy.kube_network import network_policies
from dpserve.deploy.kube_options import (
    AGENT_NAME,
    AGENT_PORT,
    ROUTER_CPU,
    ROUTER_MEMORY_GIB,
    ROUTER_NAME,
    ROUTER_PEERS_NAME,
    ROUTER_PORT,
    ROUTER_SERVICE_PORT,
    VLLM_CPU_PER_GPU,
    VLLM_MEMORY_GIB_PER_GPU,
    VLLM_NAME,
    KubeOptions,
    labels,
    metadata,
)
from dpserve.deploy.kube_tls import (
    ROUTER_TLS_DIR,
    ROUTER_TLS_SECRET,
    VLLM_TLS_DIR,
    VLLM_TLS_SECRET,
    certificates,
    https_probe,
    replica_targets,
    tls_commands,
    tls_mount,
    tls_volume,
    vllm_tls_flags,
    with_router_tls,
)
from dpserve.deploy.yaml_text import dump
from dpserve.up.plan import LORA_RUNTIME_ENV, router_flags, told_max_num_seqs, vllm_engine_flags

__all__ = ["KubeOptions", "documents", "render"]

GPU_TAINT = "nvidia.com/gpu"
"""The taint GPU nodes usually carry (NVIDIA's GPU Operator, the managed clouds): tolerated by what runs there."""
GPU_NODE_LABEL = "nvidia.com/gpu.present"
"""Set by NVIDIA's GPU feature discovery on nodes with a GPU: where the agent runs."""
HF_TOKEN_SECRET = "hf-token"
API_KEYS_ENTRY = "api-keys"
ADMIN_KEYS_ENTRY = "admin-keys"
METRICS_KEYS_ENTRY = "metrics-keys"
"""With --metrics-key: the key that reads the routers' /metrics (--metrics-key-file), which Prometheus sends."""
REPLICA_KEY_SECRET = "dpserve-replica-key"
REPLICA_KEY_ENTRY = "key"
"""The key vLLM requires on /v1 (VLLM_API_KEY) and the routers send it (--replica-api-key-file)."""
KEYS_DIR = "/etc/dpserve/keys"
REPLICA_KEY_DIR = "/etc/dpserve/replica-key"
"""Where a router reads its keys: the Secrets' entries as files (whole-directory mounts, so a Secret changed
with kubectl reaches them within a minute), never in its environment."""
PRE_STOP_S = {"router": 5, "vllm": 10}
"""How long a pod keeps serving after it is told to stop, before SIGTERM: for the Service's endpoints (the
router) or the routers' DNS discovery, re-read every 5 s (a replica), to drop it first."""
VLLM_TEARDOWN_S = 20
"""After its drain, vLLM's engine teardown: its workers get 5 s, then SIGTERM and 5 s more (compose allows 30)."""
ROUTER_TEARDOWN_S = 10
"""After its drain (ROUTER_DRAIN_S, --shutdown-grace), the router closes its connections and exits."""
ADAPTERS_VOLUME = "lora-adapters"
STARTUP_PERIOD_S = 10
STARTUP_FAILURES = 180
"""10 s x 180: half an hour for the first start, which downloads the weights and compiles."""
ROUTER_USER = 65534
"""router/Dockerfile's USER (nobody)."""
AGENT_CAPABILITIES = ("SYS_PTRACE", "DAC_READ_SEARCH")
"""What the agent adds to nothing (agent_security_context says why each)."""


def _scrape(port: int, tls: bool = False, key: bool = False) -> dict[str, str]:
    # For Prometheus set up to scrape annotated pods (the common kubernetes-pods job). No annotation carries a
    # key: a /metrics behind one is left out of that job (it would be a target down), and scraped by a job
    # of its own that sends the key (docs/deploy.md) or the ServiceMonitor.
    if key:
        return {"prometheus.io/scrape": "false"}
    scrape = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}
    return {**scrape, "prometheus.io/scheme": "https"} if tls else scrape


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


def _secret_volume(name: str, secret: str, entries: tuple[str, ...]) -> dict[str, Any]:
    """These entries of `secret` as files, read by the router's group (fsGroup) only; a missing one stops the pod."""
    items = [{"key": entry, "path": entry} for entry in entries]
    return {"name": name, "secret": {"secretName": secret, "items": items, "defaultMode": 0o440}}


def _pod_security(level: str) -> dict[str, str]:
    """The Pod Security admission labels: pods below `level` are refused, and warned of at `kubectl apply`."""
    prefix = "pod-security.kubernetes.io/"
    return {f"{prefix}enforce": level, f"{prefix}enforce-version": "latest", f"{prefix}warn": level}


def namespace(options: KubeOptions) -> dict[str, Any]:
    # Baseline, not restricted: vLLM's image runs as root (see vllm_statefulset). The routers meet restricted.
    ns_labels = {"app.kubernetes.io/part-of": "dpserve", **_pod_security("baseline")}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": options.namespace, "labels": ns_labels}}


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
    """The vLLM container's command: what the manifests depend on. The flags given after `--` are its `args`."""
    command = ["vllm", "serve", options.model, "--host", "0.0.0.0", "--port", str(REPLICA_PORT)]
    command += ["--gpu-memory-utilization", f"{options.gpu_memory_utilization:g}"]
    # On SIGTERM (after the preStop sleep), what it runs finishes: vLLM's default, 0, aborts it.
    command += ["--shutdown-timeout", str(options.drain_s)]
    command += vllm_tls_flags() if options.tls else []
    # The same engine flags as `dpserve up` and compose: prefix caching, KV events on tcp://*:5557 (which the
    # router subscribes to at each pod's address), cached-token counts; LoRA when asked for. Those given after
    # `--` win (as on `dpserve up`): they are the container's args, and check_vllm_args refused those the
    # manifests depend on.
    flags = vllm_engine_flags(
        None,
        KV_EVENTS_PORT,
        options.max_model_len,
        options.vllm_args,
        enable_lora=options.lora_enabled,
        max_loras=options.max_loras,
        max_lora_rank=options.max_lora_rank,
        otlp_traces_endpoint=options.otlp_traces_endpoint,
        tensor_parallel_size=options.tensor_parallel_size,
    )
    return command + flags[: len(flags) - len(options.vllm_args)]


def vllm_resources(options: KubeOptions) -> dict[str, Any]:
    """One GPU per pod, or K (--tensor-parallel-size): the pod is the unit of data parallelism, and the device
    plugin pins its GPUs, all on one node. CPU and memory grow with its ranks (one process each) unless given.
    No CPU limit, and no memory limit unless given (the scan's waivers say why)."""
    size = options.tensor_parallel_size
    gpu = {options.gpu_resource: size}
    cpu = options.vllm_cpu or str(VLLM_CPU_PER_GPU * size)
    memory = options.vllm_memory or f"{VLLM_MEMORY_GIB_PER_GPU * size}Gi"
    limits = {"memory": options.vllm_memory_limit} if options.vllm_memory_limit else {}
    return {"requests": {"cpu": cpu, "memory": memory, **gpu}, "limits": {**limits, **gpu}}


def _vllm_volumes(options: KubeOptions) -> list[dict[str, Any]]:
    cache: dict[str, Any] = (
        {"persistentVolumeClaim": {"claimName": options.model_cache_pvc}}
        if options.model_cache_pvc
        else {"emptyDir": {"sizeLimit": options.hf_cache_size}}  # past it the kubelet evicts the pod
    )
    return [
        # PyTorch shares tensors between vLLM's processes through /dev/shm (compose: ipc host).
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
        {"name": "hf-cache", **cache},
        *_adapters_volumes(options),
        # Read by root only (vLLM's user).
        *([tls_volume(VLLM_TLS_SECRET, 0o400)] if options.tls else []),
    ]


def _probes(options: KubeOptions, port: int, ready: tuple[str, int], live_failures: int) -> dict[str, Any]:
    """Readiness (`ready`: its path and failures), liveness on /health every 10 s, and for vLLM a start-up
    probe; over HTTPS with --tls."""
    path, ready_failures = ready
    probes = {
        "readinessProbe": _http_probe(path, port, 5, ready_failures),
        "livenessProbe": _http_probe("/health", port, 10, live_failures),
    }
    if port == REPLICA_PORT:
        probes = {"startupProbe": _http_probe("/health", port, STARTUP_PERIOD_S, STARTUP_FAILURES), **probes}
    return {name: https_probe(probe) for name, probe in probes.items()} if options.tls else probes


def _adapters_mounts(options: KubeOptions) -> list[dict[str, Any]]:
    return [{"name": ADAPTERS_VOLUME, "mountPath": ADAPTERS_DIR, "readOnly": True}] if options.lora_pvc else []


def _adapters_volumes(options: KubeOptions) -> list[dict[str, Any]]:
    if not options.lora_pvc:
        return []
    return [{"name": ADAPTERS_VOLUME, "persistentVolumeClaim": {"claimName": options.lora_pvc, "readOnly": True}}]


def vllm_statefulset(options: KubeOptions) -> dict[str, Any]:
    container = {
        "name": "vllm",
        "image": options.image,
        "command": vllm_command(options),
        **({"args": list(options.vllm_args)} if options.vllm_args else {}),
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
            # Their NetworkPolicy lets them reach nothing but DNS unless told (--vllm-egress): the weights come
            # from the cache alone, with a clear error when missing rather than connections that time out.
            *([] if options.vllm_egress else [{"name": "HF_HUB_OFFLINE", "value": "1"}]),
        ],
        "resources": vllm_resources(options),
        **_probes(options, REPLICA_PORT, ("/health", 3), 6),
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
            *([tls_mount(VLLM_TLS_DIR)] if options.tls else []),
        ],
    }
    pod_labels = labels(VLLM_NAME)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(options, VLLM_NAME, VLLM_NAME),
        "spec": {
            # Autoscaled: no count here, or each `kubectl apply` would set it back, fighting the autoscaler (a
            # new StatefulSet starts at 1, and the autoscaler takes it from there).
            **({} if options.autoscaled else {"replicas": options.replicas}),
            "serviceName": VLLM_NAME,
            # Replicas are independent: start and replace them all at once, not one after another.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": pod_labels},
            "template": {
                "metadata": {"labels": pod_labels, "annotations": _scrape(REPLICA_PORT, options.tls)},
                "spec": {
                    # The preStop sleep, vLLM's drain (--shutdown-timeout), then its teardown.
                    "terminationGracePeriodSeconds": vllm_grace_period_s(options),
                    # Nothing here talks to the Kubernetes API.
                    "automountServiceAccountToken": False,
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "tolerations": _gpu_tolerations(),
                    "containers": [container],
                    "volumes": _vllm_volumes(options),
                },
            },
        },
    }


def vllm_grace_period_s(options: KubeOptions) -> int:
    """Longer than the preStop sleep, vLLM's drain and its teardown together: the kubelet never kills a
    replica finishing an answer."""
    return PRE_STOP_S["vllm"] + options.drain_s + VLLM_TEARDOWN_S


def router_grace_period_s() -> int:
    """Longer than the preStop sleep and the router's drain of in-flight requests on SIGTERM together."""
    return PRE_STOP_S["router"] + ROUTER_DRAIN_S + ROUTER_TEARDOWN_S


def vllm_service(options: KubeOptions) -> dict[str, Any]:
    # Headless: the name resolves to every ready pod's address, which is what the router's --discover reads,
    # and each ready pod has a name of its own under it (vllm-0.vllm.NS...), which --tls's routers use.
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(options, VLLM_NAME, VLLM_NAME),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": labels(VLLM_NAME),
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
        api_key_file=Path(KEYS_DIR, API_KEYS_ENTRY),
        admin_key_file=Path(KEYS_DIR, ADMIN_KEYS_ENTRY),
        replica_api_key_file=Path(REPLICA_KEY_DIR, REPLICA_KEY_ENTRY),
        metrics_key_file=Path(KEYS_DIR, METRICS_KEYS_ENTRY) if options.metrics_key else None,
        replica_max_num_seqs=told_max_num_seqs(options.vllm_args),
    )
    if options.tls:
        settings = with_router_tls(settings)
        # Each pod by its name, which its certificate covers (kube_tls.replica_targets says why not --discover).
        command = [*ROUTER_ENTRYPOINT, *router_flags(settings, replica_targets(options))]
    else:
        command = [*ROUTER_ENTRYPOINT, *router_flags(settings, [])]
        command += ["--discover", f"dns:{options.dns_name(VLLM_NAME)}:{REPLICA_PORT}"]
        command += ["--discover-kv-port", str(KV_EVENTS_PORT)]
    # GPUs are read from the agents: the router's pods have none.
    command += ["--discover-agents", f"dns:{options.dns_name(AGENT_NAME, options.agent_namespace)}:{AGENT_PORT}"]
    return command + cold_start_flags(options)


def router_deployment(options: KubeOptions) -> dict[str, Any]:
    pod_labels = labels(ROUTER_NAME)
    container = {
        "name": "router",
        "image": options.router_image,
        # Tagged with the package's version, never `latest`: a tag is pulled once per node, and a local build
        # loaded into the nodes (kind load) is used as is.
        "imagePullPolicy": "IfNotPresent",
        "command": router_command(options),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
        "resources": router_resources(options),
        # /ready answers 503 until a replica is healthy: a router with nothing behind it takes no traffic.
        **_probes(options, ROUTER_PORT, ("/ready", 2), 3),
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
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            # The batch store (the image's XDG_DATA_HOME): the pod's, outliving a restart of its container; a tier
            # of routers shares one PostgreSQL store instead (--batch-store postgresql://..., docs/batches.md).
            {"name": "data", "mountPath": ROUTER_DATA_DIR},
            {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True},
            {"name": "replica-key", "mountPath": REPLICA_KEY_DIR, "readOnly": True},
            *_adapters_mounts(options),
            *([tls_mount(ROUTER_TLS_DIR)] if options.tls else []),
        ],
    }
    spread = {
        "weight": 100,
        "podAffinityTerm": {"labelSelector": {"matchLabels": pod_labels}, "topologyKey": "kubernetes.io/hostname"},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(options, ROUTER_NAME, ROUTER_NAME),
        "spec": {
            "replicas": options.router_replicas,
            # A new router is ready before an old one is told to stop: a rolling restart never runs short.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "selector": {"matchLabels": pod_labels},
            "template": {
                "metadata": {
                    "labels": pod_labels,
                    "annotations": _scrape(ROUTER_PORT, options.tls, options.metrics_key),
                },
                "spec": {
                    # Routers on different nodes where there are nodes enough: one node's loss leaves one.
                    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [spread]}},
                    # A stopping router finishes what it holds.
                    "terminationGracePeriodSeconds": router_grace_period_s(),
                    "automountServiceAccountToken": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": ROUTER_USER,
                        "runAsGroup": ROUTER_USER,
                        "fsGroup": ROUTER_USER,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "volumes": [
                        {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}},
                        {"name": "data", "emptyDir": {"sizeLimit": "1Gi"}},
                        # Bound to 0.0.0.0, the router refuses to start without API keys; routers follow each
                        # other with the admin key; the vLLM pods require theirs: the pod waits for both Secrets.
                        _secret_volume("keys", options.keys_secret, _keys_entries(options)),
                        _secret_volume("replica-key", REPLICA_KEY_SECRET, (REPLICA_KEY_ENTRY,)),
                        *_adapters_volumes(options),
                        # Read by the router's group (fsGroup) only.
                        *([tls_volume(ROUTER_TLS_SECRET, 0o440)] if options.tls else []),
                    ],
                },
            },
        },
    }


def _keys_entries(options: KubeOptions) -> tuple[str, ...]:
    return (API_KEYS_ENTRY, ADMIN_KEYS_ENTRY, *((METRICS_KEYS_ENTRY,) if options.metrics_key else ()))


def router_resources(options: KubeOptions) -> dict[str, Any]:
    """One router process's share, times its workers, unless given: each is a process of its own, with its own
    KV index (up to about 1 GB at its default bound of 2M blocks). No CPU limit: a throttled router adds latency
    to every request it relays."""
    workers = options.router_workers
    request, limit = (f"{gib * workers}Gi" for gib in ROUTER_MEMORY_GIB)
    cpu = options.router_cpu or str(ROUTER_CPU * workers)
    memory = {"cpu": cpu, "memory": options.router_memory or request}
    return {"requests": memory, "limits": {"memory": options.router_memory_limit or limit}}


def router_disruption_budget(options: KubeOptions) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(options, ROUTER_NAME, ROUTER_NAME),
        "spec": {"minAvailable": 1, "selector": {"matchLabels": labels(ROUTER_NAME)}},
    }


def vllm_disruption_budget(options: KubeOptions) -> dict[str, Any]:
    """A node drain takes one replica at a time: the others keep serving (and it cannot block a drain).
    maxUnavailable, not minAvailable: with `--autoscale 0:B` there may be no pod, or one, which a minAvailable
    would forbid evicting; an autoscaler's scale-down is not an eviction, so the budget never holds it."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(options, VLLM_NAME, VLLM_NAME),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels(VLLM_NAME)}},
    }


def router_service(options: KubeOptions) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(options, ROUTER_NAME, ROUTER_NAME),
        "spec": {
            "type": "ClusterIP",
            "selector": labels(ROUTER_NAME),
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
        "metadata": metadata(options, ROUTER_PEERS_NAME, ROUTER_PEERS_NAME),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels(ROUTER_NAME),
            "ports": [{"name": "http", "port": ROUTER_PORT, "targetPort": ROUTER_PORT}],
        },
    }


def agent_command() -> list[str]:
    # $(NODE_NAME): expanded by the kubelet from the env below, so readings name the node, not the pod.
    return ["dpserve", "agent", "--port", str(AGENT_PORT), "--hostname", "$(NODE_NAME)"]


def agent_daemonset(options: KubeOptions) -> dict[str, Any]:
    pod_labels = labels(AGENT_NAME)
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
        "metadata": metadata(options, AGENT_NAME, AGENT_NAME, options.agent_namespace),
        "spec": {
            "selector": {"matchLabels": pod_labels},
            "template": {
                "metadata": {"labels": pod_labels, "annotations": _scrape(AGENT_PORT)},
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
        "metadata": metadata(options, AGENT_NAME, AGENT_NAME, options.agent_namespace),
        "spec": {
            "clusterIP": "None",
            "selector": labels(AGENT_NAME),
            "ports": [{"name": "http", "port": AGENT_PORT, "targetPort": AGENT_PORT}],
        },
    }


def service_monitor(options: KubeOptions, name: str) -> dict[str, Any]:
    """The Prometheus Operator's CRD (monitoring.coreos.com/v1): scrape the Service `name`'s `http` port."""
    namespace = options.agent_namespace if name == AGENT_NAME else options.namespace
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": metadata(options, name, name, namespace),
        "spec": {
            "selector": {"matchLabels": labels(name)},
            "namespaceSelector": {"matchNames": [namespace]},
            "endpoints": [_scrape_endpoint(options, name)],
        },
    }


def _scrape_endpoint(options: KubeOptions, name: str) -> dict[str, Any]:
    """With --tls, the routers and vLLM serve HTTPS: scraped over it, their certificate checked against the
    CA in their Secret (which the Prometheus Operator reads from the ServiceMonitor's namespace)."""
    endpoint: dict[str, Any] = {"port": "http", "path": "/metrics", "interval": "15s"}
    if options.metrics_key and name == ROUTER_NAME:
        # The key from the Secret's entry (the operator reads it from this namespace), as a bearer token.
        credentials = {"name": options.keys_secret, "key": METRICS_KEYS_ENTRY}
        endpoint["authorization"] = {"type": "Bearer", "credentials": credentials}
    if not options.tls or name == AGENT_NAME:
        return endpoint
    secret = ROUTER_TLS_SECRET if name == ROUTER_NAME else VLLM_TLS_SECRET
    ca = {"secret": {"name": secret, "key": "ca.crt"}}
    return {**endpoint, "scheme": "https", "tlsConfig": {"ca": ca, "serverName": options.dns_name(name)}}


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
    if options.issuer:
        docs += certificates(options)
    return docs + autoscaler_documents(options)


def _metrics_key_file(options: KubeOptions) -> str:
    # Prometheus sends the entry whole as its bearer token: one key in it.
    return f" --from-file={METRICS_KEYS_ENTRY}=metrics-key.txt" if options.metrics_key else ""


def _metrics_header(options: KubeOptions) -> str:
    if not options.metrics_key:
        return ""
    return (
        "The routers' /metrics wants the key in metrics-key.txt (one key: Prometheus sends the entry whole):\n"
        "the ServiceMonitor sends it; a scrape job of your own, with `authorization: credentials_file`.\n"
    )


def _tls_header(options: KubeOptions) -> str:
    if not options.tls:
        return ""
    if options.issuer:
        return f"TLS: cert-manager makes {ROUTER_TLS_SECRET} and {VLLM_TLS_SECRET} (the Certificates below).\n"
    commands = "".join(f"  {line}\n" for line in tls_commands(options))
    return (
        f"TLS: the Secrets {ROUTER_TLS_SECRET} and {VLLM_TLS_SECRET} (tls.crt, tls.key, ca.crt), from a CA of\n"
        "your own, in an empty folder (or pass --cert-manager-issuer NAME and let cert-manager make them):\n"
        + commands
        + f"Clients verify the routers against ca.crt, for {options.dns_name(ROUTER_NAME)}.\n"
    )


def _egress_header(options: KubeOptions) -> str:
    if options.model_cache_pvc or options.vllm_egress:
        return ""
    return (
        "The vLLM pods reach nothing but DNS (HF_HUB_OFFLINE=1): to download the weights, pass\n"
        "--vllm-egress 0.0.0.0/0:443 (or a narrower block), or fill a claim with them and pass --model-cache-pvc.\n"
    )


def render(options: KubeOptions) -> str:
    ns = options.namespace
    header = (
        f"Generated by `dpserve kube {options.flags()}`; regenerate rather than edit.\n"
        "Create the Secrets first (they are never written here):\n"
        f"  kubectl create namespace {ns}\n"
        f"  kubectl -n {ns} create secret generic {options.keys_secret} --from-file={API_KEYS_ENTRY}=api-keys.txt "
        f"--from-file={ADMIN_KEYS_ENTRY}=admin-keys.txt{_metrics_key_file(options)}"
        f"  # a [NAME:]KEY a line{'; metrics-key.txt: one key' if options.metrics_key else ''}\n"
        f"  kubectl -n {ns} create secret generic {REPLICA_KEY_SECRET} "
        f"--from-literal={REPLICA_KEY_ENTRY}=$(openssl rand -hex 32)  # vLLM's key, which only the routers send\n"
        f"  kubectl -n {ns} create secret generic {HF_TOKEN_SECRET} --from-literal=token=hf_...  "
        "# gated models only\n"
        + _metrics_header(options)
        + _tls_header(options)
        + _egress_header(options)
        + autoscale_header(options)
        + "then: kubectl apply -f THIS_FILE\n"
        f"Router and agent run {options.router_image} (router/Dockerfile): push it where the cluster pulls from\n"
        "and pass --router-image REGISTRY/dpserve-router:TAG, or load it into each node (kind load, ctr import)."
    )
    docs = documents(options)
    return "---\n".join([dump(docs[0], header), *(dump(document) for document in docs[1:])])
