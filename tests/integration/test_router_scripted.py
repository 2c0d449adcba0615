"""The router against scripted stand-in replicas, for failures real vLLM cannot be made to show on demand:
a 5xx before the first byte, a stream cut mid-response, replicas serving different models."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web
from fastapi import FastAPI

from dpserve.config import RouterSettings
from dpserve.replicas.prometheus_text import parse_samples
from dpserve.router.app import create_app
from tests.conftest import free_port, serving

pytestmark = pytest.mark.integration


@dataclass
class ScriptedReplica:
    model: str = "m"
    mode: str = "ok"  # ok | http_500 | http_429 | cut_stream | not_found | text_502 | slow_stream
    hits: collections.Counter[str] = field(default_factory=collections.Counter)
    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    """Every completion request's body as the replica received it."""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._completions)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text='vllm:num_requests_running{engine="0"} 0.0\n')

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.hits[self.mode] += 1
        if self.mode == "http_500":
            return web.json_response({"error": {"message": "engine dead"}}, status=500)
        if self.mode == "http_429":
            return web.json_response({"error": {"message": "too many requests"}}, status=429)
        if self.mode == "not_found":
            return web.json_response({"detail": "Not Found"}, status=404)
        if self.mode == "text_502":
            return web.Response(text="upstream proxy exploded", status=502, content_type="text/plain")
        if not body.get("stream"):
            return web.json_response({"object": "text_completion", "model": self.model, "choices": [{"text": "hi"}]})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for index in range(5):
            await response.write(b"data: " + orjson.dumps({"choices": [{"text": str(index)}]}) + b"\n\n")
            if self.mode == "slow_stream":
                await asyncio.sleep(0.2)
            if self.mode == "cut_stream" and index == 2:
                await response.write(b'data: {"half an ev')  # then the replica "dies" mid-event
                assert request.transport is not None
                request.transport.close()
                return response
        await response.write(b"data: [DONE]\n\n")
        return response


@contextlib.asynccontextmanager
async def running(
    replicas: list[ScriptedReplica],
    policy: str = "round_robin",
    extra_urls: tuple[str, ...] = (),
    apps: list[FastAPI] | None = None,
    **overrides: Any,
) -> AsyncIterator[str]:
    """`apps`, when given, receives the router's app (to reach its state)."""
    runners = []
    for replica in replicas:
        runner = web.AppRunner(replica.app())
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        replica.url = f"http://127.0.0.1:{port}"
        runners.append(runner)
    settings = RouterSettings(
        replicas=tuple(f"r{i}={url}" for i, url in enumerate([*[r.url for r in replicas], *extra_urls])),
        policy=policy,
        probe_interval_s=0.2,
        **overrides,
    )
    app = create_app(settings)
    if apps is not None:
        apps.append(app)
    try:
        async with serving(app) as url:
            yield url
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_a_5xx_before_the_first_byte_is_retried_and_repeated_5xx_eject_the_replica() -> None:
    broken, good = ScriptedReplica(mode="http_500"), ScriptedReplica()
    # Its /health still says 200: a high rise threshold keeps the probes from re-admitting it mid-test.
    async with running([broken, good], rise_threshold=1000) as url, httpx.AsyncClient() as client:
        for _ in range(8):
            response = await client.post(f"{url}/v1/completions", json={"prompt": "x"})
            assert response.status_code == 200
            assert response.headers["x-dpserve-replica"] == "r1"
        metrics = (await client.get(f"{url}/metrics")).text
        status = (await client.get(f"{url}/status")).json()
    # Each 500 costs one retry, never a failure; three in a row (passive_fail_threshold) eject r0.
    assert broken.hits["http_500"] == 3 and good.hits["ok"] == 8
    assert 'dpserve_retries_total{reason="http_500"} 3.0' in metrics
    assert 'dpserve_replica_ejections_total{replica="r0"} 1.0' in metrics
    assert [r["state"] for r in status["replicas"]] == ["ejected", "healthy"]


async def test_5xx_never_eject_the_only_replica_left() -> None:
    replica = ScriptedReplica(mode="http_500")
    async with running([replica]) as url, httpx.AsyncClient() as client:
        statuses = [(await client.post(f"{url}/v1/completions", json={"prompt": "x"})).status_code for _ in range(6)]
        status = (await client.get(f"{url}/status")).json()
    # Its 500s reach the clients as they are; the replica stays in routing (its probes pass).
    assert statuses == [500] * 6 and status["replicas"][0]["state"] == "healthy"


async def test_4xx_from_a_replica_never_counts_against_it() -> None:
    replica = ScriptedReplica(mode="not_found")
    async with running([replica]) as url, httpx.AsyncClient() as client:
        statuses = [(await client.post(f"{url}/v1/completions", json={"prompt": "x"})).status_code for _ in range(10)]
        status = (await client.get(f"{url}/status")).json()
    assert statuses == [404] * 10 and replica.hits["not_found"] == 10
    assert status["replicas"][0]["state"] == "healthy" and status["replicas"][0]["ejections"] == 0


