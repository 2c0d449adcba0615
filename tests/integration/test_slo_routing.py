"""Routing and admission by SLO through the real router: a request with an SLO goes to a replica predicted to
meet it, one that none can meet is refused at once with 429 and Retry-After, and the router shows goodput,
attainment and how far its predictions were off. Two sims of different speeds stand for a fast and a slow
GPU (`dpserve sim --prefill-ms-per-token`); real vLLM CPU replicas check the predictions themselves."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dpserve.replicas.prometheus_text import parse_samples
from tests.integration.conftest import (
    Fleet,
    RouterProcess,
    SimProcess,
    router_status,
    running_sim,
    start_router,
    stop_router,
    wait_until,
)

pytestmark = pytest.mark.integration

PROMPT = "the shared part of a long prompt " * 60  # ~2000 bytes
SIM_TIMES = ("--decode-ms-per-token", "2", "--tokenizer", "fast")


def stream(
    router: str, prompt: str, headers: dict[str, str] | None = None, client: httpx.Client | None = None
) -> httpx.Response:
    """A streamed completion, read whole (`client`: one already made; making one costs tens of milliseconds)."""
    body = {"prompt": prompt, "max_tokens": 4, "stream": True}  # the one model the replicas serve
    if client is not None:
        return client.post(f"{router}/v1/completions", json=body, headers=headers or {})
    with httpx.Client(timeout=60) as made:
        return made.post(f"{router}/v1/completions", json=body, headers=headers or {})


@pytest.fixture(scope="module")
def sims() -> Iterator[tuple[SimProcess, SimProcess]]:
    """A fast and a slow sim: 0.05 and 0.5 ms per prompt token."""
    with (
        running_sim("--prefill-ms-per-token", "0.05", *SIM_TIMES) as fast,
        running_sim("--prefill-ms-per-token", "0.5", *SIM_TIMES) as slow,
    ):
        yield fast, slow


def slo_router(sims: tuple[SimProcess, SimProcess], *extra: str) -> RouterProcess:
    """`--policy slo` over the sims, reading their KV events."""
    fast, slow = sims
    events = [f"--kv-events={fast.url}={fast.kv_events}", f"--kv-events={slow.url}={slow.kv_events}"]
    return start_router([f"fast={fast.url}", f"slow={slow.url}"], "slo", *events, "--tokenizer", "remote", *extra)


@pytest.fixture(scope="module")
def router(sims: tuple[SimProcess, SimProcess]) -> Iterator[RouterProcess]:
    made = slo_router(sims)
    try:
        yield made
    finally:
        stop_router(made)


LEARN_ROUNDS = 4


def learn_both(router: str) -> None:
    """Rounds of best-effort streams with prompts of different lengths until each replica's model has 5
    answers. (One round was not always enough: with `--max-in-flight 1` the policy sends best effort to the
    fast replica's queue while it predicts that sooner, and the slow one got 4 of 48, seen in 4 of 6 runs.)"""
    learned: dict[str, int] = {}
    for round_number in range(LEARN_ROUNDS):
        with ThreadPoolExecutor(4) as pool:
            prompts = [f"warm {round_number} {i} " + "word " * (250 * (i % 8)) for i in range(48)]
            for answer in pool.map(lambda p: stream(router, p), prompts):
                assert answer.status_code == 200, answer.text
        status = httpx.get(f"{router}/status").json()
        learned = {r["id"]: r["latency"]["ttft_answers"] for r in status["replicas"]}
        if all(count >= 5 for count in learned.values()):
            return
    raise AssertionError(f"each replica's latency model has fewer than 5 answers: {learned}")


def test_an_slo_request_goes_to_the_replica_that_can_meet_it(router: RouterProcess) -> None:
    learn_both(router.url)
    status = httpx.get(f"{router.url}/status").json()
    per_k = {r["id"]: r["latency"]["ttft_weights"][1] for r in status["replicas"]}
    assert per_k["slow"] > 3 * per_k["fast"], per_k  # each replica learned its own speed
    # 1500-token prompts: about 0.08 s on the fast one, 0.75 s on the slow one.
    served = []
    for i in range(6):
        answer = stream(router.url, f"{i} " + "word " * 1500, {"x-slo-ttft-ms": "400", "x-dpserve-receipt": "1"})
        assert answer.status_code == 200, answer.text
        served.append(answer.headers["x-dpserve-replica"])
        assert float(answer.headers["x-dpserve-predicted-ttft-ms"]) > 0
    assert served == ["fast"] * 6


def test_a_request_no_replica_can_meet_is_refused_at_once_with_retry_after(router: RouterProcess) -> None:
    learn_both(router.url)
    took = []
    client = httpx.Client(timeout=60)
    stream(router.url, "connect", client=client)
    for i in range(7):
        started = time.perf_counter()
        answer = stream(router.url, f"r{i} " + PROMPT, {"x-llm-d-slo-ttft-ms": "1"}, client)
        took.append(time.perf_counter() - started)
        assert answer.status_code == 429, answer.text
        assert int(answer.headers["retry-after"]) >= 1
        error = answer.json()["error"]
        assert error["code"] == "slo_unattainable" and "1 ms" in error["message"]
    client.close()
    assert statistics.median(took) < 0.05, took  # refused on arrival, not after any wait
    # Bad input is a 400 naming the header; a best-effort request is unaffected.
    bad = stream(router.url, PROMPT, {"x-slo-ttft-ms": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-slo-ttft-ms"
    assert stream(router.url, PROMPT).status_code == 200
    met = stream(router.url, "met " + PROMPT, {"x-slo-ttft-ms": "5000"})
    assert met.status_code == 200
    # Counted: goodput and attainment per tenant and model; the prediction error per replica.
    slo = httpx.get(f"{router.url}/status").json()["slo"]
    row = slo[0]
    assert row["refused"] >= 7 and row["met"] >= 1 and 0 < row["attainment"] < 1
    text = httpx.get(f"{router.url}/metrics").text
    samples = parse_samples(text, {"dpserve_slo_requests_total", "dpserve_ttft_prediction_error_seconds_bucket"})
    refused = [v for labels, v in samples.by_name["dpserve_slo_requests_total"] if labels["outcome"] == "refused"]
    assert sum(refused) >= 7
    # Signed errors: negative buckets, so no _count or _sum (Prometheus' rule); the +Inf bucket counts them.
    buckets = samples.by_name["dpserve_ttft_prediction_error_seconds_bucket"]
    errors = {labels["replica"]: v for labels, v in buckets if labels["le"] == "+Inf"}
    assert errors.get("fast", 0) > 0 and errors.get("slow", 0) > 0
    assert "dpserve_slo_goodput{" in text and "dpserve_slo_attainment{" in text


def test_a_request_that_would_wait_in_the_routers_queue_past_its_slo_is_refused_at_once(
    sims: tuple[SimProcess, SimProcess],
) -> None:
    """One request per replica at a time (`--max-in-flight 1`), both held by long streams: an SLO request would
    wait in the router's queue behind them. Predicted past its SLO with what is ahead of it, it is refused on
    arrival, not at its deadline; one whose SLO allows the wait is queued and served."""
    router = slo_router(sims, "--max-in-flight", "1")
    try:
        learn_both(router.url)
        body = {"prompt": "hold " * 1500, "max_tokens": 400, "stream": True}
        with httpx.Client(timeout=120) as client, ThreadPoolExecutor(2) as pool:
            holders = [
                pool.submit(
                    client.post, f"{router.url}/v1/completions", json={**body, "prompt": f"{i} " + body["prompt"]}
                )
                for i in range(2)
            ]
            wait_until(lambda: sum(r["in_flight"] for r in router_status(router.url)["replicas"]) == 2, 10, 0.02)
            started = time.perf_counter()
            refused = stream(router.url, "late " + PROMPT, {"x-slo-ttft-ms": "200"}, client)
            took = time.perf_counter() - started
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "slo_unattainable", refused.text
            assert took < 0.2, took  # on arrival, not at its deadline 200 ms away
            served = stream(router.url, "patient " + PROMPT, {"x-slo-ttft-ms": "60000"}, client)
            assert served.status_code == 200, served.text
            assert all(holder.result().status_code == 200 for holder in holders)
    finally:
        stop_router(router)


def test_predicted_ttft_is_centred_and_beats_a_constant_on_vllm_cpu(fleet: Fleet) -> None:
    """The receipts of streams through a `--policy slo` router over the session's two real vLLM CPU replicas,
    four clients at once, prompts of 300 to 2400 tokens: per replica, once each model has its first answers,
    the predictions are centred (the median of (predicted - realized) / realized within 0.25) and their median
    relative error is at most 25%, or, on a machine so busy that no prediction can be, no worse (+0.05) than
    the replica's own median TTFT in hindsight. The issue's 20% is what `dpserve bench slo` measures; on this
    shared 2-core box under other work, TTFTs of one prompt length spread 10x (docs/slo.md)."""
    events = [f"--kv-events={url}={kv}" for url, kv in zip(fleet.replica_urls, fleet.kv_event_endpoints, strict=True)]
    router = start_router(fleet.replica_urls, "slo", *events, "--receipts-sample", "1", "--receipts-keep", "400")
    try:
        body = lambda i: {"prompt": f"{i} " + "hello world " * (50 + 70 * (i % 6)), "max_tokens": 8}  # noqa: E731
        with ThreadPoolExecutor(4) as pool:
            for answer in pool.map(lambda i: stream_body(router.url, body(i)), range(200)):
                assert answer == 200
        receipts = httpx.get(f"{router.url}/admin/receipts", params={"limit": 400}).json()["receipts"]
        seen: dict[str, list[tuple[int, float, float]]] = {}
        for receipt in reversed(receipts[:140]):  # the newest 140: the models have learned from the first 60
            predicted, realized = receipt["predicted_ttft_ms"], receipt["realized_ttft_ms"]
            if predicted is not None and realized:
                seen.setdefault(receipt["replica"], []).append((receipt["prompt_tokens"], predicted, realized))
        assert len(seen) == 2 and all(len(rows) >= 30 for rows in seen.values()), seen
        for replica, rows in seen.items():
            signed = statistics.median((p - r) / r for _, p, r in rows)
            error = statistics.median(abs(p - r) / r for _, p, r in rows)
            typical = statistics.median(r for _, _, r in rows)
            constant = statistics.median(abs(typical - r) / r for _, _, r in rows)
            assert abs(signed) <= 0.25 and error <= max(0.25, constant + 0.05), (replica, signed, error, constant)
        replicas = httpx.get(f"{router.url}/status").json()["replicas"]
        shown = {r["id"]: r["latency"]["ttft_median_error"] for r in replicas}
        assert all(error is not None for error in shown.values()), shown  # the error, per replica, in /status
    finally:
        stop_router(router)


def stream_body(router: str, body: dict[str, object]) -> int:
    with httpx.Client(timeout=60) as client:
        return client.post(f"{router}/v1/completions", json={**body, "stream": True}).status_code
