"""No secret the router is given or sent shows anywhere it writes: the real router (JSON logs at debug level,
the access log, traces to a real OTLP receiver, every receipt) in front of a simulator, sent requests with
valid and invalid user, tenant and admin keys; then no log line, span, answer, /status, /dashboard,
/admin/receipts, /admin/usage, /admin/replicas or /metrics text holds any of them."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from benchmarks.otlp_receiver import OtlpReceiver
from tests.integration.conftest import SimProcess, bearer, running_sim, start_router, stop_router

pytestmark = pytest.mark.integration

MODEL = "dpserve-tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TENANT = "acme"


@pytest.fixture
def secret_keys() -> dict[str, str]:
    """Every secret of the test, by what it is: those the router is given (`router_secret_flags`) and those
    clients send that it must refuse. A new credential (the router's key for its replicas, say) goes here and
    into `router_secret_flags`, and the test checks it too."""
    return {
        "tenant key": "tenant-key-5f0e2c9b7a41",
        "bare user key": "bare-key-83d1a6c04e92",
        "admin key": "admin-key-c47b19e2d05a",
        "wrong key": "wrong-key-9a2f61d7c3b8",
        # A guess one character past a real key: were it written anywhere, the real key would be too.
        "near miss": "tenant-key-5f0e2c9b7a41x",
    }


@pytest.fixture
def router_secret_flags(secret_keys: dict[str, str]) -> list[str]:
    """The flags giving the router its secrets (the others in `secret_keys` only clients send)."""
    return [
        "--api-key",
        f"{TENANT}:{secret_keys['tenant key']}",
        "--api-key",
        secret_keys["bare user key"],
        "--admin-key",
        secret_keys["admin key"],
    ]


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with running_sim("--speed", "0") as sim:
        yield sim


def send_every_kind_of_request(url: str, keys: dict[str, str]) -> list[httpx.Response]:
    """Valid and invalid keys on the OpenAI paths (streamed and not, with a receipt asked for), the admin
    paths, a trusted key naming a tenant, and keys in headers the router does not read."""
    answers = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for key in keys.values():
            for stream in (False, True):
                body = {**CHAT, "stream": stream, "stream_options": {"include_usage": True}} if stream else CHAT
                headers = {**bearer(key), "x-dpserve-receipt": "1", "x-api-key": key}
                answers.append(client.post("/v1/chat/completions", json=body, headers=headers))
            answers.append(client.get("/v1/models", headers=bearer(key)))
            answers.append(client.get("/admin/replicas", headers=bearer(key)))
            answers.append(client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=bearer(key)))
        trusted = {**bearer(keys["admin key"]), "x-dpserve-tenant": "beta"}
        answers.append(client.post("/v1/chat/completions", json=CHAT, headers=trusted))
    return answers


def test_no_key_shows_in_logs_traces_status_receipts_usage_or_metrics(
    sim: SimProcess, secret_keys: dict[str, str], router_secret_flags: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s
    admin = bearer(secret_keys["admin key"])
    with OtlpReceiver() as receiver:
        flags = ("--log-format", "json", "--access-log", "--log-level", "debug", "--receipts-sample", "1")
        flags += ("--otlp-traces-endpoint", receiver.endpoint, "--tenant", f"{TENANT}:weight=2", "--gpu-interval", "0")
        router = start_router(
            [sim.url], "least_loaded", *router_secret_flags, *flags, admin_key=secret_keys["admin key"]
        )
        try:
            answers = send_every_kind_of_request(router.url, secret_keys)
            served = sum(1 for answer in answers if answer.status_code == 200 and "completions" in answer.url.path)
            views = {path: httpx.get(f"{router.url}{path}", headers=admin, timeout=10) for path in ADMIN_VIEWS}
            views["/metrics"] = httpx.get(f"{router.url}/metrics", timeout=10)
            spans = receiver.wait_for(served, 15, kind=2)  # type: ignore[arg-type]  # the requests' server spans
            all_spans = list(receiver.spans)
        finally:
            log = stop_router(router)
    texts = {
        "log": log,
        "spans": repr([(span.name, span.attributes, span.events) for span in all_spans]),
        "answers": repr([(answer.status_code, answer.headers.multi_items(), answer.text) for answer in answers]),
        **{path: view.text for path, view in views.items()},
    }
    # What the test looks at is there to look at: a leak would have had its chance.
    assert served >= 10 and {401, 403} <= {answer.status_code for answer in answers}
    assert len(spans) >= served and all(view.status_code == 200 for view in views.values())
    lines = [orjson.loads(line) for line in log.splitlines() if line.strip()]
    assert sum(line["logger"] == "dpserve.access" for line in lines) >= served
    assert TENANT in texts["/admin/usage"] and '"receipts":[{' in texts["/admin/receipts"].replace(" ", "")
    assert "dpserve_requests_total" in texts["/metrics"]
    leaks = [(what, where) for what, key in secret_keys.items() for where, text in texts.items() if key in text]
    assert not leaks, leaks


ADMIN_VIEWS = ("/status", "/dashboard", "/admin/receipts", "/admin/usage", "/admin/replicas")
