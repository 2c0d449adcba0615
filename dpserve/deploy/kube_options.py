"""What `dpserve kube` is asked for (KubeOptions), checked before anything is written, and the names,
ports and labels every part of the manifests shares (kube.py, kube_network.py, kube_tls.py)."""

from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from dpserve.config import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    check_lora_engine,
    check_tensor_parallel_size,
    lora_adapters,
)
from dpserve.deploy.compose import DEFAULT_MODEL, DEFAULT_VLLM_IMAGE, router_image
from dpserve.up.vllm_args import flag_name, listed, value_of

DEFAULT_NAMESPACE = "dpserve"
DEFAULT_ROUTER_REPLICAS = 2
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_KEYS_SECRET = "dpserve-keys"
DEFAULT_PROMETHEUS_NAMESPACE = "monitoring"
PROMETHEUS_SERVICE = "prometheus-operated"
"""The Service the Prometheus Operator puts in front of every Prometheus it runs (port 9090), in its namespace."""
PROMETHEUS_PORT = 9090
AUTOSCALERS = ("keda", "hpa")
"""What --autoscale writes: a KEDA ScaledObject (scales to zero), or a plain HorizontalPodAutoscaler."""
AGENT_NAMESPACE_SUFFIX = "-gpu-agent"

VLLM_NAME = "vllm"
ROUTER_NAME = "dpserve-router"
ROUTER_PEERS_NAME = "dpserve-router-peers"
AGENT_NAME = "dpserve-agent"
ROUTER_PORT = 8080
ROUTER_SERVICE_PORT = 80
AGENT_PORT = 9400

MAX_MODEL_LEN = 8192
"""compose.yaml's default context length."""
GPU_MEMORY_UTILIZATION = 0.90
VLLM_CPU_PER_GPU = 4
VLLM_MEMORY_GIB_PER_GPU = 24
"""What a vLLM pod requests per GPU it has (one process per tensor-parallel rank)."""
VLLM_SHUTDOWN_TIMEOUT_S = 30
"""vLLM's --shutdown-timeout: on SIGTERM, what a replica runs gets this long to finish (vLLM's default, 0,
aborts it), as long as the routers' drain (--shutdown-grace)."""
AUTOSCALE_SHUTDOWN_TIMEOUT_S = 300
"""With --autoscale, scale-downs are routine, not a rare node drain: a pod let go finishes streams up to
5 minutes long (8192 tokens at 30 tokens/s). vLLM exits as soon as what it runs is done, so an idle pod is
not held, and the grace period stays under the 10 minutes the cluster autoscaler waits for a pod on a
node it removes."""
MAX_SHUTDOWN_TIMEOUT_S = 3600
HF_CACHE_SIZE = "100Gi"
"""The emptyDir a pod downloads weights into (no --model-cache-pvc): room for a 40B model in 16-bit weights."""
ROUTER_CPU = 1
"""Cores requested per router process (`--router-workers` multiplies it)."""
ROUTER_MEMORY_GIB = (1, 3)
"""Memory request and limit per router process: each holds its own KV index, about 1 GB at its default bound."""

ANY_SOURCE = "*"
"""--router-clients '*': any source may reach the routers' port (the cluster's pods and beyond it)."""

