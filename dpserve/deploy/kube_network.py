"""`dpserve kube`'s NetworkPolicies: who may reach each pod (ingress), and whom each pod may reach (egress).

- vLLM: reached by the routers (API and KV events) and Prometheus (/metrics); reaches DNS and nothing else
  unless told (`--vllm-egress CIDR[:PORT]`, e.g. Hugging Face for weights), and the OTLP endpoint if given;
- the routers: reached by their clients (`--router-clients`; default: pods of their own namespace), each
  other (peers) and Prometheus; reach the vLLM pods, each other, the GPU agents, DNS and the OTLP endpoint;
- the GPU agents: reached by the routers and Prometheus; reach nothing (they read NVML and /proc).

Probes come from the kubelet, on the node, which network policies do not stop."""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

from dpserve.deploy.compose import KV_EVENTS_PORT, REPLICA_PORT
from dpserve.deploy.kube_options import (
    AGENT_NAME,
    AGENT_PORT,
    ROUTER_NAME,
    ROUTER_PORT,
    VLLM_NAME,
    KubeOptions,
    labels,
    metadata,
)

PROMETHEUS_POD_LABELS = {"app.kubernetes.io/name": "prometheus"}
"""How the Prometheus Operator (and kube-prometheus-stack) labels Prometheus' pods: allowed to scrape."""
DNS_NAMESPACE = "kube-system"
DNS_POD_LABELS = {"k8s-app": "kube-dns"}
"""CoreDNS's pods, as kubeadm, kind and the managed clouds label them (kube-dns's label, kept by CoreDNS)."""
DNS_PORT = 53
OTLP_GRPC_PORT = 4317
NAMESPACE_LABEL = "kubernetes.io/metadata.name"
EVERYWHERE = ("0.0.0.0/0", "::/0")


def _ports(*ports: int, protocol: str = "TCP") -> list[dict[str, Any]]:
    return [{"protocol": protocol, "port": port} for port in ports]


def _pods(namespace: str, pod_labels: dict[str, str]) -> dict[str, Any]:
    """Pods with `pod_labels` (every pod: none) in `namespace`."""
    return {
        "namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: namespace}},
        "podSelector": {"matchLabels": dict(pod_labels)},
    }


def prometheus_pods(options: KubeOptions) -> dict[str, Any]:
    return _pods(options.prometheus_namespace, PROMETHEUS_POD_LABELS)


def router_pods(options: KubeOptions) -> dict[str, Any]:
    return _pods(options.namespace, labels(ROUTER_NAME))


def vllm_pods(options: KubeOptions) -> dict[str, Any]:
    return _pods(options.namespace, labels(VLLM_NAME))


def agent_pods(options: KubeOptions) -> dict[str, Any]:
    return _pods(options.agent_namespace, labels(AGENT_NAME))


def dns_rule() -> dict[str, Any]:
    return {
        "to": [_pods(DNS_NAMESPACE, DNS_POD_LABELS)],
        "ports": _ports(DNS_PORT, protocol="UDP") + _ports(DNS_PORT),
    }


def _blocks(cidrs: tuple[str, ...]) -> list[dict[str, Any]]:
    return [{"ipBlock": {"cidr": cidr}} for cidr in cidrs]


def otlp_rules(options: KubeOptions) -> list[dict[str, Any]]:
    """To the tracing endpoint, on its port: a Service's namespace (`NAME.NS[.svc...]`; a bare name is
    this namespace), an address, or, for a name outside the cluster, anywhere on that port."""
    if not options.otlp_traces_endpoint:
        return []
    parts = urlsplit(options.otlp_traces_endpoint)
    host = parts.hostname or ""
    port = parts.port or OTLP_GRPC_PORT
    try:
        address = ipaddress.ip_address(host)
        peers = _blocks((f"{address}/{address.max_prefixlen}",))
    except ValueError:
        labels_ = host.removesuffix(".svc.cluster.local").removesuffix(".svc").split(".")
        if len(labels_) <= 2:
            peers = [_pods(labels_[1] if len(labels_) == 2 else options.namespace, {})]
        else:
            peers = _blocks(EVERYWHERE)
    return [{"to": peers, "ports": _ports(port)}]


def vllm_egress_rules(options: KubeOptions) -> list[dict[str, Any]]:
    rules = [dns_rule(), *otlp_rules(options)]
    for egress in options.egress:
        rule: dict[str, Any] = {"to": _blocks((egress.cidr,))}
        if egress.port is not None:
            rule["ports"] = _ports(egress.port)
        rules.append(rule)
    return rules


def router_ingress_rules(options: KubeOptions) -> list[dict[str, Any]]:
    """Clients as `--router-clients` says (any source for `*`), and always the peers and Prometheus."""
    sources = []
    for clients in options.clients:
        if clients.namespace is None:
            return [{"ports": _ports(ROUTER_PORT)}]
        sources.append(_pods(clients.namespace, dict(clients.pod_labels)))
    sources += [router_pods(options), prometheus_pods(options)]
    unique = [source for index, source in enumerate(sources) if source not in sources[:index]]
    return [{"from": unique, "ports": _ports(ROUTER_PORT)}]


def router_egress_rules(options: KubeOptions) -> list[dict[str, Any]]:
    return [
        dns_rule(),
        {"to": [vllm_pods(options)], "ports": _ports(REPLICA_PORT, KV_EVENTS_PORT)},
        {"to": [router_pods(options)], "ports": _ports(ROUTER_PORT)},
        {"to": [agent_pods(options)], "ports": _ports(AGENT_PORT)},
        *otlp_rules(options),
    ]


def _network_policy(
    options: KubeOptions, name: str, namespace: str, ingress: list[dict[str, Any]], egress: list[dict[str, Any]]
) -> dict[str, Any]:
    """Ingress to `name`'s pods only as `ingress` says, egress from them only as `egress` says (none: none)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(options, name, name, namespace),
        "spec": {
            "podSelector": {"matchLabels": labels(name)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": egress,
        },
    }


def network_policies(options: KubeOptions) -> list[dict[str, Any]]:
    """The replicas' API and KV events only from the routers, their /metrics from Prometheus; the agents'
    readings to the routers and Prometheus; the routers' port to their clients, peers and Prometheus."""
    vllm_ingress = [
        {"from": [router_pods(options)], "ports": _ports(REPLICA_PORT, KV_EVENTS_PORT)},
        {"from": [prometheus_pods(options)], "ports": _ports(REPLICA_PORT)},
    ]
    agent_ingress = [{"from": [router_pods(options), prometheus_pods(options)], "ports": _ports(AGENT_PORT)}]
    return [
        _network_policy(options, VLLM_NAME, options.namespace, vllm_ingress, vllm_egress_rules(options)),
        _network_policy(
            options, ROUTER_NAME, options.namespace, router_ingress_rules(options), router_egress_rules(options)
        ),
        _network_policy(options, AGENT_NAME, options.agent_namespace, agent_ingress, []),
    ]
