"""A client that leaves costs the fleet nothing more, wherever its request was: in the router's queue (never
sent), waiting in vLLM's scheduler behind load the router did not send (its connection closed, so vLLM drops
it before computing its prompt), or in a retry's back-off (never sent again). Real vLLM runs one sequence at
a time (`--max-num-seqs 1`); what it computed is read from its own `vllm:prompt_tokens_total`, and the router
counts each client gone by where its request was (`dpserve_client_disconnects_total{stage}`).

What the replica computed beyond the holder's and the marker's prompts (counted by its own /tokenize) is what
the leaver cost it: 0 tokens, where a leaver prefilled for nobody would cost its whole prompt (1,603)."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from dpserve.replicas.prometheus_text import parse_samples
from tests.integration.conftest import (
    ONE_SEQ_MODEL,
    RouterProcess,
    bearer,
    router_ready,
    start_router,
    stop_router,
    wait_until,
)
from tests.integration.raw_replica import RawReplica, json_answer

pytestmark = pytest.mark.integration

LONG_PROMPT = "word " * 800
HOLD_PROMPT, MARKER_PROMPT = "hold", "marker"
"""The prompts whose tokens the replica computes besides a leaver's (subtracted from what it computed)."""
KEY, ADMIN_KEY = "leaver-key-0001", "leaver-admin-01"
"""The router over the one-slot replica is keyed, as an operator's is; each request here carries the client key
(the replica, which has none, ignores it)."""
HOLDER_TOKENS = 4000
"""Long enough to hold vLLM's one slot for the whole case (1500 took 12 s here, and may take 4 s on a faster
machine: a holder that finishes early lets the leaver through); its client leaves once the case is decided."""


def replica_counts(url: str) -> tuple[float, float, float]:
    """(prompt tokens computed so far, requests waiting, requests running), from the replica's own /metrics."""
    names = {"vllm:prompt_tokens_total", "vllm:num_requests_waiting", "vllm:num_requests_running"}
    samples = parse_samples(httpx.get(f"{url}/metrics", timeout=10).text, names)
    return (
        samples.total("vllm:prompt_tokens_total") or 0.0,
        samples.total("vllm:num_requests_waiting") or 0.0,
        samples.total("vllm:num_requests_running") or 0.0,
    )


def gone_counts(router: str) -> dict[str, float]:
    """The router's clients gone so far, by the stage their request was at."""
    samples = parse_samples(httpx.get(f"{router}/metrics", timeout=10).text, {"dpserve_client_disconnects_total"})
    gone: dict[str, float] = {}
    for labels, value in samples.by_name.get("dpserve_client_disconnects_total", []):
        stage = labels.get("stage", "")
        gone[stage] = gone.get(stage, 0.0) + value
    return gone


def gone_by_stage(router: str, stage: str) -> float:
    return gone_counts(router).get(stage, 0.0)


class Client:
    """A request sent whole on its own connection, answered or not; `leave()` closes the connection, as a client
    that gives up does."""

    def __init__(self, base: str, body: dict[str, object], path: str = "/v1/completions") -> None:
        parts = urlsplit(base)
        self.connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=300)
        headers = {"content-type": "application/json", **bearer(KEY)}
        self.connection.request("POST", path, json.dumps(body), headers)

    def leave(self) -> None:
        sock = self.connection.sock
        if sock is not None:
            sock.close()
        self.connection.close()


