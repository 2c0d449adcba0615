"""The app's middleware wraps the proxied endpoints as it wraps FastAPI's routes: access control is
installed once, and a middleware added later sees every path (no request to a replica is made here:
before its lifespan the hot path answers 503 itself)."""

from __future__ import annotations

import logging

import httpx
import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dpserve.config import RouterSettings
from dpserve.gpu.nvml import load_nvml
from dpserve.router.app import Router, create_app
from dpserve.router.flow.access import Guard, Keys, load_keys

USER_KEY = "user-key-0001"


class Stamp:
    """A middleware added after the app is built: marks every answer it wraps."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-stamp", b"1")]
            await send(message)

        await self.app(scope, receive, stamped)


async def test_later_middleware_and_access_control_wrap_the_proxied_paths_too() -> None:
    settings = RouterSettings(replicas=("http://127.0.0.1:9",), gpu_interval_s=0)
    app = create_app(settings, keys=Keys(users=(USER_KEY.encode(),)))
    app.add_middleware(Stamp)
    assert sum(m.cls is Guard for m in app.user_middleware) == 1
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        refused = await client.post("/v1/chat/completions", json={})
        assert refused.status_code == 401 and refused.headers["x-stamp"] == "1"
        auth = {"authorization": f"Bearer {USER_KEY}"}
        proxied = await client.post("/v1/chat/completions", json={}, headers=auth)
        assert proxied.status_code == 503 and proxied.json()["error"]["code"] == "not_serving"
        assert proxied.headers["x-stamp"] == "1"
        health = await client.get("/health")
        assert health.status_code == 200 and health.headers["x-stamp"] == "1"


def test_the_kv_index_is_kept_only_for_a_policy_that_reads_blocks(caplog: pytest.LogCaptureFixture) -> None:
    """--kv-events given to every router (as `dpserve up` does): kv_aware indexes them; least_loaded keeps no
    index (its streams only watched for liveness), and says so."""
    replica, events = "http://127.0.0.1:9", "tcp://127.0.0.1:5557"
    for policy, indexed in (("kv_aware", True), ("least_loaded", False)):
        settings = RouterSettings(replicas=(replica,), kv_events=(f"{replica}={events}",), policy=policy)
        with caplog.at_level(logging.INFO, logger="dpserve.router"):
            router = Router(settings, None, None, load_nvml, load_keys(settings))
        assert (router.kv_index is not None) is indexed and router.state.kv_index is router.kv_index
        assert list(router.kv_endpoints.values()) == [events]
        assert ("watched for liveness only" in caplog.text) is not indexed, caplog.text
        caplog.clear()