VLLM_FLAGS_OF_KUBE = {
    "--model": "--model",
    "--max-model-len": "--max-model-len",
    "--gpu-memory-utilization": "--gpu-memory-utilization",
    "--tensor-parallel-size": "--tensor-parallel-size",
    "-tp": "--tensor-parallel-size",
    "--enable-lora": "--enable-lora",
    "--max-loras": "--max-loras",
    "--max-lora-rank": "--max-lora-rank",
    "--otlp-traces-endpoint": "--otlp-traces-endpoint",
    "--shutdown-timeout": "--shutdown-timeout",
}
"""vLLM flags `dpserve kube` takes itself (it sizes the pod or tells the routers from them): not after `--`."""
VLLM_FLAGS_REFUSED = {
    "--host": "the pods' Service, probes and NetworkPolicies expect vLLM on 0.0.0.0:8000",
    "--port": "the pods' Service, probes and NetworkPolicies expect vLLM on 0.0.0.0:8000",
    "--api-key": "the key comes from the Secret dpserve-replica-key (VLLM_API_KEY), never from the manifest",
    "--kv-events-config": "the routers subscribe to each pod's KV events on port 5557",
    "--data-parallel-size": "a pod is one replica: ask for more with --replicas",
    "-dp": "a pod is one replica: ask for more with --replicas",
    "--ssl-keyfile": "give --tls: the certificates come from a Secret",
    "--ssl-certfile": "give --tls: the certificates come from a Secret",
    "--ssl-ca-certs": "give --tls: the certificates come from a Secret",
    "--ssl-cert-reqs": "the kubelet's HTTPS probes send no client certificate",
}
SERVED_MODEL_FLAG = "--served-model-name"
QUANTITY = re.compile(r"(?:\d+(?:\.\d+)?|\.\d+)(?:m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?")
LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
LABEL_KEY = re.compile(r"(?:[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
DNS_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")


@dataclass(frozen=True)
class Clients:
    """Who may reach the routers' port: pods of a namespace (all, or those with `pod_labels`), or any source."""

    namespace: str | None
    """None: any source at all."""
    pod_labels: tuple[tuple[str, str], ...] = ()


def parse_clients(text: str) -> Clients:
    """`--router-clients NAMESPACE[:KEY=VALUE,...]` or `*`; a ValueError saying what is wrong."""
    if text.strip() == ANY_SOURCE:
        return Clients(None)
    namespace, colon, labels = text.partition(":")
    if not DNS_LABEL.fullmatch(namespace):
        raise ValueError(f"--router-clients {text!r}: expected NAMESPACE[:KEY=VALUE,...] or '*'")
    pairs = []
    for pair in filter(None, labels.split(",")):
        key, equals, value = pair.partition("=")
        if not equals or not LABEL_KEY.fullmatch(key) or not LABEL_VALUE.fullmatch(value):
            raise ValueError(f"--router-clients {text!r}: {pair!r} is not a pod label KEY=VALUE")
        pairs.append((key, value))
    if colon and not pairs:
        raise ValueError(f"--router-clients {text!r}: no pod label after ':'")
    return Clients(namespace, tuple(pairs))


@dataclass(frozen=True)
class Egress:
    """An extra destination the vLLM pods may reach: an address block, on one port or all."""

    cidr: str
    port: int | None


def parse_egress(text: str) -> Egress:
    """`--vllm-egress CIDR[:PORT]` (an IPv6 block with a port: `[BLOCK]:PORT`)."""
    block, port = text.strip(), None
    if block.startswith("["):
        block, _, rest = block[1:].partition("]")
        port = rest.removeprefix(":") or None
    elif block.count(":") == 1:
        block, port = block.split(":")
    try:
        network = ipaddress.ip_network(block, strict=False)
    except ValueError:
        raise ValueError(f"--vllm-egress {text!r}: expected CIDR[:PORT], e.g. 0.0.0.0/0:443") from None
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"--vllm-egress {text!r}: {port!r} is not a port")
    return Egress(str(network), int(port) if port else None)


def check_vllm_args(args: tuple[str, ...]) -> None:
    """Flags after `--` go to every vLLM pod, but not those the manifests depend on: a ValueError naming it."""
    for arg in args:
        name = flag_name(arg)
        if (own := listed(name, VLLM_FLAGS_OF_KUBE)) is not None:
            raise ValueError(f"-- {arg}: give {VLLM_FLAGS_OF_KUBE[own]} to dpserve kube itself, before `--`")
        if (refused := listed(name, VLLM_FLAGS_REFUSED)) is not None:
            raise ValueError(f"-- {arg}: not for the vLLM pods ({VLLM_FLAGS_REFUSED[refused]})")


