"""Keys and TLS to replicas: the access object and its files, a refusing replica in the registry and in the
router's answers, `dpserve up`'s per-run key; and the hot path's client over TLS to a loopback server that
requires the test CA's client certificate."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dpserve.config import RouterSettings, UpSettings
from dpserve.replicas.access import KEY_REFUSED, ReplicaAccess, load_replica_access, replica_key, tls_refusal
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.http.errors import OpenAIError
from dpserve.router.http.upstream_client import (
    Address,
    Deadlines,
    ReplicaMisconfigured,
    UpstreamError,
    UpstreamPool,
    request_bytes,
)
from dpserve.router.routing.proxied_endpoints import resolve_model
from dpserve.up.plan import VLLM_KEY_ENV, plan_replicas, router_argv, router_env, with_replica_key
from tests.tls_certs import TlsFiles, make_tls_files

KEY = "replica-key-0123456789"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("pki"))


def test_the_key_goes_in_one_bearer_header_and_never_in_repr() -> None:
    access = ReplicaAccess(KEY)
    assert access.headers == {"Authorization": f"Bearer {KEY}"}
    assert KEY not in repr(access)
    wire = request_bytes(Address("h", 1), "POST", "/v1/chat/completions", b"{}", {"x": "1"}, access.header_lines)
    head, _, body = wire.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[-1] == f"Authorization: Bearer {KEY}".encode() and body == b"{}"
    assert ReplicaAccess().headers == {} and ReplicaAccess().header_lines == b""
    # Without a key, the request is exactly as before.
    assert request_bytes(Address("h", 1), "GET", "/health", b"", {}) == b"GET /health HTTP/1.1\r\nhost: h:1\r\n\r\n"


def test_the_key_comes_from_the_flag_or_its_file_once(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text(f"# the replicas' key\n\n{KEY}\nignored\n")
    assert replica_key(None, path) == KEY
    assert replica_key(KEY, None) == KEY
    assert replica_key(None, None) is None
    with pytest.raises(ValueError, match="not both"):
        replica_key(KEY, path)
    with pytest.raises(ValueError, match="without spaces"):
        replica_key("two words", None)
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no key in it"):
        replica_key(None, path)


def test_tls_files_are_checked_when_the_router_is_built(tmp_path: Path, pki: TlsFiles) -> None:
    with pytest.raises(ValueError, match="keys and TLS to replicas"):
        load_replica_access(None, tmp_path / "missing")
    with pytest.raises(ValueError, match="keys and TLS to replicas"):
        load_replica_access(None, None, ca_certs=tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="needs --replica-ssl-certfile"):
        load_replica_access(None, None, ca_certs=pki.ca_cert, keyfile=pki.client_key)
    access = load_replica_access(None, None, pki.ca_cert, pki.client_cert, pki.client_key)
    assert access.tls is not None and access.tls.verify_mode is ssl.CERT_REQUIRED and access.tls.check_hostname
    assert load_replica_access(None, None).tls is None  # the system's CAs, made when first needed


def test_tls_refusals_are_told_apart_from_other_failures() -> None:
    verify = ssl.SSLCertVerificationError(1, "certificate verify failed")
    verify.verify_message = "unable to get local issuer certificate"
    assert "failed verification (unable to get local issuer certificate)" in str(tls_refusal(verify))
    try:
        try:
            raise verify
        except ssl.SSLError as inner:
            raise ConnectionError("wrapped") from inner
    except ConnectionError as outer:
        assert "--replica-ssl-ca-certs" in str(tls_refusal(outer))
    assert "--replica-ssl-certfile" in str(tls_refusal(ssl.SSLError(1, "tlsv13 alert certificate required")))
    assert tls_refusal(ConnectionRefusedError(111, "refused")) is None
    assert tls_refusal(TimeoutError()) is None


def test_a_misconfigured_replica_leaves_routing_until_cleared() -> None:
    registry = ReplicaRegistry(["r0=http://127.0.0.1:1", "r1=http://127.0.0.1:2"])
    reshaped: list[int] = []
    registry.on_reshape(lambda: reshaped.append(1))
    for replica in registry:
        registry.probe_succeeded(replica.id)
    reshaped.clear()
    registry.set_misconfigured("r0", KEY_REFUSED)
    r0 = registry.get("r0")
    assert not r0.routable and r0.state == "misconfigured" and r0.last_error == KEY_REFUSED
    assert [r.id for r in registry.healthy()] == ["r1"] and [r.id for r in registry.misconfigured()] == ["r0"]
    registry.set_misconfigured("r0", KEY_REFUSED)  # the same cause again: nothing changes, nothing is told
    assert reshaped == [1]
    registry.set_misconfigured("r0", None)
    assert r0.routable and r0.state == "healthy" and reshaped == [1, 1]


def test_a_model_no_replica_serves_names_the_replicas_refusing_the_router() -> None:
    registry = ReplicaRegistry(["r0=http://127.0.0.1:1", "r1=http://127.0.0.1:2"])
    catalog = ModelCatalog(registry)
    catalog.set_model_cards("r1", ({"id": "other"},))
    registry.probe_succeeded("r1")
    registry.set_misconfigured("r0", KEY_REFUSED)  # its models never read: it may serve any
    with pytest.raises(OpenAIError) as refused:
        resolve_model(catalog, "tiny")
    error = refused.value
    assert error.status == 502 and error.code == "replica_misconfigured" and error.type == "server_error"
    assert f"replica r0: {KEY_REFUSED}" in error.message
    assert resolve_model(catalog, "other") == "other"  # the replicas that accept the router still serve
    # A refusing replica known to serve other models only is not the reason: the model does not exist.
    catalog.set_model_cards("r0", ({"id": "third"},))
    with pytest.raises(OpenAIError) as unknown:
        resolve_model(catalog, "tiny")
    assert unknown.value.status == 404


def test_dpserve_up_keys_vllm_replicas_in_their_environment_and_its_routers(tmp_path: Path) -> None:
    settings = with_replica_key(UpSettings(), generate=lambda: KEY)
    assert settings.router.replica_api_key == KEY
    (plan,) = plan_replicas(dataclasses.replace(settings, num_replicas=1), "/m", "tiny", 0, [0])
    assert plan.env[VLLM_KEY_ENV] == KEY
    assert router_env(settings.router)["DPSERVE_REPLICA_API_KEY"] == KEY
    argv = (*plan.argv, *router_argv(settings, [plan]))
    assert not [arg for arg in argv if KEY in arg or arg.startswith("--api-key")]
    # A key given (here in a file) is the one used, and the router gets the key, not the file.
    path = tmp_path / "key"
    path.write_text("from-a-file-0123\n")
    given = with_replica_key(UpSettings(router=RouterSettings(replica_api_key_file=path)), generate=lambda: KEY)
    assert given.router.replica_api_key == "from-a-file-0123" and given.router.replica_api_key_file is None


@pytest.mark.parametrize(
    "settings",
    [UpSettings(replica_key=False), UpSettings(sim_replicas=2), UpSettings(vllm_args=("--api-key", "users-own"))],
    ids=["no-replica-key", "sims", "vllm-api-key-given"],
)
def test_dpserve_up_makes_no_key_when_it_must_not(settings: UpSettings) -> None:
    keyed = with_replica_key(settings, generate=lambda: KEY)
    assert keyed == settings and VLLM_KEY_ENV not in plan_replicas(keyed, "/m", "tiny", 0, [0, 1])[0].env


@contextlib.asynccontextmanager
async def tls_replica(pki: TlsFiles, seen: list[bytes]) -> AsyncIterator[Address]:
    """A loopback server with the test CA's server certificate that requires a client certificate."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca_cert))
    context.load_cert_chain(str(pki.server_cert), str(pki.server_key))
    context.verify_mode = ssl.CERT_REQUIRED

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            seen.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=context)
    try:
        yield Address("127.0.0.1", server.sockets[0].getsockname()[1], tls=True)
    finally:
        server.close()


