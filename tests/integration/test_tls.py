"""The router serving HTTPS (`--ssl-certfile`, `--ssl-keyfile`), and requiring client certificates
(`--ssl-ca-certs`, `--ssl-cert-reqs 2`), as one process and as `--workers 2`, in front of simulator
replicas; the certificates are made for the test (tests/tls_certs.py)."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from dpserve.replicas.prometheus_text import parse_samples
from tests.integration.conftest import RouterProcess, SimProcess, running_sim, start_router, stop_router
from tests.tls_certs import TlsFiles, make_tls_files

pytestmark = pytest.mark.integration

MODEL = "dpserve-tiny"
REQUESTS = 12
"""New connections per check: with two workers the kernel spreads them, so both serve some."""


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with running_sim("--speed", "0") as sim:
        yield sim


@pytest.fixture(scope="module", params=[1, 2], ids=["1-worker", "2-workers"])
def workers(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture(scope="module")
def https_router(sim: SimProcess, tls: TlsFiles, workers: int) -> Iterator[RouterProcess]:
    router = start_router(
        [sim.url], "least_loaded", *tls.server_flags(), "--workers", str(workers), tls=tls.client_context()
    )
    yield router
    stop_router(router)


@pytest.fixture(scope="module")
def mutual_tls_router(sim: SimProcess, tls: TlsFiles, workers: int) -> Iterator[RouterProcess]:
    flags = (*tls.server_flags(), "--ssl-ca-certs", str(tls.ca_cert), "--ssl-cert-reqs", str(int(ssl.CERT_REQUIRED)))
    router = start_router(
        [sim.url], "least_loaded", *flags, "--workers", str(workers), tls=tls.client_context(with_client_cert=True)
    )
    yield router
    stop_router(router)


def sdk_chat(url: str, context: ssl.SSLContext) -> str:
    """One chat completion through the official SDK, over a new connection verifying the router's certificate."""
    with httpx.Client(verify=context) as http:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", http_client=http, max_retries=0)
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    return answer.choices[0].message.content or ""


def plain_http_reply(url: str) -> bytes:
    """What the router's port sends back to a plain HTTP request, until it closes the connection."""
    port = int(url.rsplit(":", 1)[1])
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        while chunk := sock.recv(65536):
            received += chunk
    return received


def requests_counted(url: str, context: ssl.SSLContext) -> float:
    """dpserve_requests_total in one scrape: with workers, every worker's (read from its siblings' private
    ports, plain HTTP on loopback, whatever the shared port speaks)."""
    text = httpx.get(f"{url}/metrics", verify=context, timeout=10).text
    samples = parse_samples(text, ("dpserve_requests_total",))
    return sum(value for _, value in samples.by_name.get("dpserve_requests_total", []))


def test_an_https_client_trusting_the_ca_is_served(https_router: RouterProcess, tls: TlsFiles) -> None:
    url, context = https_router.url, tls.client_context()
    assert url.startswith("https://127.0.0.1:")
    before = requests_counted(url, context)
    for _ in range(REQUESTS):
        assert sdk_chat(url, context)
    assert httpx.get(f"{url}/health", verify=context, timeout=10).status_code == 200
    assert requests_counted(url, context) - before == REQUESTS
    # The certificate is checked: a client trusting only the system's CAs refuses the router's.
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{url}/health", timeout=10)


def test_plain_http_to_the_https_port_gets_no_http_answer(https_router: RouterProcess, tls: TlsFiles) -> None:
    plain_url = https_router.url.replace("https://", "http://")
    for _ in range(REQUESTS):
        reply = plain_http_reply(plain_url)
        # Closed without a byte, or at most a TLS alert record (type 21): never an HTTP status line.
        assert reply == b"" or reply[0] == 21, reply[:100]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{plain_url}/health", timeout=10)
    assert httpx.get(f"{https_router.url}/health", verify=tls.client_context(), timeout=10).status_code == 200


def test_required_client_certificates_refuse_a_client_without_one_and_serve_one_with_it(
    mutual_tls_router: RouterProcess, tls: TlsFiles, tmp_path: Path
) -> None:
    url = mutual_tls_router.url
    # A client certificate signed by another CA counts for nothing.
    stranger = make_tls_files(tmp_path, name="other")
    mixed = tls.client_context()
    mixed.load_cert_chain(stranger.client_cert, stranger.client_key)
    for refused in (tls.client_context(), mixed):
        for _ in range(4):  # new connections: with two workers, both refuse
            with pytest.raises(httpx.TransportError):
                httpx.get(f"{url}/health", verify=refused, timeout=10).raise_for_status()
        with httpx.Client(verify=refused) as http:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", http_client=http, max_retries=0)
            with pytest.raises(openai.APIConnectionError):
                client.models.list()
    served = tls.client_context(with_client_cert=True)
    before = requests_counted(url, served)
    for _ in range(REQUESTS):
        assert sdk_chat(url, served)
    assert httpx.get(f"{url}/health", verify=served, timeout=10).status_code == 200
    assert requests_counted(url, served) - before == REQUESTS
