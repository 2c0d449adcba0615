"""The real router process with API and admin keys, limits, admission control and the admin API,
in front of simulator replicas on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import psutil
import pytest

from dpserve.replicas.prometheus_text import parse_samples
from tests.conftest import free_port
from tests.integration.conftest import (
    RouterProcess,
    SimProcess,
    bearer,
    running_sim,
    start_router,
    stop_router,
)

pytestmark = pytest.mark.integration

USER_KEY = "user-key-for-tests-1"
OTHER_USER_KEY = "user-key-for-tests-2"
ADMIN_KEY = "admin-key-for-tests"
WATCHED = ("dpserve_admission_rejections_total", "dpserve_queue_wait_seconds_count")
CHAT = {"model": "dpserve-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with running_sim("--speed", "0") as sim:
        yield sim


@pytest.fixture(scope="module")
def keyed_router(sim: SimProcess) -> Iterator[RouterProcess]:
    router = start_router(
        [sim.url],
        "least_loaded",
        "--api-key",
        USER_KEY,
        "--api-key",
        OTHER_USER_KEY,
        "--admin-key",
        ADMIN_KEY,
        "--gpu-interval",
        "0",
        "--max-header-bytes",
        "4096",
        "--max-body-bytes",
        "65536",
        admin_key=ADMIN_KEY,
    )
    yield router
    stop_router(router)


def test_requests_without_a_valid_key_get_401(keyed_router: RouterProcess) -> None:
    url = keyed_router.url
    for headers in ({}, bearer("wrong-key-123456"), {"Authorization": USER_KEY}, {"Authorization": "Bearer"}):
        for response in (
            httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers),
            httpx.get(f"{url}/v1/models", headers=headers),
        ):
            assert response.status_code == 401, (headers, response.text)
            error = response.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert response.headers["www-authenticate"].startswith("Bearer")


def test_each_user_key_and_the_admin_key_are_served(keyed_router: RouterProcess) -> None:
    for key in (USER_KEY, OTHER_USER_KEY, ADMIN_KEY):
        response = httpx.post(f"{keyed_router.url}/v1/chat/completions", json=CHAT, headers=bearer(key), timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] is not None


def test_the_openai_sdk_sends_its_api_key_as_the_bearer_token(keyed_router: RouterProcess) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{keyed_router.url}/v1", api_key=USER_KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["dpserve-tiny"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_router.url}/v1", api_key="not-a-key-000", max_retries=0).models.list()


def test_probes_and_metrics_stay_public(keyed_router: RouterProcess) -> None:
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{keyed_router.url}{path}").status_code == 200, path


def test_a_user_key_on_the_admin_api_gets_403(keyed_router: RouterProcess) -> None:
    url = keyed_router.url
    for method, path in (("GET", "/admin/replicas"), ("POST", "/admin/replicas"), ("DELETE", "/admin/replicas/r0")):
        assert httpx.request(method, f"{url}{path}").status_code == 401
        response = httpx.request(method, f"{url}{path}", headers=bearer(USER_KEY))
        assert response.status_code == 403 and response.json()["error"]["type"] == "permission_error"
    # /status and /dashboard show replica URLs: admins only.
    assert httpx.get(f"{url}/status", headers=bearer(USER_KEY)).status_code == 403
    assert httpx.get(f"{url}/dashboard", headers=bearer(USER_KEY)).status_code == 403
    assert httpx.get(f"{url}/status", headers=bearer(ADMIN_KEY)).status_code == 200
    assert httpx.get(f"{url}/admin/replicas", headers=bearer(ADMIN_KEY)).status_code == 200


def test_oversized_headers_and_bodies_are_refused_and_the_router_serves_on(keyed_router: RouterProcess) -> None:
    url = keyed_router.url
    big_header = httpx.post(
        f"{url}/v1/chat/completions", json=CHAT, headers={**bearer(USER_KEY), "x-padding": "a" * 8000}
    )
    assert big_header.status_code == 431 and big_header.json()["error"]["code"] == "headers_too_large"
    big_body = httpx.post(
        f"{url}/v1/chat/completions",
        json={**CHAT, "messages": [{"role": "user", "content": "a" * 70000}]},
        headers=bearer(USER_KEY),
    )
    assert big_body.status_code == 413 and big_body.json()["error"]["code"] == "body_too_large"
    ok = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=bearer(USER_KEY), timeout=30)
    assert ok.status_code == 200


def test_an_endless_header_is_cut_off_without_filling_the_routers_memory(keyed_router: RouterProcess) -> None:
    router = psutil.Process(keyed_router.process.pid)
    before = router.memory_info().rss
    host, port = keyed_router.url.removeprefix("http://").split(":")
    sent_mib = 0
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        with contextlib.suppress(OSError):
            for _ in range(64):
                sock.sendall(b"a" * (1 << 20))
                sent_mib += 1
        answer = b""
        with contextlib.suppress(OSError):
            answer = sock.recv(4096)
    grown_mib = (router.memory_info().rss - before) / (1 << 20)
    assert sent_mib < 8, "the router kept reading an endless header"
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert grown_mib < 16, f"the router grew {grown_mib:.0f} MiB"
    assert httpx.get(f"{keyed_router.url}/health").status_code == 200


def test_without_keys_the_router_refuses_to_listen_beyond_loopback(sim: SimProcess) -> None:
    command = [sys.executable, "-m", "dpserve", "router", "--replica", sim.url, "--host", "0.0.0.0"]
    done = subprocess.run([*command, "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--insecure" in done.stderr and "--api-key" in done.stderr


def admin(router: RouterProcess, method: str, path: str, **kwargs: object) -> httpx.Response:
    return httpx.request(method, f"{router.url}{path}", headers=bearer(ADMIN_KEY), timeout=30, **kwargs)  # type: ignore[arg-type]


def served_by(router: RouterProcess, count: int) -> list[str]:
    replicas = []
    for _ in range(count):
        response = httpx.post(f"{router.url}/v1/chat/completions", json=CHAT, headers=bearer(USER_KEY), timeout=30)
        assert response.status_code == 200, response.text
        replicas.append(response.headers["x-dpserve-replica"])
    return replicas


def test_the_admin_api_adds_drains_resumes_and_removes_replicas(keyed_router: RouterProcess) -> None:
    with running_sim("--speed", "0") as second:
        # least_loaded reads no KV blocks: the replica's events are watched for liveness only, as a replica on
        # the command line's are (`dpserve up --max-replicas` adds its replicas so).
        asked = {"url": second.url + "/", "gpu": 1, "kv_events": second.kv_events}
        added = admin(keyed_router, "POST", "/admin/replicas", json=asked)
        assert added.status_code == 201, added.text
        new_id = added.json()["id"]
        assert added.json()["state"] == "healthy"  # probed at once
        # In rotation at once. (Not "both serve": least_loaded breaks equal loads by the emptier KV cache,
        # and until the next scrape r0 may still report blocks from earlier tests while the new one is empty,
        # so every one of these sequential requests can rightly go to the new replica. Once both report an
        # empty cache, ties go at random: with 6 requests all of them went to r0 one time in 64 (seen in a
        # full run), with 20 one time in a million. A new replica never chosen still fails every time. Drain
        # and removal below show each replica serving alone.)
        assert new_id in set(served_by(keyed_router, 20))

        assert admin(keyed_router, "POST", "/admin/replicas", json={"url": second.url}).status_code == 409
        drained = admin(keyed_router, "POST", "/admin/replicas/r0/drain")
        assert drained.status_code == 200 and drained.json()["state"] == "draining"
        assert set(served_by(keyed_router, 4)) == {new_id}
        assert admin(keyed_router, "POST", "/admin/replicas/r0/resume").json()["state"] == "healthy"

        removed = admin(keyed_router, "DELETE", f"/admin/replicas/{new_id}")
        assert removed.status_code == 200 and removed.json()["removed"] is True
        assert set(served_by(keyed_router, 4)) == {"r0"}
        listed = admin(keyed_router, "GET", "/admin/replicas").json()["replicas"]
        assert [r["id"] for r in listed] == ["r0"]


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/admin/replicas", b"not json", 400),
        ("POST", "/admin/replicas", b"[1, 2]", 400),
        ("POST", "/admin/replicas", b'{"url": "ftp://x:1"}', 400),
        ("POST", "/admin/replicas", b'{"url": "http://x:99999"}', 400),
        ("POST", "/admin/replicas", b'{"url": "http://x:1/v1"}', 400),
        ("POST", "/admin/replicas", b'{"url": "http://x:1", "weight": 2}', 400),
        ("POST", "/admin/replicas", b'{"url": "http://x:1", "gpu": ""}', 400),
        ("POST", "/admin/replicas/r99/drain", b"", 404),
        ("DELETE", "/admin/replicas/r99", b"", 404),
        ("PUT", "/admin/replicas", b"", 405),
    ],
)
def test_bad_admin_requests_get_clear_4xx(
    keyed_router: RouterProcess, method: str, path: str, body: bytes, status: int
) -> None:
    response = admin(keyed_router, method, path, content=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["message"]


async def test_admission_queues_then_refuses_with_429_and_retry_after() -> None:
    # One slot on one slow replica, a queue of one that waits 0.5 s at most.
    with running_sim("--decode-ms-per-token", "50", "--speed", "1") as slow:
        router = start_router(
            [slow.url],
            "least_loaded",
            "--max-in-flight",
            "1",
            "--queue-size",
            "1",
            "--queue-timeout",
            "0.5",
            "--gpu-interval",
            "0",
        )
        try:
            # Buffered answers wake every 16 tokens: 33 tokens take 2 x 16 x 50 ms, ~1.6 s.
            body = {**CHAT, "max_tokens": 33}
            async with httpx.AsyncClient(base_url=router.url, timeout=30) as client:
                first = asyncio.create_task(client.post("/v1/chat/completions", json=body))
                await until(client, lambda status: status["replicas"][0]["in_flight"] == 1)  # the one slot taken
                queued = asyncio.create_task(client.post("/v1/chat/completions", json=body))
                await until(client, lambda status: status["flow"]["queued"] == 1)  # the queue of one full
                full = await client.post("/v1/chat/completions", json=body)
                timed_out = await queued
                assert (await first).status_code == 200
                after = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
                metrics = parse_samples((await client.get("/metrics")).text, WATCHED)
        finally:
            stop_router(router)
    assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
    assert timed_out.status_code == 429 and timed_out.json()["error"]["code"] == "queue_timeout"
    assert int(full.headers["retry-after"]) >= 1 and int(timed_out.headers["retry-after"]) >= 1
    assert after.status_code == 200  # the router serves on once the slot is free
    rejections = {labels["reason"]: value for labels, value in metrics.by_name["dpserve_admission_rejections_total"]}
    assert rejections == {"queue_full": 1.0, "queue_timeout": 1.0}
    assert metrics.total("dpserve_queue_wait_seconds_count") == 2  # the first and the last were admitted


async def until(client: httpx.AsyncClient, holds: Callable[[dict[str, Any]], bool], timeout_s: float = 10.0) -> None:
    """Polls the router's /status until `holds` is true of it (TimeoutError after `timeout_s`)."""
    async with asyncio.timeout(timeout_s):
        while not holds((await client.get("/status")).json()):
            await asyncio.sleep(0.02)
