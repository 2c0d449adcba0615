"""`dpserve kube`: write the Kubernetes manifests (one multi-document YAML) for N GPU replicas.

Light on imports: the flags are added whenever the `dpserve` parser is built (any command); the manifests'
modules are imported only to write them."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpserve.deploy.kube_options import KubeOptions

RESOURCE_FLAGS = {
    "vllm_cpu": "a vLLM pod's CPU request (default 4 per GPU; never a limit)",
    "vllm_memory": "a vLLM pod's memory request (default 24Gi per GPU)",
    "vllm_memory_limit": "a vLLM pod's memory limit (default none: the model decides what loading takes)",
    "router_cpu": "a router pod's CPU request (default 1 per worker; never a limit)",
    "router_memory": "a router pod's memory request (default 1Gi per worker)",
    "router_memory_limit": "a router pod's memory limit (default 3Gi per worker)",
}
"""Pod resources, as Kubernetes quantities (8, 500m, 32Gi)."""
HARDENING_OPTIONS = (
    "max_model_len",
    "gpu_memory_utilization",
    "shutdown_timeout",
    *RESOURCE_FLAGS,
    "hf_cache_size",
    "router_clients",
    "vllm_egress",
    "tls",
    "cert_manager_issuer",
    "metrics_key",
    "autoscaler",
    "prometheus_url",
)
"""KubeOptions' fields that add_kube_flags adds flags of, by their names."""
AUTOSCALERS = ("keda", "hpa")
"""kube_options.AUTOSCALERS (not imported: this module stays light)."""


def parse_autoscale(text: str) -> tuple[int, int]:
    """`--autoscale A:B`: A >= 0 replicas at least (0: none while idle), B >= max(A, 1) at most."""
    low, colon, high = text.partition(":")
    if not colon or not low.strip().isdigit() or not high.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected A:B, the fewest and the most vLLM pods, e.g. 0:8")
    least, most = int(low), int(high)
    if most < max(least, 1):
        raise argparse.ArgumentTypeError(f"{text!r}: the most pods (B) must be at least 1 and at least A")
    return least, most


def add_replica_count_flags(group: argparse._MutuallyExclusiveGroup) -> None:
    """`--replicas N` or `--autoscale A:B` (one of them)."""
    group.add_argument("--replicas", type=int, help="vLLM pods, one GPU each (K with --tensor-parallel-size K)")
    group.add_argument(
        "--autoscale",
        type=parse_autoscale,
        metavar="A:B",
        help="instead of --replicas: from A to B vLLM pods (A may be 0), as the routers' dpserve_desired_replicas "
        "says, through KEDA or an HPA (--autoscaler)",
    )


def add_kube_flags(kube: argparse.ArgumentParser) -> None:
    """vLLM's engine sizes, the pods' resources, the NetworkPolicies', TLS's and the autoscaler's flags."""
    engine = kube.add_argument_group("vLLM engine (vLLM's flags; any other goes after `--`)")
    engine.add_argument("--max-model-len", type=int, metavar="N", help="context length (default 8192)")
    engine.add_argument(
        "--gpu-memory-utilization", type=float, metavar="FRACTION", help="of each GPU's memory (default 0.9)"
    )
    engine.add_argument(
        "--shutdown-timeout",
        type=int,
        metavar="SECONDS",
        help="on SIGTERM, what a replica runs gets this long to finish (default 30, as the routers' drain; 300 "
        "with --autoscale, whose scale-downs stop pods mid-stream); the pods' termination grace period is set "
        "above it",
    )
    resources = kube.add_argument_group("pod resources")
    for name, text in RESOURCE_FLAGS.items():
        resources.add_argument("--" + name.replace("_", "-"), metavar="QUANTITY", help=text)
    resources.add_argument(
        "--hf-cache-size",
        metavar="QUANTITY",
        help="sizeLimit of the emptyDir each vLLM pod downloads weights into (default 100Gi; not with "
        "--model-cache-pvc)",
    )
    network = kube.add_argument_group("network")
    network.add_argument(
        "--router-clients",
        action="append",
        metavar="NAMESPACE[:KEY=VALUE,...]",
        help="pods that may reach the routers: every pod of NAMESPACE, or those with these labels; '*': any "
        "source; repeatable (default: the routers' own namespace; peers and Prometheus always)",
    )
    network.add_argument(
        "--vllm-egress",
        action="append",
        metavar="CIDR[:PORT]",
        help="where else the vLLM pods may connect (default: DNS and the tracing endpoint only), e.g. "
        "0.0.0.0/0:443 to download weights; repeatable",
    )
    network.add_argument(
        "--tls",
        action="store_true",
        default=None,
        help="HTTPS on every hop: clients to routers, routers to vLLM, router to router; certificates from "
        "the Secrets dpserve-router-tls and dpserve-vllm-tls (the file's header says how to make them)",
    )
    network.add_argument(
        "--cert-manager-issuer",
        metavar="[ClusterIssuer/]NAME",
        help="with --tls: also write cert-manager Certificates that make (and renew) those Secrets",
    )
    network.add_argument(
        "--metrics-key",
        action="store_true",
        default=None,
        help="the routers' /metrics wants a key (Authorization: Bearer KEY): the entry metrics-keys of the keys "
        "Secret, which the ServiceMonitors send (the file's header says how to make it)",
    )
    _add_autoscale_flags(kube)