def check_quantity(flag: str, value: str | None) -> None:
    if value is not None and (not QUANTITY.fullmatch(value) or not re.search(r"[1-9]", value)):
        raise ValueError(f"{flag} {value!r}: expected a positive Kubernetes quantity, e.g. 8, 500m, 32Gi")


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
    vllm_args: tuple[str, ...] = ()
    """vLLM flags given after `--`: the vLLM container's `args`, after the command's own flags."""
    max_model_len: int = MAX_MODEL_LEN
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    vllm_cpu: str | None = None
    """A vLLM pod's CPU request (none: VLLM_CPU_PER_GPU a GPU); never a limit (CKV_K8S_11's waiver says why)."""
    vllm_memory: str | None = None
    """A vLLM pod's memory request (none: VLLM_MEMORY_GIB_PER_GPU a GPU)."""
    vllm_memory_limit: str | None = None
    """None: no limit (CKV_K8S_13's waiver says why)."""
    router_cpu: str | None = None
    router_memory: str | None = None
    router_memory_limit: str | None = None
    """A router pod's CPU and memory (none: ROUTER_CPU and ROUTER_MEMORY_GIB a worker)."""
    hf_cache_size: str = HF_CACHE_SIZE
    """The sizeLimit of the emptyDir weights are downloaded into (unused with `model_cache_pvc`)."""
    router_clients: tuple[str, ...] = ()
    """Who may reach the routers' port (`parse_clients`); none: the pods of the routers' own namespace."""
    vllm_egress: tuple[str, ...] = ()
    """Where else the vLLM pods may connect (`parse_egress`), e.g. Hugging Face for the weights."""
    tls: bool = False
    """HTTPS on every hop: clients to routers, routers to vLLM, router to router (kube_tls.py)."""
    cert_manager_issuer: str | None = None
    """`[Issuer|ClusterIssuer/]NAME`: also write cert-manager Certificates making the TLS Secrets."""
    metrics_key: bool = False
    """The routers' /metrics wants a key (--metrics-key-file, the keys Secret's `metrics-keys`), which the
    ServiceMonitor sends."""
    shutdown_timeout: int | None = None
    """vLLM's --shutdown-timeout (seconds; none: `drain_s`'s default): the pods' grace period is set above it."""
    autoscale_min: int | None = None
    """With a value, an autoscaler keeps between it and `replicas` vLLM pods (`--autoscale A:B`: A, and B is
    `replicas`, the most pods there may be) on the routers' dpserve_desired_replicas; none: `replicas` pods."""
    autoscaler: str = AUTOSCALERS[0]
    """What scales them (AUTOSCALERS): KEDA, or a HorizontalPodAutoscaler on an external-metrics adapter."""
    prometheus_url: str | None = None
    """Where KEDA asks Prometheus for dpserve_desired_replicas; none: the Prometheus Operator's Service in
    `prometheus_namespace`."""

    def __post_init__(self) -> None:
        self._check_autoscale()  # first: its count is named as given (--autoscale A:B), not as --replicas B
        for flag, count, what in (
            ("--replicas", self.replicas, "vLLM replica"),
            ("--router-replicas", self.router_replicas, "router"),
            ("--router-workers", self.router_workers, "worker"),
            ("--max-model-len", self.max_model_len, "token"),
        ):
            if count < 1:
                raise ValueError(f"{flag} {count}: at least one {what}")
        for flag, value in (
            ("--model", self.model),
            ("--namespace", self.namespace),
            ("--image", self.image),
            ("--router-image", self.router_image),
            ("--gpu-resource", self.gpu_resource),
            ("--model-cache-pvc", self.model_cache_pvc),
            ("--lora-pvc", self.lora_pvc),
            ("--prometheus-namespace", self.prometheus_namespace),
            ("--cert-manager-issuer", self.cert_manager_issuer),
        ):
            if value is not None and not value.strip():
                raise ValueError(f"{flag} must not be empty")
        if self.shutdown_timeout is not None and not 0 <= self.shutdown_timeout <= MAX_SHUTDOWN_TIMEOUT_S:
            raise ValueError(f"--shutdown-timeout {self.shutdown_timeout}: seconds from 0 to {MAX_SHUTDOWN_TIMEOUT_S}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization {self.gpu_memory_utilization}: a fraction in (0, 1]")
        for flag, quantity in (
            ("--vllm-cpu", self.vllm_cpu),
            ("--vllm-memory", self.vllm_memory),
            ("--vllm-memory-limit", self.vllm_memory_limit),
            ("--router-cpu", self.router_cpu),
            ("--router-memory", self.router_memory),
            ("--router-memory-limit", self.router_memory_limit),
            ("--hf-cache-size", self.hf_cache_size),
        ):
            check_quantity(flag, quantity)
        if self.cert_manager_issuer and not self.tls:
            raise ValueError("--cert-manager-issuer makes the TLS Secrets: it needs --tls")
        lora_adapters(self.lora)
        check_lora_engine(self.max_loras, self.max_lora_rank)
        check_tensor_parallel_size(self.tensor_parallel_size)
        check_vllm_args(self.vllm_args)
        # Each parses or raises: a bad one is refused here, not when the manifests are written.
        for parse, given in ((parse_clients, self.router_clients), (parse_egress, self.vllm_egress)):
            for text in given:
                parse(text)
        _ = self.issuer

    def _check_autoscale(self) -> None:
        low, high = self.autoscale_min, self.replicas
        if low is not None and low < 0:
            raise ValueError(f"--autoscale {low}:{high}: at least 0 replicas")
        if low is not None and high < max(low, 1):
            raise ValueError(f"--autoscale {low}:{high}: the most replicas must be at least {max(low, 1)}")
        if self.autoscaler not in AUTOSCALERS:
            raise ValueError(f"--autoscaler {self.autoscaler!r}: one of {', '.join(AUTOSCALERS)}")
        if self.autoscaler != AUTOSCALERS[0] and low is None:
            raise ValueError(f"--autoscaler {self.autoscaler} chooses what scales the replicas: give --autoscale A:B")
        if self.prometheus_url is None:
            return
        if low is None:
            raise ValueError("--prometheus-url is where KEDA reads the routers' signal: give --autoscale A:B")
        if self.autoscaler != "keda":
            raise ValueError("--prometheus-url is KEDA's: an HPA reads the metrics adapter, which has its own")
        parts = urlsplit(self.prometheus_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--prometheus-url {self.prometheus_url!r}: expected http(s)://HOST[:PORT][/PATH]")

    @property
    def autoscaled(self) -> bool:
        return self.autoscale_min is not None

    @property
    def scales_to_zero(self) -> bool:
        """KEDA with `--autoscale 0:B`: no vLLM pod while idle (a plain HPA keeps one at least)."""
        return self.autoscale_min == 0 and self.autoscaler == "keda"

    @property
    def drain_s(self) -> int:
        """vLLM's --shutdown-timeout: as given, else as long as the routers' drain, or longer with --autoscale."""
        if self.shutdown_timeout is not None:
            return self.shutdown_timeout
        return AUTOSCALE_SHUTDOWN_TIMEOUT_S if self.autoscaled else VLLM_SHUTDOWN_TIMEOUT_S

    @property
    def served_model(self) -> str:
        """The model's name to clients and in the routers' per-model series: vLLM's --served-model-name if
        given after `--` (its first name), else the model."""
        return value_of(self.vllm_args, SERVED_MODEL_FLAG) or self.model

    @property
    def prometheus_address(self) -> str:
        if self.prometheus_url:
            return self.prometheus_url
        return f"http://{self.dns_name(PROMETHEUS_SERVICE, self.prometheus_namespace)}:{PROMETHEUS_PORT}"

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora or self.lora_pvc)

    @property
    def clients(self) -> tuple[Clients, ...]:
        """Who may reach the routers: as given, else the routers' own namespace."""
        return tuple(parse_clients(text) for text in self.router_clients) or (Clients(self.namespace),)

    @property
    def egress(self) -> tuple[Egress, ...]:
        return tuple(parse_egress(text) for text in self.vllm_egress)

    @property
    def issuer(self) -> tuple[str, str] | None:
        """cert-manager's issuerRef (kind, name), from `[KIND/]NAME`."""
        if not self.cert_manager_issuer:
            return None
        kind, _, name = self.cert_manager_issuer.rpartition("/")
        if kind not in ("", "Issuer", "ClusterIssuer") or not name:
            raise ValueError(
                f"--cert-manager-issuer {self.cert_manager_issuer!r}: expected [Issuer|ClusterIssuer/]NAME"
            )
        return kind or "Issuer", name

    def flags(self) -> str:
        """The command line that writes these manifests, as their header says (defaults left out but these)."""
        low, high = self.autoscale_min, self.replicas
        flags = f"--autoscale {low}:{high}" if low is not None else f"--replicas {high}"
        flags += f" --model {self.model}"
        flags += f" --autoscaler {self.autoscaler}" if self.autoscaler != AUTOSCALERS[0] else ""
        size = self.tensor_parallel_size
        flags += f" --tensor-parallel-size {size}" if size != 1 else ""
        flags += " --tls" if self.tls else ""
        flags += " --metrics-key" if self.metrics_key else ""
        return flags + (" -- " + shlex.join(self.vllm_args) if self.vllm_args else "")

    def dns_name(self, service: str, namespace: str | None = None) -> str:
        return f"{service}.{namespace or self.namespace}.svc.cluster.local"

    @property
    def agent_namespace(self) -> str:
        return self.namespace + AGENT_NAMESPACE_SUFFIX

    @property
    def router_peers(self) -> bool:
        """Whether the routers look for each other (`--discover-peers`): only when there is more than one."""
        return self.router_replicas > 1


def labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": component, "app.kubernetes.io/part-of": "dpserve"}


def metadata(options: KubeOptions, name: str, component: str, namespace: str | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": namespace or options.namespace, "labels": labels(component)}
