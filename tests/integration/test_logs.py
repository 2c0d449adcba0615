"""`--log-format json`: every line the router writes parses, uvicorn's included, and the lines about a
request carry its `x-request-id` (the access line at its end; a replica that failed it, before the retry)."""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.integration.conftest import start_router, stop_router
from tests.integration.raw_replica import RawReplica, Seen, json_answer

pytestmark = pytest.mark.integration


def answer(seen: Seen) -> bytes:
    return json_answer({"object": "chat.completion", "choices": [{"index": 0, "message": {"content": "x"}}]})


def hang_up(seen: Seen) -> None:
    return None  # the connection closes with no answer: the router retries on the other replica


def test_json_lines_parse_and_name_the_request() -> None:
    with RawReplica({"/v1/chat/completions": answer}) as good, RawReplica({"/v1/chat/completions": hang_up}) as bad:
        flags = ("--log-format", "json", "--access-log", "--log-level", "info", "--retries", "2")
        router = start_router([good.url, bad.url], "round_robin", *flags)
        ids = [f"log-test-{n}" for n in range(4)]
        try:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            for request_id in ids:
                got = httpx.post(
                    f"{router.url}/v1/chat/completions", json=body, headers={"x-request-id": request_id}, timeout=10
                )
                assert got.status_code == 200, got.text
            assert httpx.get(f"{router.url}/health", timeout=5).status_code == 200
        finally:
            text = stop_router(router)
    lines = [orjson.loads(line) for line in text.splitlines() if line.strip()]  # each parses, or this fails
    assert lines and all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    access = [line for line in lines if line["logger"] == "dpserve.access"]
    assert [line["request_id"] for line in access] == ids
    assert all(line["status"] == 200 and line["replica"] and line["duration_ms"] >= 0 for line in access)
    assert all(line["policy"] == "round_robin" for line in access)
    failed = [line for line in lines if "failed before the first byte" in line["message"]]
    assert failed and all(line["request_id"] in ids for line in failed)
    # uvicorn's own lines in the same format: its start-up, and the access line of a path the router owns.
    assert any(line["logger"].startswith("uvicorn") for line in lines)
    assert any(line["logger"] == "uvicorn.access" and "/health" in line["message"] for line in lines)
    assert not any(line["logger"] == "uvicorn.access" and "/v1/chat" in line["message"] for line in lines)
