"""Flow control through the real router: a noisy tenant against a light one, priorities under a batch
flood, no starvation, on saturated `dpserve sim` replicas (a batch of 4 each); quotas and usage against
the 2 real vLLM CPU replicas and their own token counters, through the official `openai` SDK."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from dpserve.tiny_model import TINY_MODEL_NAME
from tests.integration.conftest import (
    Fleet,
    SimProcess,
    running_sim,
    start_router,
    stop_router,
)
from tests.integration.raw_replica import RawReplica, Seen, json_answer
from tests.integration.traffic import Answer, closed_loop

pytestmark = pytest.mark.integration

SIM_ARGS = ("--max-num-seqs", "4", "--decode-ms-per-token", "10", "--seed", "3")


@pytest.fixture(scope="module")
def sims() -> Iterator[list[SimProcess]]:
    with running_sim(*SIM_ARGS) as first, running_sim(*SIM_ARGS) as second:
        yield [first, second]


def capacity_learned(url: str) -> bool:
    replicas = httpx.get(f"{url}/status", timeout=5).json()["replicas"]
    return all(replica["capacity"] for replica in replicas)


def metric(text: str, series: str) -> float:
    """One series' value in a /metrics text (`series`: its name and labels as printed)."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {series} in /metrics")


async def until_status(url: str, predicate: Callable[[dict[str, Any]], bool], what: str, timeout_s: float = 30) -> None:
    """Polls /status without blocking the event loop (the traffic runs on it) until `predicate` holds."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10) as client:
        while not predicate((await client.get(f"{url}/status")).json()):
            assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
            await asyncio.sleep(0.1)


def ttft_p50(answers: list[Answer], since: float) -> float:
    return statistics.median(a.ttft for a in answers if a.ttft is not None and a.started >= since)


@contextlib.contextmanager
def router_over(sims: list[SimProcess], *extra: str) -> Iterator[str]:
    router = start_router([sim.url for sim in sims], "least_loaded", *extra)
    try:
        yield router.url
    finally:
        stop_router(router)


async def noisy_neighbour(url: str, seconds: float) -> tuple[float, float, list[Answer]]:
    """Tenant A keeps 24 streams going, B one; A's and B's TTFT p50 over the second half."""
    start = time.monotonic()
    until = start + seconds
    a, b = await asyncio.gather(closed_loop(url, "A", 24, until), closed_loop(url, "B", 1, until))
    since = start + seconds / 2
    return ttft_p50(a, since), ttft_p50(b, since), a + b


def test_a_light_tenant_waits_for_a_slot_not_behind_a_noisy_tenants_queue(sims: list[SimProcess]) -> None:
    with router_over(sims) as url:
        a, b, answers = asyncio.run(noisy_neighbour(url, 6.0))
        assert capacity_learned(url)
        status = httpx.get(f"{url}/status", timeout=5).json()
    assert all(answer.status == 200 for answer in answers)
    assert b < 0.5 * a, f"B's TTFT p50 {b:.3f}s against A's {a:.3f}s"
    # Each sim runs 4 at once; the router may have probed one more since.
    assert all(4 <= replica["capacity"] <= 5 for replica in status["replicas"]), status["replicas"]
    # The control, so this test can fail: first come, first served puts B behind A's queue.
    with router_over(sims, "--flow-control", "off") as url:
        a_off, b_off, _ = asyncio.run(noisy_neighbour(url, 6.0))
    assert b_off > 0.5 * a_off, f"without flow control B's p50 {b_off:.3f}s against A's {a_off:.3f}s"


def test_critical_requests_pass_a_batch_flood_and_batch_is_shed_first(sims: list[SimProcess]) -> None:
    # Named tenants, so /metrics counts their queue seconds apart.
    tenants = ("--tenant", "ops:weight=1", "--tenant", "bulk:weight=1")
    with router_over(sims, "--queue-size", "8", "--queue-timeout", "10", *tenants) as url:

        async def scenario() -> tuple[list[Answer], list[Answer], list[Answer]]:
            alone = await closed_loop(url, "ops", 1, time.monotonic() + 2.0, "critical")
            stop = asyncio.Event()
            flood_task = asyncio.create_task(closed_loop(url, "bulk", 40, time.monotonic() + 120, "batch", stop=stop))
            try:
                await until_status(
                    url,
                    lambda s: all(r["capacity"] for r in s["replicas"]) and s["flow"]["queued"] > 0,
                    "the capacities learned and the flood queued",
                )
                flooded = await closed_loop(url, "ops", 1, time.monotonic() + 4.0, "critical")
            finally:
                stop.set()
            return alone, flooded, await flood_task

        alone, flooded, flood = asyncio.run(scenario())
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert all(answer.status == 200 for answer in alone + flooded), [a.code for a in flooded if a.status != 200]
    refused = [answer for answer in flood if answer.status != 200]
    assert refused and {answer.status for answer in refused} == {429}
    assert {answer.code for answer in refused} <= {"shed", "queue_full"}
    alone_p50 = statistics.median(a.ttft for a in alone if a.ttft is not None)
    flooded_p50 = statistics.median(a.ttft for a in flooded if a.ttft is not None)
    batch_p50 = statistics.median(a.ttft for a in flood if a.ttft is not None)
    # Batch leaves a slot on each replica: critical requests take it at once instead of queueing. The
    # router's own count of seconds in its queue, per request, against batch's in the same run.
    served = [answer for answer in flood if answer.status == 200]
    ops_wait = metric(metrics, 'dpserve_tenant_queue_seconds_total{tenant="ops"}') / len(flooded)
    bulk_wait = metric(metrics, 'dpserve_tenant_queue_seconds_total{tenant="bulk"}') / len(served)
    print(
        f"\nqueue wait per request: critical {ops_wait * 1000:.1f} ms of {len(flooded)}, "
        f"batch {bulk_wait * 1000:.1f} ms; "
        f"TTFT p50: critical {alone_p50:.3f} s alone, {flooded_p50:.3f} s flooded, batch {batch_p50:.3f} s"
    )
    assert ops_wait < 0.5 * bulk_wait
    assert flooded_p50 < batch_p50


def test_no_tenant_starves_and_no_request_waits_past_the_queue_timeout(sims: list[SimProcess]) -> None:
    """With outside load as well: 2 streams straight to the first sim, which the router sees only in that
    sim's scraped counts and in its own requests' waits, as a replica shared with other clients."""
    timeout_s = 0.5
    with router_over(sims, "--queue-timeout", str(timeout_s), "--tenant", "t5:weight=4") as url:

        async def scenario() -> tuple[list[Answer], list[Answer]]:
            until = time.monotonic() + 8.0
            outside = asyncio.create_task(closed_loop(sims[0].url, "outside", 2, until))
            loads = [closed_loop(url, f"t{n}", n + 1, until) for n in range(6)]  # 1 to 6 streams each
            routed = [answer for answers in await asyncio.gather(*loads) for answer in answers]
            return routed, await outside

        answers, outside = asyncio.run(scenario())
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert outside and all(answer.status == 200 for answer in outside)  # the sim really carried outside load
    for tenant in (f"t{n}" for n in range(6)):
        assert any(a.tenant == tenant and a.status == 200 for a in answers), f"{tenant} was never served"
    for answer in answers:
        assert answer.status in (200, 429), answer
        if answer.status == 429:  # held the whole timeout (the router's wait began after the client's)
            assert answer.code == "queue_timeout" and answer.ended - answer.started >= timeout_s
        else:
            assert answer.ttft is not None
    # No request admitted after waiting past the timeout, on the router's own clock (the client's adds the
    # machine's load): every wait it observed falls in the histogram's bucket of 1 s (twice the timeout: the
    # deadline is checked, then a slot taken).
    admitted = metric(metrics, "dpserve_queue_wait_seconds_count")
    within = metric(metrics, 'dpserve_queue_wait_seconds_bucket{le="1.0"}')
    timeouts = sum(1 for answer in answers if answer.status == 429)
    print(f"\n{admitted:.0f} admitted, {within:.0f} of them within 1 s; {timeouts} timed out after {timeout_s} s")
    assert admitted == sum(1 for answer in answers if answer.status == 200) and within == admitted
    assert timeouts > 0  # the load outlasts the timeout: it is exercised, not merely never reached


# --- quotas and usage on real vLLM ------------------------------------------------------------------------

KEY, ADMIN_KEY = "acme-key-1234", "admin-key-1234"


def replica_tokens(fleet: Fleet) -> float:
    """Prompt and generated tokens the replicas have counted themselves (their own /metrics)."""
    total = 0.0
    for url in fleet.replica_urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith(("vllm:prompt_tokens_total{", "vllm:generation_tokens_total{")):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_key_over_its_tokens_per_minute_gets_429_then_gets_through_and_counts_match_vllms(fleet: Fleet) -> None:
    tpm = 1500
    router = start_router(
        fleet.replica_urls,
        "least_loaded",
        "--api-key",
        f"acme:{KEY}",
        "--admin-key",
        ADMIN_KEY,
        "--tenant",
        f"acme:tpm={tpm}",
        admin_key=ADMIN_KEY,
    )
    try:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        before = replica_tokens(fleet)
        first_refusal: openai.RateLimitError | None = None
        sent = 0
        while first_refusal is None and sent < 200:
            sent += 1
            try:
                if sent % 2:
                    # A stream that did not ask for usage: the router asks, counts it, and takes it out again.
                    chunks = list(
                        client.chat.completions.create(
                            model=TINY_MODEL_NAME,
                            messages=[{"role": "user", "content": f"Count to ten, take {sent}"}],
                            max_tokens=24,
                            stream=True,
                        )
                    )
                    assert chunks and all(chunk.usage is None and chunk.choices for chunk in chunks)
                else:
                    client.completions.create(model=TINY_MODEL_NAME, prompt=f"Once upon a time {sent}", max_tokens=24)
            except openai.RateLimitError as refused:
                first_refusal = refused
        assert first_refusal is not None, f"no 429 after {sent} requests"
        refused_at = time.monotonic()
        assert first_refusal.code == "tokens_per_min" and "acme" in first_refusal.message
        retry_after = int(first_refusal.response.headers["retry-after"])
        assert 1 <= retry_after <= 60
        usage = httpx.get(f"{router.url}/admin/usage", headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
        acme = usage["tenants"]["acme"]["total"]
        counted = acme["prompt_tokens"] + acme["completion_tokens"]
        assert counted >= tpm and acme["requests"] == sent and acme["errors"] == 1
        served = replica_tokens(fleet) - before
        assert abs(counted - served) <= 0.01 * served, f"router counted {counted}, replicas {served}"
        # A stream that asked for its usage keeps it; the refusal's Retry-After is when the window lets it in.
        time.sleep(max(0.0, retry_after - (time.monotonic() - refused_at)) + 0.5)
        chunks = list(
            client.chat.completions.create(
                model=TINY_MODEL_NAME,
                messages=[{"role": "user", "content": "Again"}],
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
        with pytest.raises(openai.PermissionDeniedError):  # a user key may not name another tenant
            client.completions.create(
                model=TINY_MODEL_NAME, prompt="x", max_tokens=1, extra_headers={"x-dpserve-tenant": "someone-else"}
            )
        metrics = httpx.get(f"{router.url}/metrics").text
        assert 'dpserve_tenant_requests_total{tenant="acme"}' in metrics and KEY not in metrics
    finally:
        stop_router(router)


def test_each_requests_class_reaches_vllm_as_its_priority_field(fleet: Fleet) -> None:
    router = start_router(fleet.replica_urls, "least_loaded", "--vllm-priority")
    try:
        for priority in ("critical", "standard", "batch"):
            for stream in (False, True):
                body = {"model": TINY_MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "stream": stream}
                response = httpx.post(
                    f"{router.url}/v1/completions", json=body, headers={"x-dpserve-priority": priority}, timeout=60
                )
                assert response.status_code == 200, response.text  # vLLM 0.32 takes the field in its schema
        refused = httpx.post(
            f"{router.url}/v1/completions",
            json={"model": TINY_MODEL_NAME, "prompt": "x", "max_tokens": 1},
            headers={"x-dpserve-priority": "urgent"},
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "x-dpserve-priority"
    finally:
        stop_router(router)


def sse_answer(seen: Seen) -> bytes:
    body = b'data: {"choices":[{"index":0,"text":"x"}]}\n\ndata: [DONE]\n\n'
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


def completion_answer(seen: Seen) -> bytes:
    if orjson.loads(seen.body).get("stream"):
        return sse_answer(seen)
    return json_answer({"object": "text_completion", "choices": [{"index": 0, "text": "x"}]})


def test_the_priority_field_a_replica_receives_is_the_requests_class() -> None:
    """As the replica reads it, streamed or not, with a client's own `priority` replaced; without
    `--vllm-priority` the client's body goes on untouched."""
    sent = [(priority, stream) for priority in ("critical", "standard", "batch") for stream in (False, True)]
    with RawReplica({"/v1/completions": completion_answer}) as replica:
        for flags, expected in ((("--vllm-priority",), {"critical": -2, "standard": 0, "batch": 2}), ((), None)):
            router = start_router([replica.url], "least_loaded", *flags)
            try:
                replica.seen.clear()
                for priority, stream in sent:
                    body = {"model": "m", "prompt": "x", "max_tokens": 1, "stream": stream, "priority": 7}
                    headers = {"x-dpserve-priority": priority}
                    got = httpx.post(f"{router.url}/v1/completions", json=body, headers=headers, timeout=10)
                    assert got.status_code == 200, got.text
            finally:
                stop_router(router)
            received = [orjson.loads(seen.body) for seen in replica.requests("/v1/completions")]
            assert [(r["stream"], r["priority"]) for r in received] == [
                (stream, 7 if expected is None else expected[priority]) for priority, stream in sent
            ]
