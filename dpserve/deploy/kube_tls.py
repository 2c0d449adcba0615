"""`dpserve kube --tls`: HTTPS on every hop that carries requests or keys.

- clients to the routers: the router serves HTTPS only (`--ssl-certfile`), its certificate naming the
  routers' Service;
- the routers to vLLM: vLLM serves HTTPS (its own `--ssl-certfile`, reloaded when the Secret changes with
  `--enable-ssl-refresh`); each router names every pod by its StatefulSet DNS name
  (`https://vllm-0.vllm.NS.svc.cluster.local:8000`), which the replicas' certificate covers
  (`*.vllm.NS.svc.cluster.local`), and verifies it against the CA (`--replica-ssl-ca-certs`);
- router to router: a router serving HTTPS follows the peers it discovers over HTTPS, their certificate
  verified against its `--ssl-ca-certs` for the peers' Service name (router/peers/links.py).

The certificates come from two Secrets in the namespace, with cert-manager's layout (tls.crt, tls.key,
ca.crt): made by hand with the openssl commands the manifest's header lists (`tls_commands`), or by
cert-manager from the Certificates written with `--cert-manager-issuer` (`certificates`).

Left in the clear: the KV-event streams (vLLM's ZMQ publisher has no TLS; only the routers reach them, by
NetworkPolicy), the GPU agents' readings (no keys, no prompts), and the kubelet's probes (HTTPS, unverified:
the kubelet checks no certificate)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dpserve.config import RouterSettings
from dpserve.deploy.compose import KV_EVENTS_PORT, REPLICA_PORT
from dpserve.deploy.kube_options import (
    ROUTER_NAME,
    ROUTER_PEERS_NAME,
    VLLM_NAME,
    KubeOptions,
    metadata,
)
from dpserve.up.plan import RouterTarget

ROUTER_TLS_SECRET = "dpserve-router-tls"
VLLM_TLS_SECRET = "dpserve-vllm-tls"
TLS_VOLUME = "tls"
ROUTER_TLS_DIR = "/etc/dpserve/tls"
VLLM_TLS_DIR = "/etc/vllm/tls"
CERT, KEY, CA = "tls.crt", "tls.key", "ca.crt"
"""The Secrets' entries: cert-manager's names (and `kubectl create secret tls`'s, with the CA beside them)."""
CERT_DAYS = 90
CERT_MANAGER_DURATION = "2160h"
CERT_MANAGER_RENEW_BEFORE = "360h"


def router_names(options: KubeOptions) -> list[str]:
    """The routers' certificate: their Service as clients in the cluster name it, and the peers' Service."""
    service = ROUTER_NAME
    ns = options.namespace
    return [service, f"{service}.{ns}", f"{service}.{ns}.svc", options.dns_name(service), peers_name(options)]


def peers_name(options: KubeOptions) -> str:
    """The name a router checks a discovered peer's certificate for: the source it found it by."""
    return options.dns_name(ROUTER_PEERS_NAME)


def vllm_names(options: KubeOptions) -> list[str]:
    """Every vLLM pod by its StatefulSet name (vllm-N.vllm.NS.svc.cluster.local), and the Service."""
    return [f"*.{options.dns_name(VLLM_NAME)}", options.dns_name(VLLM_NAME)]


def replica_host(options: KubeOptions, index: int) -> str:
    return f"{VLLM_NAME}-{index}.{options.dns_name(VLLM_NAME)}"


def replica_targets(options: KubeOptions) -> list[RouterTarget]:
    """The vLLM pods as the routers are told of them with --tls: by name (a certificate can name a pod's DNS
    name, not its address, which changes with every restart). A pod not ready has no DNS record yet: the
    router's probes find it once it has."""
    return [
        RouterTarget(
            f"https://{replica_host(options, index)}:{REPLICA_PORT}",
            None,
            f"tcp://{replica_host(options, index)}:{KV_EVENTS_PORT}",
            name=f"{VLLM_NAME}-{index}",
        )
        for index in range(options.replicas)
    ]


def with_router_tls(settings: RouterSettings) -> RouterSettings:
    """The router's settings with --tls: HTTPS on its port, the CA for its peers and its replicas."""
    folder = Path(ROUTER_TLS_DIR)
    return dataclasses.replace(
        settings,
        ssl_certfile=folder / CERT,
        ssl_keyfile=folder / KEY,
        ssl_ca_certs=folder / CA,
        replica_ssl_ca_certs=folder / CA,
    )


def vllm_tls_flags() -> list[str]:
    """vLLM's own flags: HTTPS, the files read again when the Secret's mounted copy changes."""
    return [
        "--ssl-certfile",
        f"{VLLM_TLS_DIR}/{CERT}",
        "--ssl-keyfile",
        f"{VLLM_TLS_DIR}/{KEY}",
        "--enable-ssl-refresh",
    ]


def tls_mount(path: str) -> dict[str, Any]:
    # A whole-directory mount (no subPath): the kubelet swaps in a renewed Secret's files within a minute.
    return {"name": TLS_VOLUME, "mountPath": path, "readOnly": True}


def tls_volume(secret: str, mode: int) -> dict[str, Any]:
    return {"name": TLS_VOLUME, "secret": {"secretName": secret, "defaultMode": mode}}


def certificates(options: KubeOptions) -> list[dict[str, Any]]:
    """cert-manager's Certificates (cert-manager.io/v1) making both Secrets, renewed before they expire."""
    issuer = options.issuer
    assert issuer is not None
    kind, name = issuer
    return [
        _certificate(options, ROUTER_TLS_SECRET, ROUTER_NAME, router_names(options), kind, name),
        _certificate(options, VLLM_TLS_SECRET, VLLM_NAME, vllm_names(options), kind, name),
    ]


def _certificate(
    options: KubeOptions, secret: str, component: str, names: list[str], kind: str, issuer: str
) -> dict[str, Any]:
    return {
        "apiVersion": "cert-manager.io/v1",
        "kind": "Certificate",
        "metadata": metadata(options, secret, component),
        "spec": {
            "secretName": secret,
            "commonName": names[0],
            "dnsNames": names,
            # Client auth too: a router shows its certificate to a peer that asks for one (--ssl-cert-reqs).
            "usages": ["digital signature", "server auth", "client auth"],
            "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
            "duration": CERT_MANAGER_DURATION,
            "renewBefore": CERT_MANAGER_RENEW_BEFORE,
            "issuerRef": {"group": "cert-manager.io", "kind": kind, "name": issuer},
        },
    }


def tls_commands(options: KubeOptions) -> list[str]:
    """Shell commands making a CA and both Secrets with openssl (run in an empty folder; keep ca.key apart)."""
    ns = options.namespace
    ec = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes"
    lines = [
        f'openssl req -x509 {ec} -keyout ca.key -out ca.crt -days 3650 -subj "/CN=dpserve {ns} CA" '
        '-addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"'
    ]
    for part, secret, names in (
        ("router", ROUTER_TLS_SECRET, router_names(options)),
        ("vllm", VLLM_TLS_SECRET, vllm_names(options)),
    ):
        sans = ",".join(f"DNS:{name}" for name in names)
        lines += [
            f'openssl req -new {ec} -keyout {part}.key -out {part}.csr -subj "/CN={names[0]}"',
            f"printf 'subjectAltName={sans}\\nextendedKeyUsage=serverAuth,clientAuth\\n"
            f"keyUsage=critical,digitalSignature\\nbasicConstraints=CA:FALSE\\n"
            f"authorityKeyIdentifier=keyid\\n' > {part}.ext",
            f"openssl x509 -req -in {part}.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days {CERT_DAYS} "
            f"-extfile {part}.ext -out {part}.crt",
            f"kubectl -n {ns} create secret generic {secret} --from-file={CERT}={part}.crt "
            f"--from-file={KEY}={part}.key --from-file={CA}=ca.crt",
        ]
    return lines


def https_probe(probe: dict[str, Any]) -> dict[str, Any]:
    """An httpGet probe over HTTPS (the kubelet does not verify the certificate)."""
    return {**probe, "httpGet": {**probe["httpGet"], "scheme": "HTTPS"}}
