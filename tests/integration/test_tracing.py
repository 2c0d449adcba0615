"""Traces (`--otlp-traces-endpoint`), received by a real OTLP/gRPC receiver the test runs: a request is a
server span in the client's trace (or a new one), with its admission, routing decision and attempts under
it (a retry a sibling), and the replica gets the attempt's context in `traceparent`. The replicas are
scripted stand-ins here, to see the headers they receive and to make one fail on demand."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from benchmarks.otlp_receiver import OtlpReceiver, ReceivedSpan
from dpserve.tiny_model import TINY_MODEL_NAME
from tests.integration.conftest import Fleet, start_router, stop_router
from tests.integration.raw_replica import RawReplica, Seen, json_answer

pytestmark = pytest.mark.integration

SERVER, CLIENT = 2, 3  # OTLP span kinds
EXPORT_WAIT_S = 15


def chat_answer(seen: Seen) -> bytes:
    if orjson.loads(seen.body).get("stream"):
        usage = b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}'
        body = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\ndata: ' + usage + b"\n\ndata: [DONE]\n\n"
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(body)
        return head + body
    usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    return json_answer(
        {"object": "chat.completion", "choices": [{"index": 0, "message": {"content": "x"}}], "usage": usage}
    )


def unavailable(seen: Seen) -> bytes:
    return json_answer({"error": {"message": "busy"}}, 503)


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[OtlpReceiver, RawReplica, RawReplica, str]]:
    """A receiver, a replica that answers, one that is always unavailable (its requests are retried on the
    other), and a router exporting to the receiver."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s, not the SDK's 5 s
    monkeypatch.setenv("OTEL_SERVICE_NAME", "router-under-test")
    with OtlpReceiver() as receiver, RawReplica({"/v1/chat/completions": chat_answer}) as good:
        with RawReplica({"/v1/chat/completions": unavailable}) as bad:
            router = start_router([good.url, bad.url], "round_robin", "--otlp-traces-endpoint", receiver.endpoint)
            try:
                yield receiver, good, bad, router.url
            finally:
                stop_router(router)


def chat(url: str, stream: bool, traceparent: str | None = None, model: str = "m") -> None:
    headers = {"traceparent": traceparent} if traceparent else {}
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": 4}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text


def one_trace(
    receiver: OtlpReceiver, trace_id: str, attempts: int, service: str = "dpserve-router"
) -> tuple[ReceivedSpan, list[ReceivedSpan]]:
    """The router's server span of the trace, and its attempts, once all of them arrived (vLLM's own
    span is a server span too: the service tells them apart)."""
    (server,) = receiver.wait_for(1, EXPORT_WAIT_S, trace_id=trace_id, kind=SERVER, service=service)  # type: ignore[arg-type]
    found = receiver.wait_for(attempts, EXPORT_WAIT_S, trace_id=trace_id, kind=CLIENT, service=service)  # type: ignore[arg-type]
    return server, found


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_joins_the_clients_trace_and_the_replica_gets_the_attempts_context(
    traced: tuple[OtlpReceiver, RawReplica, RawReplica, str], stream: bool
) -> None:
    receiver, good, bad, url = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    # Round robin: of two requests, one goes first to the unavailable replica and is retried on the other.
    for _ in range(2):
        chat(url, stream, f"00-{trace_id}-{client_span}-01")
    servers = receiver.wait_for(2, EXPORT_WAIT_S, trace_id=trace_id, kind=SERVER)  # type: ignore[arg-type]
    assert len(servers) == 2 and all(s.parent_id == client_span for s in servers), servers
    assert {s.service for s in servers} == {"router-under-test"}
    attempts = receiver.wait_for(3, EXPORT_WAIT_S, trace_id=trace_id, kind=CLIENT)  # type: ignore[arg-type]
    assert len(attempts) == 3, attempts  # 1 + (1 failed + its retry)
    by_server = {s.span_id: [a for a in attempts if a.parent_id == s.span_id] for s in servers}
    assert sorted(len(found) for found in by_server.values()) == [1, 2]  # the retry is its first try's sibling
    # Each request's status and usage on its span; the decision under it.
    assert all(s.attributes["http.response.status_code"] == 200 for s in servers)
    assert all(s.attributes["gen_ai.usage.input_tokens"] == 5 for s in servers)
    routes = [attributes for s in servers for name, attributes in s.events if name == "route"]
    assert len(routes) == 3 and all(r["dpserve.policy"] == "round_robin" for r in routes)  # one per attempt
    # What each replica received: the context of the attempt that reached it, in the client's trace.
    sent = {seen.headers["traceparent"] for replica in (good, bad) for seen in replica.requests("/v1/chat/completions")}
    assert sent == {f"00-{trace_id}-{a.span_id}-01" for a in attempts}
    assert all("first byte" in a.event_names for a in attempts)  # the 503 was an answer too
    assert sum(1 for a in attempts if a.attributes.get("dpserve.retried")) == 1