def completion(prompt: str, max_tokens: int, stream: bool) -> dict[str, object]:
    return {"model": ONE_SEQ_MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def prompt_tokens(replica: str, prompt: str) -> int:
    """The tokens vLLM counts for `prompt` as a completion's prompt (its special tokens included)."""
    answer = httpx.post(f"{replica}/tokenize", json={"model": ONE_SEQ_MODEL, "prompt": prompt}, timeout=30)
    return int(answer.json()["count"])


def settled_prompt_tokens(replica: str) -> float:
    """The replica's prompt tokens once everything before a marker request has run: with one slot and first
    come first served, a leaver still in its queue would be computed before the marker's answer comes."""
    answer = httpx.post(f"{replica}/v1/completions", json=completion(MARKER_PROMPT, 1, False), timeout=120)
    assert answer.status_code == 200, answer.text
    return replica_counts(replica)[0]


@pytest.fixture(scope="module")
def router(one_seq_replica: str) -> Iterator[RouterProcess]:
    # One request per replica at a time past which the router holds the rest in its own queue.
    keys = ("--api-key", KEY, "--admin-key", ADMIN_KEY)
    made = start_router([one_seq_replica], "kv_aware", "--max-in-flight", "1", *keys, admin_key=ADMIN_KEY)
    try:
        yield made
    finally:
        stop_router(made)


def leaves_while_held(replica: str, router: str, holder_at: str, stage: str, stream: bool) -> float:
    """A holder takes the replica's one slot (sent to `holder_at`); a leaver's client goes once its request is
    held where `stage` says (the router's queue, or vLLM's), and the router counts it gone there; then the
    holder goes too. The prompt tokens the replica computed meanwhile beyond the holder's and the marker's: what
    the leaver cost it (0, or its whole prompt)."""

    def held() -> float:
        if stage == "queued":
            return float(httpx.get(f"{router}/status", headers=bearer(ADMIN_KEY)).json()["flow"]["queued"])
        return replica_counts(replica)[1]  # waiting in vLLM

    before = settled_prompt_tokens(replica)
    gone_before = gone_by_stage(router, stage)
    holder = Client(holder_at, completion(HOLD_PROMPT, HOLDER_TOKENS, True))
    leaver: Client | None = None
    try:
        wait_until(lambda: replica_counts(replica)[2] == 1, 60, 0.02, what="the holder running")
        leaver = Client(router, completion(LONG_PROMPT, 8, stream))
        wait_until(lambda: held() == 1, 30, 0.02, what=f"the leaver held ({stage})")
        leaver.leave()
        try:
            wait_until(lambda: gone_by_stage(router, stage) == gone_before + 1, 10, 0.02, what="counted gone")
        except AssertionError as failed:  # where it went instead says why
            _, waiting, running = replica_counts(replica)
            gone = gone_counts(router)
            raise AssertionError(f"{failed}: gone {gone}, replica waiting {waiting} running {running}") from None
        wait_until(lambda: held() == 0, 10, 0.02, what="dropped")
        assert replica_counts(replica)[2] == 1, "the holder finished before the case was decided: make it longer"
    finally:  # on failure too: a case left running would be computed in the next one
        holder.leave()
        if leaver is not None:
            leaver.leave()
    wait_until(lambda: replica_counts(replica)[2] == 0, 30, 0.02, what="the holder aborted")
    computed = settled_prompt_tokens(replica) - before
    others = prompt_tokens(replica, HOLD_PROMPT) + prompt_tokens(replica, MARKER_PROMPT)
    leaver = prompt_tokens(replica, LONG_PROMPT)
    print(
        f"left while {stage}, stream={stream}: the replica computed {computed:.0f} prompt tokens, {others} the "
        f"holder's and the marker's: the leaver cost {computed - others:.0f} of its {leaver}"
    )
    return computed - others


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_leaves_while_queued_in_the_router_is_never_sent(
    one_seq_replica: str, router: RouterProcess, stream: bool
) -> None:
    assert leaves_while_held(one_seq_replica, router.url, router.url, "queued", stream) == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_leaves_while_waiting_in_vllm_behind_outside_load_costs_no_prefill(
    one_seq_replica: str, router: RouterProcess, stream: bool
) -> None:
    # The holder straight at the replica: load the router does not see.
    assert leaves_while_held(one_seq_replica, router.url, one_seq_replica, "replica", stream) == 0


def test_a_client_that_leaves_during_a_retrys_back_off_is_not_sent_again() -> None:
    """Two stand-in replicas that answer 503 (a real vLLM cannot be made to): the first attempt fails, the
    client leaves while the retry waits its back-off (1.5-3 s with `--retry-backoff 3`), and no second attempt
    reaches either replica."""
    busy = {"/v1/completions": lambda seen: json_answer({"error": {"message": "busy"}}, 503)}
    with RawReplica(dict(busy)) as first, RawReplica(dict(busy)) as second:
        router = start_router([first.url, second.url], "least_loaded", "--retries", "1", "--retry-backoff", "3")
        try:
            sent = lambda: len(first.requests("/v1/completions")) + len(second.requests("/v1/completions"))  # noqa: E731
            leaver = Client(router.url, {"model": "m", "prompt": "hi", "max_tokens": 1})
            wait_until(lambda: sent() == 1, 10, 0.01, what="the first attempt")
            time.sleep(0.2)  # into the back-off, which lasts 1.5 s at least
            leaver.leave()
            wait_until(lambda: gone_by_stage(router.url, "backoff") == 1, 5, 0.02, what="counted gone in back-off")
            time.sleep(3.2)  # past the longest back-off: a retry that was still coming would have come
            assert sent() == 1
        finally:
            stop_router(router)


def test_a_client_that_leaves_while_waiting_for_a_replica_to_start_stops_asking_for_one() -> None:
    """A fleet at zero (`--cold-start-wait`): a request waits in the router for a replica to start and is counted
    by the scale signal; its client leaves long before the wait's end, and it is counted gone (queued) and no
    longer waiting at once, so a replica is not started for no one."""
    router = start_router([], "least_loaded", "--cold-start-wait", "60", expect_healthy=0)
    try:
        wait_until(lambda: router_ready(router.url), 60, what="the router ready (to wait for a replica)")
        waiting = lambda: httpx.get(f"{router.url}/admin/scale", timeout=5).json()["waiting_for_replica"]  # noqa: E731
        leaver = Client(router.url, {"model": "m", "prompt": "hi", "max_tokens": 1})
        wait_until(lambda: waiting() == 1, 10, 0.02, what="waiting for a replica")
        leaver.leave()
        wait_until(lambda: gone_by_stage(router.url, "queued") == 1, 5, 0.02, what="counted gone while waiting")
        assert waiting() == 0
    finally:
        stop_router(router)
