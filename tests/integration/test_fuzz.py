"""Fuzzing the real router process (with keys) in front of a simulator, from its own OpenAPI document:
thousands of malformed bodies, headers, paths and methods, then malformed HTTP on the wire. No answer
may be a 5xx, and the router must serve a valid request afterwards."""

from __future__ import annotations

import json
import socket
import string
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpserve.replicas.prometheus_text import parse_samples
from tests.integration.conftest import RouterProcess, bearer, running_sim, start_router, stop_router

pytestmark = pytest.mark.integration

USER_KEY = "fuzz-user-key-0001"
ADMIN_KEY = "fuzz-admin-key-0001"
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD")
# httpx sets these itself from the body and URL; the raw-socket test below mangles them instead.
RESERVED_HEADERS = {"content-length", "host", "transfer-encoding", "connection", "authorization", "content-type"}
# Paths whose admin-key calls change the fleet: fuzzed only without the admin key, so a random call
# cannot drain or remove the one replica (which would make the next answers rightful 503s).
FLEET_CHANGING = ("/drain", "/resume", "{replica_id}")


@dataclass
class Target:
    router: RouterProcess
    openapi: dict[str, Any]
    statuses: Counter[int] = field(default_factory=Counter)
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=30))


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    with running_sim("--speed", "0") as sim:
        router = start_router(
            [sim.url],
            "least_loaded",
            "--api-key",
            USER_KEY,
            "--admin-key",
            ADMIN_KEY,
            "--gpu-interval",
            "0",
            "--max-body-bytes",
            "65536",
            "--log-level",
            "warning",
            admin_key=ADMIN_KEY,
        )
        openapi = httpx.get(f"{router.url}/openapi.json", headers=bearer(USER_KEY)).json()
        target = Target(router, openapi)
        try:
            yield target
        finally:
            target.client.close()
            log = stop_router(router)
        assert "Traceback" not in log and "unhandled error" not in log, log[log.find("Traceback") - 500 :][:6000]