def _add_autoscale_flags(kube: argparse.ArgumentParser) -> None:
    scaling = kube.add_argument_group("autoscaling (with --autoscale A:B)")
    scaling.add_argument(
        "--autoscaler",
        choices=AUTOSCALERS,
        help="keda (default): a KEDA ScaledObject, which scales to zero; hpa: a HorizontalPodAutoscaler on the "
        "External metric dpserve_desired_replicas (an adapter such as prometheus-adapter serves it), one pod at "
        "least. Only the one chosen is written",
    )
    scaling.add_argument(
        "--prometheus-url",
        metavar="URL",
        help="the Prometheus KEDA asks (default: the Prometheus Operator's Service in --prometheus-namespace, "
        "http://prometheus-operated.NS.svc.cluster.local:9090)",
    )


def kube_flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The values of add_kube_flags' flags, by KubeOptions' field names (lists as tuples; None: not given), and
    --autoscale's (A, B), which kube_options takes."""
    values = {name: getattr(args, name, None) for name in (*HARDENING_OPTIONS, "autoscale")}
    return {name: tuple(value) if isinstance(value, list) else value for name, value in values.items()}


def kube_options(replicas: int | None, autoscale: tuple[int, int] | None = None, **given: Any) -> KubeOptions:
    """Flags left out (None) keep KubeOptions' defaults; a ValueError names the bad flag. `autoscale` (A, B)
    instead of `replicas`: B is then the most pods, `replicas`."""
    from dpserve.deploy.kube_options import KubeOptions

    if autoscale is not None:
        if replicas is not None:
            raise ValueError("--replicas and --autoscale: give one (--autoscale A:B scales from A to B pods)")
        given["autoscale_min"], replicas = autoscale
    if replicas is None:
        raise ValueError("give --replicas N or --autoscale A:B")
    names = {f.name for f in dataclasses.fields(KubeOptions)}
    unknown = set(given) - names
    if unknown:
        raise TypeError(f"not options of dpserve kube: {', '.join(sorted(unknown))}")
    return KubeOptions(replicas=replicas, **{name: value for name, value in given.items() if value is not None})


def run_kube(replicas: int | None, output: Path | None, **given: Any) -> int:
    from dpserve.deploy.kube import render

    try:
        options = kube_options(replicas, **given)
    except ValueError as exc:
        print(f"dpserve kube: {exc}", file=sys.stderr)
        return 2
    text = render(options)
    if output is None:
        sys.stdout.write(text)
        return 0
    output.write_text(text)
    tls = ", the TLS Secrets (the file's header says how)" if options.tls and not options.issuer else ""
    print(
        f"dpserve kube: wrote {output} ({_count(options)} replica(s) of {options.model}, "
        f"{options.tensor_parallel_size} GPU(s) each, namespace "
        f"{options.namespace}); create the Secret {options.keys_secret}{tls} first, then kubectl apply -f {output}",
        file=sys.stderr,
    )
    return 0


def _count(options: KubeOptions) -> str:
    return f"{options.autoscale_min} to {options.replicas}" if options.autoscaled else str(options.replicas)