async def test_429_backpressure_moves_requests_away_without_ejecting() -> None:
    busy, free = ScriptedReplica(mode="http_429"), ScriptedReplica()
    async with running([busy, free], backpressure_backoff_s=60.0) as url, httpx.AsyncClient() as client:
        statuses = [(await client.post(f"{url}/v1/completions", json={"prompt": "x"})).status_code for _ in range(6)]
        status = (await client.get(f"{url}/status")).json()
        busy_hits = busy.hits["http_429"]
        # With the free replica gone, the busy one is still a candidate: it was slowed, not ejected.
        free.mode = "http_429"
        last = await client.post(f"{url}/v1/completions", json={"prompt": "x"})
    assert statuses == [200] * 6
    assert busy_hits == 1  # tried once, then avoided for the backoff
    assert [r["state"] for r in status["replicas"]] == ["healthy", "healthy"]
    assert last.status_code == 429 and busy.hits["http_429"] == 2


async def test_when_every_replica_fails_the_client_gets_the_last_error_not_a_hang() -> None:
    replicas = [ScriptedReplica(mode="http_500"), ScriptedReplica(mode="http_500"), ScriptedReplica(mode="http_500")]
    async with running(replicas, retries=1) as url, httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/completions", json={"prompt": "x"})
    assert response.status_code == 500 and response.json()["error"]["message"] == "engine dead"
    assert sum(r.hits["http_500"] for r in replicas) == 2  # one try and one retry, no more


async def test_a_refused_connection_is_retried_and_the_replica_taken_out() -> None:
    good = ScriptedReplica()
    refused = f"http://127.0.0.1:{free_port()}"
    async with running([good], extra_urls=(refused,)) as url, httpx.AsyncClient() as client:
        statuses = [(await client.post(f"{url}/v1/completions", json={"prompt": "x"})).status_code for _ in range(6)]
        status = (await client.get(f"{url}/status")).json()
    assert statuses == [200] * 6
    assert [r["healthy"] for r in status["replicas"]] == [True, False]


async def test_a_stream_cut_mid_event_ends_with_an_error_event_and_done() -> None:
    async with running([ScriptedReplica(mode="cut_stream")]) as url, httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/completions", json={"prompt": "x", "stream": True})
    events = [event for event in response.text.split("\n\n") if event]
    assert response.status_code == 200
    assert [orjson.loads(e[6:])["choices"][0]["text"] for e in events[:3]] == ["0", "1", "2"]
    assert orjson.loads(events[3][6:])["error"]["code"] == "stream_broken"  # the half event was dropped
    assert events[4] == "data: [DONE]"


async def test_requests_go_only_to_replicas_serving_their_model_and_models_are_merged() -> None:
    replicas = [ScriptedReplica(model="a"), ScriptedReplica(model="b"), ScriptedReplica(model="a")]
    async with running(replicas, policy="least_loaded") as url, httpx.AsyncClient() as client:
        models = (await client.get(f"{url}/v1/models")).json()
        body = {"model": "b", "prompt": "x"}
        answers = [await client.post(f"{url}/v1/completions", json=body) for _ in range(6)]
        served = {answer.headers["x-dpserve-replica"] for answer in answers}
        missing = await client.post(f"{url}/v1/completions", json={"prompt": "x"})
    assert [card["id"] for card in models["data"]] == ["a", "b"]
    assert served == {"r1"}
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"


async def test_a_replica_error_that_is_not_openai_shaped_is_reshaped() -> None:
    async with running([ScriptedReplica(mode="not_found")]) as url, httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/completions", json={"prompt": "x"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert "Not Found" in error["message"] and error["type"] == "not_found_error"


async def test_a_plain_text_replica_error_reaches_the_client_as_openai_json() -> None:
    async with running([ScriptedReplica(mode="text_502")]) as url, httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/completions", json={"prompt": "x"})
    assert response.status_code == 502
    assert response.headers["content-type"] == "application/json"
    assert "upstream proxy exploded" in response.json()["error"]["message"]


async def test_ready_turns_503_when_a_shutdown_begins() -> None:
    apps: list[FastAPI] = []
    async with running([ScriptedReplica()], apps=apps) as url, httpx.AsyncClient() as client:
        assert (await client.get(f"{url}/ready")).json()["ready"] is True
        apps[0].state.shutdown.begin_drain(30.0)  # what the SIGTERM handler calls
        ready = await client.get(f"{url}/ready")
        served = await client.post(f"{url}/v1/completions", json={"prompt": "x"})
    # Load balancers stop sending; what still arrives on open connections is served.
    assert ready.status_code == 503 and ready.json()["draining"] is True
    assert served.status_code == 200


