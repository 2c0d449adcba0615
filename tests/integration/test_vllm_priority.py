"""`--vllm-priority` against real vLLM running `--scheduling-policy priority`: the class a client asks for
(`x-dpserve-priority`) reaches vLLM as its `priority` field and changes the order vLLM serves requests in.

One replica runs one sequence at a time (`--max-num-seqs 1`), so requests queue in vLLM's own scheduler.
While a long request holds it, three batch requests arrive, then one critical request. With the field
passed, the critical request is answered before every batch one; without it (the same router minus
`--vllm-priority`, the same replica, the same arrivals), vLLM serves them as they came and the critical one
ends last. The router's own queue is off (`--flow-control off`): the order is vLLM's alone."""

from __future__ import annotations

import threading

import httpx
import pytest

from dpserve.replicas.prometheus_text import parse_samples
from tests.integration.conftest import ONE_SEQ_MODEL, start_router, stop_router, wait_until

pytestmark = pytest.mark.integration

MODEL = ONE_SEQ_MODEL
BATCH_REQUESTS = 3
WATCHED = {"vllm:num_requests_waiting", "vllm:num_requests_running"}


@pytest.fixture(scope="module")
def replica(one_seq_replica: str) -> str:
    return one_seq_replica


def waiting_and_running(url: str) -> tuple[float, float]:
    samples = parse_samples(httpx.get(f"{url}/metrics", timeout=10).text, WATCHED)
    return samples.total("vllm:num_requests_waiting") or 0.0, samples.total("vllm:num_requests_running") or 0.0


def finishing_order(router: str, replica: str) -> list[str]:
    """Sends the holder, then the batch requests, then the critical one, each once vLLM shows the ones
    before it queued; returns the labels in the order their answers ended."""
    ended: list[str] = []
    lock = threading.Lock()

    def send(label: str, priority: str, max_tokens: int) -> None:
        body = {"model": MODEL, "prompt": f"{label} says", "max_tokens": max_tokens, "ignore_eos": True}
        answer = httpx.post(
            f"{router}/v1/completions", json=body, headers={"x-dpserve-priority": priority}, timeout=120
        )
        assert answer.status_code == 200, answer.text
        with lock:
            ended.append(label)

    threads = []

    def start(label: str, priority: str, max_tokens: int, waiting: int) -> None:
        thread = threading.Thread(target=send, args=(label, priority, max_tokens))
        thread.start()
        threads.append(thread)
        wait_until(lambda: waiting_and_running(replica) == (waiting, 1.0), 60, 0.05, what=f"{label} queued")

    start("holder", "standard", 400, 0)
    for index in range(BATCH_REQUESTS):
        start(f"batch-{index}", "batch", 16, index + 1)
    start("critical", "critical", 16, BATCH_REQUESTS + 1)
    for thread in threads:
        thread.join(180)
    assert len(ended) == BATCH_REQUESTS + 2, ended
    return ended


def test_the_critical_class_overtakes_queued_batch_requests_only_with_the_field(replica: str) -> None:
    orders = {}
    for passed in (True, False):
        extra = ("--vllm-priority",) if passed else ()
        router = start_router([replica], "least_loaded", "--flow-control", "off", *extra)
        try:
            orders[passed] = finishing_order(router.url, replica)
        finally:
            stop_router(router)
    print(orders)
    batch = {f"batch-{index}" for index in range(BATCH_REQUESTS)}
    with_field, without = orders[True], orders[False]
    # Passed: vLLM runs the critical request before every batch one (it may also preempt the holder).
    assert with_field.index("critical") < min(with_field.index(label) for label in batch), with_field
    # Not passed: first come, first served; the critical request, the last to come, ends last.
    assert without[0] == "holder" and without[-1] == "critical", without
