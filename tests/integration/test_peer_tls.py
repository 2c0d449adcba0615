"""Routers serving HTTPS follow the peers they discover over HTTPS, each peer's certificate checked against
the router's --ssl-ca-certs for the name it was found by (as `dpserve kube --tls` runs them): real router
processes on 127.0.0.x addresses, a real DNS server, and the certificates `dpserve kube --tls`'s header
makes with openssl."""

from __future__ import annotations

import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpserve.deploy.kube_options import KubeOptions
from dpserve.deploy.kube_tls import peers_name, tls_commands
from tests.integration.conftest import RouterProcess, router_status, running_sim, start_router, stop_router
from tests.integration.traffic import wait_for
from tests.tls_certs import make_tls_files

pytestmark = pytest.mark.integration

HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


def kube_certificates(folder: Path, options: KubeOptions) -> Path:
    """The header's openssl commands, run in `folder` (the kubectl ones left out: no cluster here)."""
    folder.mkdir()
    for line in tls_commands(options):
        if not line.startswith("kubectl "):
            subprocess.run(["bash", "-c", line], cwd=folder, check=True, capture_output=True, timeout=60)
    return folder


def client_context(ca: Path) -> ssl.SSLContext:
    """The test's own client: the CA checked, not the name (the routers' certificate names no address)."""
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False
    return context


def links(router: RouterProcess, tls: ssl.SSLContext) -> dict[str, dict[str, object]]:
    return {link["url"]: link for link in router_status(router.url, tls=tls)["peers"]["links"]}


def refusal(router: RouterProcess, tls: ssl.SSLContext, peer: str) -> bool:
    """Whether the router's last try to follow `peer` failed on its certificate (not on a peer still starting)."""
    return "CERTIFICATE_VERIFY_FAILED" in str(links(router, tls).get(peer, {}).get("last_error"))


@pytest.fixture
def replica() -> Iterator[str]:
    with running_sim() as sim:
        yield sim.url


def test_discovered_peers_are_followed_over_https_and_a_certificate_for_another_name_is_refused(
    tmp_path: Path, replica: str
) -> None:
    from tests.integration.hosts import dns_server, free_port_on

    options = KubeOptions(replicas=1, namespace="kt", tls=True)
    certs = kube_certificates(tmp_path / "certs", options)
    ca = certs / "ca.crt"
    tls = client_context(ca)
    port = free_port_on(*HOSTS)
    with dns_server(tmp_path) as dns:
        dns.set_records({peers_name(options): list(HOSTS)})
        discovery = [f"--discover-peers=dns:{peers_name(options)}:{port}", "--discover-nameserver", dns.nameserver]
        discovery += ["--discover-interval", "0.5", "--ssl-ca-certs", str(ca)]
        # Two routers with the routers' certificate, a third with the vLLM pods' (same CA, another name).
        served = {HOSTS[0]: "router", HOSTS[1]: "router", HOSTS[2]: "vllm"}
        started: list[RouterProcess] = []
        try:
            for host, cert in served.items():
                files = ["--ssl-certfile", str(certs / f"{cert}.crt"), "--ssl-keyfile", str(certs / f"{cert}.key")]
                started.append(
                    start_router([replica], "least_loaded", *discovery, *files, port=port, host=host, tls=tls)
                )
            a, b, c = started
            url = {host: f"https://{host}:{port}" for host in HOSTS}
            wait_for(lambda: links(a, tls).get(url[HOSTS[1]], {}).get("state") == "up", 15, "a following b")
            wait_for(lambda: links(b, tls).get(url[HOSTS[0]], {}).get("state") == "up", 15, "b following a")
            # c's certificate is the CA's, but not for the peers' name: a and b refuse it.
            for router in (a, b):
                wait_for(lambda r=router: refusal(r, tls, url[HOSTS[2]]), 15, "c refused")
                refused = links(router, tls)[url[HOSTS[2]]]
                assert refused["state"] != "up" and refused["updates"] == 0, refused
                assert "hostname mismatch" in str(refused["last_error"]).lower(), refused
            # c verifies a and b (their certificate names the peers' Service): it follows both. Itself it refuses
            # like any holder of its certificate (so it never learns the address is its own).
            wait_for(
                lambda: links(c, tls)[url[HOSTS[0]]]["state"] == links(c, tls)[url[HOSTS[1]]]["state"] == "up", 15, "c"
            )
            wait_for(lambda: refusal(c, tls, url[HOSTS[2]]), 15, "c refusing itself")
            assert all(link.startswith("https://") for router in started for link in links(router, tls))
            # Whom each router hears from: a and b each other only, c both.
            peers = {router.url: len(router_status(router.url, tls=tls)["peers"]["peers"]) for router in started}
            assert peers == {url[HOSTS[0]]: 1, url[HOSTS[1]]: 1, url[HOSTS[2]]: 2}, peers
        finally:
            for router in started:
                stop_router(router)


def test_a_router_with_another_ca_refuses_every_peer(tmp_path: Path, replica: str) -> None:
    from tests.integration.hosts import dns_server, free_port_on

    options = KubeOptions(replicas=1, namespace="kt", tls=True)
    certs = kube_certificates(tmp_path / "certs", options)
    other_ca = make_tls_files(tmp_path / "other", "other").ca_cert
    tls = client_context(certs / "ca.crt")
    port = free_port_on(*HOSTS[:2])
    with dns_server(tmp_path) as dns:
        dns.set_records({peers_name(options): list(HOSTS[:2])})
        discovery = [f"--discover-peers=dns:{peers_name(options)}:{port}", "--discover-nameserver", dns.nameserver]
        files = ["--ssl-certfile", str(certs / "router.crt"), "--ssl-keyfile", str(certs / "router.key")]
        started: list[RouterProcess] = []
        try:
            for host, ca in ((HOSTS[0], certs / "ca.crt"), (HOSTS[1], other_ca)):
                flags = [*discovery, "--discover-interval", "0.5", "--ssl-ca-certs", str(ca), *files]
                started.append(start_router([replica], "least_loaded", *flags, port=port, host=host, tls=tls))
            trusting, doubting = started
            first, second = (f"https://{host}:{port}" for host in HOSTS[:2])
            wait_for(lambda: links(trusting, tls).get(second, {}).get("state") == "up", 15, "the CA's router following")
            wait_for(lambda: refusal(doubting, tls, first), 15, "a refusal")
            refused = links(doubting, tls)[first]
            assert refused["state"] == "down" and refused["updates"] == 0, refused
            assert "CERTIFICATE_VERIFY_FAILED" in str(refused["last_error"]), refused
            assert "Hostname mismatch" not in str(refused["last_error"]), "refused for its CA, not its name"
        finally:
            for router in started:
                stop_router(router)