@pytest.mark.parametrize("passed", [True, False])
async def test_each_request_s_class_reaches_the_replica_as_its_priority_field(passed: bool) -> None:
    """With --vllm-priority, the body the replica receives carries vLLM's `priority` for the request's class
    (critical -2, standard 0, batch 2), one lower for a request with an SLO (served ahead of its class's best
    effort); without it, the body goes as the client sent it."""
    replica = ScriptedReplica()
    async with running([replica], policy="slo", vllm_priority=passed) as url, httpx.AsyncClient(timeout=10) as client:
        for asked, slo in (("critical", False), (None, False), ("batch", False), (None, True), ("critical", True)):
            headers = {"x-dpserve-priority": asked} if asked else {}
            if slo:
                headers["x-slo-ttft-ms"] = "60000"
            body = {"model": "m", "prompt": "hi", "max_tokens": 1}
            response = await client.post(f"{url}/v1/completions", json=body, headers=headers)
            assert response.status_code == 200, response.text
    forwarded = [body.get("priority") for body in replica.bodies]
    assert forwarded == ([-2, 0, 2, -1, -3] if passed else [None] * 5)
    assert all(body["prompt"] == "hi" and body["max_tokens"] == 1 for body in replica.bodies)


async def test_a_tenant_over_its_requests_per_minute_gets_a_429_and_others_are_served() -> None:
    """`--tenant acme:rpm=2`, over HTTP: acme's third request in the minute is refused with an OpenAI-style 429
    and a Retry-After, the replica never sees it, and another tenant's request is served meanwhile."""
    replica = ScriptedReplica()
    async with running([replica], tenants=("acme:rpm=2",)) as url, httpx.AsyncClient(timeout=10) as client:
        body = {"model": "m", "prompt": "hi", "max_tokens": 1}
        acme = {"x-dpserve-tenant": "acme"}
        statuses = [(await client.post(f"{url}/v1/completions", json=body, headers=acme)).status_code for _ in range(2)]
        refused = await client.post(f"{url}/v1/completions", json=body, headers=acme)
        other = await client.post(f"{url}/v1/completions", json=body, headers={"x-dpserve-tenant": "zeta"})
    assert statuses == [200, 200]
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["message"] and int(refused.headers["retry-after"]) >= 1
    assert other.status_code == 200
    assert len(replica.bodies) == 3  # the refused one never reached it


async def test_a_tenant_over_its_concurrent_requests_is_refused_while_another_tenant_is_served() -> None:
    """`--tenant acme:concurrent=1`: while one of acme's streams is open, its second request is refused with
    a 429 and never reaches the replica; another tenant's is served; once the stream ended, acme is served."""
    replica = ScriptedReplica(mode="slow_stream")  # 5 chunks, 0.2 s apart
    async with running([replica], tenants=("acme:concurrent=1",)) as url, httpx.AsyncClient(timeout=10) as client:
        body = {"model": "m", "prompt": "hi", "max_tokens": 5, "stream": True}
        acme = {"x-dpserve-tenant": "acme"}
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=acme) as first:
            chunks = first.aiter_bytes()
            assert first.status_code == 200 and await anext(chunks)  # the first is running on the replica
            second = await client.post(f"{url}/v1/completions", json=body, headers=acme)
            other = await client.post(f"{url}/v1/completions", json=body, headers={"x-dpserve-tenant": "zeta"})
            async for _ in chunks:
                pass
        after = await client.post(f"{url}/v1/completions", json=body, headers=acme)
    assert second.status_code == 429, second.text
    assert second.json()["error"]["message"] and "retry-after" in second.headers
    assert other.status_code == 200 and after.status_code == 200
    assert len(replica.bodies) == 3  # first, other, after: the refused one never reached it


async def test_only_a_trusted_key_may_name_the_tenant_its_requests_are_served_as() -> None:
    """Keys `gateway:...` (its tenant's rules say trusted) and `app:...`: the gateway's requests are served as
    the tenant it names in `x-dpserve-tenant` (counted under that name); the app's naming one is refused
    with a 403 that never reaches the replica, and without the header it is served as its own tenant."""
    replica = ScriptedReplica()
    keys = ("gateway:gateway-key-123", "app:app-key-12345")
    apps: list[FastAPI] = []
    async with (
        running([replica], apps=apps, api_keys=keys, tenants=("gateway:trusted=true",)) as url,
        httpx.AsyncClient(timeout=10) as client,
    ):
        body = {"model": "m", "prompt": "hi", "max_tokens": 1}
        gateway = {"authorization": "Bearer gateway-key-123", "x-dpserve-tenant": "team-a"}
        named = await client.post(f"{url}/v1/completions", json=body, headers=gateway)
        app_named = {"authorization": "Bearer app-key-12345", "x-dpserve-tenant": "team-a"}
        refused = await client.post(f"{url}/v1/completions", json=body, headers=app_named)
        own = await client.post(f"{url}/v1/completions", json=body, headers={"authorization": "Bearer app-key-12345"})
        metrics = (await client.get(f"{url}/metrics", headers={"authorization": "Bearer gateway-key-123"})).text
    assert named.status_code == 200 and own.status_code == 200
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "tenant_not_allowed"
    assert len(replica.bodies) == 2
    # Names from a trusted header are unbounded: counted as "other", not under the gateway's own tenant.
    counted = parse_samples(metrics, {"dpserve_tenant_requests_total"}).by_name["dpserve_tenant_requests_total"]
    assert {labels["tenant"]: value for labels, value in counted} == {"app": 1.0, "gateway": 0.0, "other": 1.0}