async def test_the_hot_path_client_speaks_mtls_and_sends_the_key(pki: TlsFiles) -> None:
    seen: list[bytes] = []
    async with tls_replica(pki, seen) as address:
        access = load_replica_access(KEY, None, pki.ca_cert, pki.client_cert, pki.client_key)
        pool = UpstreamPool(Deadlines(connect_s=5.0, read_s=5.0), access=access)
        response = await pool.request(address, "GET", "/v1/models", b"", {})
        assert response.status == 200 and await response.read() == b"ok"
        pool.close()
    assert f"Authorization: Bearer {KEY}".encode() in seen[0].split(b"\r\n")


async def test_a_replica_certificate_the_router_cannot_verify_is_a_misconfiguration(pki: TlsFiles) -> None:
    async with tls_replica(pki, []) as address:
        pool = UpstreamPool(Deadlines(connect_s=5.0, read_s=5.0), access=ReplicaAccess(KEY))  # the system's CAs
        with pytest.raises(ReplicaMisconfigured, match="certificate failed verification"):
            await pool.request(address, "GET", "/v1/models", b"", {})
        pool.close()


async def test_a_replica_refusing_a_missing_client_certificate_only_closes_the_connection(pki: TlsFiles) -> None:
    """A limit, held here so that it is known: with TLS 1.3 the handshake is over before the replica checks
    the client's certificate, and its refusal reaches asyncio (and aiohttp) as the connection closing, with no
    TLS error to tell it from a replica going away. So it is a failing replica (ejected), not a misconfigured one."""
    async with tls_replica(pki, []) as address:
        pool = UpstreamPool(Deadlines(connect_s=5.0, read_s=5.0), access=load_replica_access(KEY, None, pki.ca_cert))
        with pytest.raises(UpstreamError, match="closed the connection"):
            await pool.request(address, "GET", "/v1/models", b"", {})
        pool.close()