def json_values() -> st.SearchStrategy[Any]:
    leaves = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=30)
    )
    return st.recursive(
        leaves,
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
        max_leaves=12,
    )


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that mostly fit `schema` (as far as the router checks bodies), so bodies get past the
    first checks and into routing and the replica; `json_values` mixed in gives the misfits."""
    if "oneOf" in schema:
        return st.one_of([from_schema(option) for option in schema["oneOf"]])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}) for k in kind])
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=40)
    if kind == "integer":
        return st.integers(min_value=schema.get("minimum"), max_value=None) | st.integers(-5, 5)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {})), min_size=schema.get("minItems", 0), max_size=3)
    if kind == "object":
        properties = {name: from_schema(sub) | json_values() for name, sub in schema.get("properties", {}).items()}
        return st.fixed_dictionaries({}, optional=properties).flatmap(
            lambda known: st.dictionaries(st.text(max_size=8), json_values(), max_size=3).map(
                lambda extra: {**extra, **known}
            )
        )
    return json_values()


def dumps(value: Any) -> bytes:
    # The standard library's encoder: integers past 64 bits and lone surrogates (as \ud800) are fair game.
    return json.dumps(value).encode()


def body_schema(operation: dict[str, Any]) -> dict[str, Any] | None:
    content = operation.get("requestBody", {}).get("content", {})
    return content.get("application/json", {}).get("schema")


@st.composite
def fuzzed_request(draw: st.DrawFn, openapi: dict[str, Any]) -> dict[str, Any]:
    paths = openapi["paths"]
    # The OpenAI paths (with request schemas) three times over: most of the surface is there.
    with_bodies = [path for path, ops in paths.items() if any(body_schema(op) for op in ops.values())] * 3
    template = draw(st.sampled_from([*paths, *with_bodies, "/", "/v1", "/v1/chat", "/admin", "/../etc/passwd", None]))
    if template is None:
        path = "/" + quote(draw(st.text(max_size=40)), safe="/%")
        operations: dict[str, Any] = {}
    else:
        operations = paths.get(template, {})
        path = template
        while "{" in path:
            start, end = path.index("{"), path.index("}")
            path = path[:start] + quote(draw(st.text(min_size=1, max_size=20)), safe="") + path[end + 1 :]
    documented = [m.upper() for m in operations]
    method = draw(st.sampled_from(documented) if documented and draw(st.booleans()) else st.sampled_from(METHODS))
    schema = body_schema(operations.get(method.lower(), {}))
    bodies = [st.binary(max_size=300), json_values().map(dumps), st.just(b"")]
    if schema is not None:
        bodies.append(from_schema(schema).map(dumps))
        bodies.append(from_schema(schema).map(dumps))
    body = draw(st.one_of(bodies))
    # Mostly the right key, so most requests get past the key check into validation and routing.
    # (First in the list too: Hypothesis favours early choices.)
    keys = [*[f"Bearer {USER_KEY}"] * 6, None, "Bearer wrong-key-0000", "Basic Zm9vOmJhcg==", "Bearer"]
    if not any(marker in (template or "") for marker in FLEET_CHANGING):
        keys.append(f"Bearer {ADMIN_KEY}")
    headers = draw(
        st.dictionaries(
            st.text(string.ascii_letters + string.digits + "-", min_size=1, max_size=16).filter(
                lambda name: name.lower() not in RESERVED_HEADERS
            ),
            # Printable ASCII without edge spaces: what httpx lets through (the wire tests send the rest).
            st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60).map(str.strip),
            max_size=4,
        )
    )
    authorization = draw(st.sampled_from(keys))
    if authorization is not None:
        headers["Authorization"] = authorization
    content_type = draw(
        st.sampled_from(
            [None, "application/json", "application/json", "text/plain", "multipart/form-data; boundary=x", "x/y"]
        )
    )
    if content_type is not None:
        headers["Content-Type"] = content_type
    query = draw(st.dictionaries(st.text(max_size=8), st.text(max_size=12), max_size=2))
    return {"method": method, "path": path, "body": body, "headers": headers, "query": query}


@pytest.mark.timeout(600)
def test_thousands_of_malformed_requests_get_no_5xx(target: Target) -> None:
    @settings(
        max_examples=3000,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(request=fuzzed_request(target.openapi))
    def check(request: dict[str, Any]) -> None:
        response = target.client.request(
            request["method"],
            f"{target.router.url}{request['path']}",
            content=request["body"],
            headers=request["headers"],
            params=request["query"],
        )
        target.statuses[response.status_code] += 1
        assert response.status_code < 500, (request, response.status_code, response.text[:300])
        if response.status_code >= 400 and request["method"] != "HEAD":
            error = response.json()["error"]  # every refusal is OpenAI-shaped
            assert isinstance(error["message"], str) and error["message"]
            assert "127.0.0.1" not in response.text and "Traceback" not in response.text

    check()
    print(f"\nfuzz: {sum(target.statuses.values())} requests, statuses {dict(sorted(target.statuses.items()))}")
    assert sum(target.statuses.values()) >= 3000
    assert target.statuses[200] > 0 and target.statuses[401] > 0  # both the proxy and the key check were reached


WIRE_CASES = [
    b"GARBAGE\r\n\r\n",
    b"GET\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nbad header line\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\n: empty-name\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\nContent-Length: 20\r\n\r\n0123456789",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZZ\r\nxx\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n0\r\n\r\n",
    b"GET /\x00health HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX: \x01\x02\x7f\r\n\r\n",
    b"GET http://evil.example/health HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 200_000 + b"\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(3000)) + b"\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
    + USER_KEY.encode()
    # A body announced at 1 MiB over the 64 KiB limit: refused before it is read.
    + b"\r\nContent-Type: application/json\r\nContent-Length: 1048576\r\n\r\n{",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
    + USER_KEY.encode()
    # A body cut short: the client goes away; the router must simply drop it.
    + b'\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model":',
]


def send_raw(url: str, payload: bytes) -> bytes:
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the router may close on a bad request before it has read it all
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
    return b"".join(chunks)


@pytest.mark.parametrize("payload", WIRE_CASES, ids=range(len(WIRE_CASES)))
def test_malformed_http_on_the_wire_gets_a_4xx_or_a_closed_connection(target: Target, payload: bytes) -> None:
    answer = send_raw(target.router.url, payload)
    status_line = answer.split(b"\r\n", 1)[0]
    assert not status_line.startswith(b"HTTP/1.1 5"), answer[:500]
    if status_line:
        assert status_line.startswith(b"HTTP/1.1 4") or status_line.startswith(b"HTTP/1.1 200"), answer[:500]


@settings(max_examples=200, deadline=None, database=None)
@given(noise=st.binary(min_size=1, max_size=400))
def test_random_bytes_on_the_wire_get_no_5xx(target: Target, noise: bytes) -> None:
    answer = send_raw(target.router.url, noise)
    assert not answer.startswith(b"HTTP/1.1 5"), answer[:300]


def test_after_the_fuzzing_the_router_still_serves_and_never_answered_5xx(target: Target) -> None:
    url = target.router.url
    body = {"model": "dpserve-tiny", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=bearer(USER_KEY))
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
    samples = parse_samples(httpx.get(f"{url}/metrics").text, ("dpserve_requests_total",))
    statuses = Counter()
    for labels, value in samples.by_name["dpserve_requests_total"]:
        statuses[labels["status"]] += value
    assert not [s for s in statuses if s.startswith("5")], statuses
    assert target.router.process.poll() is None