def test_a_request_without_a_trace_starts_one_the_replica_shares(
    traced: tuple[OtlpReceiver, RawReplica, RawReplica, str],
) -> None:
    receiver, good, bad, url = traced
    chat(url, stream=False)
    (received,) = [s for r in (good, bad) for s in r.requests("/v1/chat/completions")][-1:]
    _, trace_id, parent, _ = received.headers["traceparent"].split("-")
    server, attempts = one_trace(receiver, trace_id, 1, "router-under-test")
    assert server.parent_id == "" and parent in {a.span_id for a in attempts}


def test_a_router_that_does_not_trace_passes_the_clients_context_on() -> None:
    """So a tracing vLLM still joins the client's trace; and a request without one gets none."""
    traceparent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
    with RawReplica({"/v1/chat/completions": chat_answer}) as replica:
        router = start_router([replica.url], "least_loaded")
        try:
            chat(router.url, stream=False, traceparent=traceparent)
            chat(router.url, stream=True)
        finally:
            stop_router(router)
    passed, plain = replica.requests("/v1/chat/completions")
    assert passed.headers["traceparent"] == traceparent and "traceparent" not in plain.headers


def test_vllm_puts_its_span_under_the_routers_attempt(
    fleet: Fleet, fleet_traces: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session fleet's real vLLM CPU replicas, started with their own `--otlp-traces-endpoint`, the same
    receiver as the router's (conftest's `fleet_traces`): with the client's `traceparent`, the router's spans
    and vLLM's are in the client's trace, vLLM's under the router's attempt; without one, they share one new
    trace. Streamed and not."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    receiver = fleet_traces
    router = start_router(fleet.replica_urls, "least_loaded", "--otlp-traces-endpoint", receiver.endpoint)
    try:
        traces = []
        for stream in (False, True):
            trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
            chat(router.url, stream, f"00-{trace_id}-{client_span}-01", model=TINY_MODEL_NAME)
            traces.append((trace_id, client_span))
        chat(router.url, False, model=TINY_MODEL_NAME)
    finally:
        stop_router(router)
    for trace_id, client_span in traces:
        server, attempts = one_trace(receiver, trace_id, 1)
        assert server.parent_id == client_span
        vllm = engine_spans(receiver, trace_id)
        assert vllm and vllm[0].parent_id in {a.span_id for a in attempts}, (vllm, attempts)
    # The request without a trace: vLLM's span in the router's new trace, under its attempt.
    servers = receiver.wait_for(3, EXPORT_WAIT_S, kind=SERVER, service="dpserve-router")  # type: ignore[arg-type]
    roots = [s for s in servers if s.parent_id == ""]
    assert len(roots) == 1
    attempts = receiver.wait_for(1, EXPORT_WAIT_S, trace_id=roots[0].trace_id, kind=CLIENT)  # type: ignore[arg-type]
    vllm = engine_spans(receiver, roots[0].trace_id)
    assert vllm and vllm[0].parent_id == attempts[0].span_id


def engine_spans(receiver: OtlpReceiver, trace_id: str) -> list[ReceivedSpan]:
    """vLLM's spans of the trace: those not from the router (vLLM names no service of its own)."""
    deadline = time.monotonic() + EXPORT_WAIT_S
    while True:
        found = [s for s in receiver.wait_for(1, 0.1, trace_id=trace_id) if s.service != "dpserve-router"]
        if found or time.monotonic() > deadline:
            return found


def test_a_request_the_sampler_drops_tells_the_replica_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not sampled (`OTEL_TRACES_SAMPLER=always_off`): no spans exported, and the replica is told the trace
    is not sampled, so a tracing vLLM records none either."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    with OtlpReceiver() as receiver, RawReplica({"/v1/chat/completions": chat_answer}) as replica:
        router = start_router([replica.url], "least_loaded", "--otlp-traces-endpoint", receiver.endpoint)
        try:
            chat(router.url, stream=False)
            chat(router.url, stream=True)
        finally:
            stop_router(router)
        assert receiver.spans == []
    sent = [seen.headers["traceparent"] for seen in replica.requests("/v1/chat/completions")]
    # The flags' lowest bit is `sampled` (the SDK also sets 0x02: its trace ids are random).
    assert len(sent) == 2 and all(int(value.rsplit("-", 1)[1], 16) & 1 == 0 for value in sent), sent


def test_every_worker_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--workers 2`: each worker exports its own requests' spans (new connections: the kernel spreads
    them over both), one trace per request, none lost."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    with OtlpReceiver() as receiver, RawReplica({"/v1/chat/completions": chat_answer}) as replica:
        flags = ("--workers", "2", "--otlp-traces-endpoint", receiver.endpoint)
        router = start_router([replica.url], "least_loaded", *flags)
        try:
            traces = [secrets.token_hex(16) for _ in range(20)]
            for trace_id in traces:
                chat(router.url, stream=False, traceparent=f"00-{trace_id}-{secrets.token_hex(8)}-01")
            servers = receiver.wait_for(20, EXPORT_WAIT_S, kind=SERVER)  # type: ignore[arg-type]
        finally:
            stop_router(router)
    assert sorted(s.trace_id for s in servers) == sorted(traces)
