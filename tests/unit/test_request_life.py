"""A request's life as one object: its events reach every watch, it ends once with one outcome, and each
feature (metrics, flow control, receipts, shadows) keeps its own state in its watch. A stream's relay is
its one loop and its one end (no sockets: a scripted upstream response)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import generate_latest

from dpserve.policies import make_policy
from dpserve.policies.base import Decision, ReplicaSnapshot, RequestFeatures
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.flow.admission import Admission
from dpserve.router.flow.gate import Flow
from dpserve.router.flow.quotas import QuotaBook
from dpserve.router.flow.tenants import Tenants
from dpserve.router.flow.usage import UsageBook
from dpserve.router.flow.usage_stream import UsageTap
from dpserve.router.http.errors import CLIENT_CLOSED
from dpserve.router.http.upstream_client import Address, UpstreamPool
from dpserve.router.observe.life import Choice, RequestLife, Usage, Watch
from dpserve.router.observe.metrics import RouterMetrics
from dpserve.router.quality.receipts import ReceiptBook
from dpserve.router.quality.shadows import ShadowScorer
from dpserve.router.routing.dispatch import SSE_DONE, OpenStreams, Streaming
from tests.unit.test_upstream import Handler, read_request, serving

FEATURES = RequestFeatures("chat_completions", "m", True)
CANDIDATES = [ReplicaSnapshot("r0"), ReplicaSnapshot("r1", in_flight=2)]


class Recorder(Watch):
    __slots__ = ("events",)

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def admitted(self, waited_s: float) -> None:
        self.events.append(("admitted", waited_s))

    def decided(self, choice: Choice) -> None:
        self.events.append(("decided", choice.decision.id))

    def dispatched(self, replica_id: str, at: float) -> None:
        self.events.append(("dispatched", replica_id))

    def first_byte(self, replica_id: str, at: float) -> None:
        self.events.append(("first_byte", replica_id))

    def finished(self, life: RequestLife) -> None:
        self.events.append(("finished", life.status, life.refused))


def choice(replica: str) -> Choice:
    return Choice("least_loaded", Decision(replica, "least_loaded"), FEATURES, CANDIDATES, 0)


def test_every_watch_sees_each_event_in_order_and_the_end_once() -> None:
    life = RequestLife("req-1", "chat_completions")
    first, second = Recorder(), Recorder()
    life.watch(first)
    life.watch(None)  # a feature that does not follow this request
    life.watch(second)
    life.admitted(0.25)
    life.decided(choice("r0"))
    life.dispatched("r0")
    life.decided(choice("r1"))  # a retry elsewhere
    life.dispatched("r1")
    life.first_byte("r1", True)
    life.finish(200, Usage(10, 2, 4))
    life.finish(502)  # a second end is ignored: the first outcome stands
    expected = [
        ("admitted", 0.25),
        ("decided", "r0"),
        ("dispatched", "r0"),
        ("decided", "r1"),
        ("dispatched", "r1"),
        ("first_byte", "r1"),
        ("finished", 200, False),
    ]
    assert first.events == expected and second.events == expected
    assert (life.status, life.replica_id, life.stream, life.usage) == (200, "r1", True, Usage(10, 2, 4))


def metric(metrics: RouterMetrics, line_start: str) -> float:
    text = generate_latest(metrics.registry).decode()
    found = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)]
    return sum(found)


def test_the_metrics_watch_counts_an_answer_a_refusal_and_a_client_gone_by_their_one_outcome() -> None:
    metrics = RouterMetrics(ReplicaRegistry([]), "least_loaded")
    answered = RequestLife("a", "chat_completions")
    answered.model = "m"
    answered.watch(metrics.watch(answered))
    answered.admitted(0.0)
    answered.first_byte("r0", True)
    answered.finish(200)
    refused = RequestLife("b", "chat_completions")
    refused.watch(metrics.watch(refused))
    refused.finish(429, refused=True)
    gone = RequestLife("c", "completions")
    gone.watch(metrics.watch(gone))
    gone.finish(CLIENT_CLOSED)  # the client left before any answer began
    requests = 'dpserve_requests_total{endpoint="chat_completions",'
    assert metric(metrics, requests + 'model="m",replica="r0",status="200"}') == 1
    assert metric(metrics, requests + 'model="none",replica="none",status="429"}') == 1
    assert metric(metrics, 'dpserve_rejected_requests_total{status="429"}') == 1
    assert (
        metric(metrics, 'dpserve_requests_total{endpoint="completions",model="none",replica="none",status="499"}') == 1
    )
    assert metric(metrics, "process_cpu_seconds_total") > 0  # the process's own metrics, beside the router's
    assert metric(metrics, 'dpserve_client_disconnects_total{endpoint="completions",stage="received"}') == 1
    assert metric(metrics, 'dpserve_time_to_first_byte_seconds_count{endpoint="chat_completions",stream="true"}') == 1
    assert metric(metrics, 'dpserve_request_duration_seconds_count{endpoint="chat_completions",stream="true"}') == 1
    assert metric(metrics, "dpserve_queue_wait_seconds_count") == 1


def test_a_client_that_leaves_is_counted_by_where_its_request_was() -> None:
    """Each stage a request passes on the path, and the label its client's leaving gets there."""
    metrics = RouterMetrics(ReplicaRegistry([]), "least_loaded")

    def gone_at(request_id: str, *steps: str) -> RequestLife:
        life = RequestLife(request_id, "completions")
        life.watch(metrics.watch(life))
        for step in steps:
            if step == "checked":
                life.checked()
            elif step == "backing_off":
                life.backing_off()
            elif step == "dispatched":
                life.dispatched("r0")
            else:
                life.first_byte("r0", True)
        life.finish(CLIENT_CLOSED)
        return life

    lives = [
        gone_at("reading"),
        gone_at("in-queue", "checked"),
        gone_at("at-replica", "checked", "dispatched"),
        gone_at("between-attempts", "checked", "dispatched", "backing_off"),
        gone_at("retried", "checked", "dispatched", "backing_off", "dispatched"),
        gone_at("streaming", "checked", "dispatched", "first_byte"),
    ]
    assert [life.stage for life in lives] == ["received", "queued", "replica", "backoff", "replica", "answering"]
    gone = 'dpserve_client_disconnects_total{endpoint="completions",stage='
    counts = {stage: metric(metrics, f'{gone}"{stage}"}}') for stage in ("received", "queued", "backoff", "replica")}
    assert counts == {"received": 1, "queued": 1, "backoff": 1, "replica": 2}
    assert metric(metrics, f'{gone}"answering"}}') == 1


def test_flow_controls_pass_charges_once_across_retries_and_counts_what_the_answer_took() -> None:
    admission = Admission(0, 10, 5.0, flow_control=True)
    usage = UsageBook(named=frozenset({"alice"}))
    flow = Flow(Tenants.from_specs([], [], open_access=True), QuotaBook(), usage, admission)
    tenant = flow.identify(None, {"x-dpserve-tenant": "alice"})
    life = RequestLife("req", "chat_completions")
    flow_pass = flow.begin(tenant, FEATURES, {"max_tokens": 16}, 400)
    life.watch(flow_pass)
    guess = flow_pass.ticket.cost
    assert guess == 400 // 4 + 16
    life.admitted(0.5)
    life.admitted(0.25)  # the retry's admission charges nothing more
    assert (flow_pass.ticket.charged, flow_pass.ticket.cost, flow_pass.ticket.queue_s) == (guess, 0.0, 0.75)
    life.finish(200, Usage(prompt_tokens=90, completion_tokens=10, cached_tokens=30))
    counts = usage.totals_by_label()["alice"]
    assert (counts.requests, counts.errors, counts.prompt_tokens, counts.cached_tokens) == (1, 0, 90, 30)
    assert counts.queue_s == pytest.approx(0.75)


def test_a_receipt_keeps_the_last_decision_and_closes_with_the_outcome() -> None:
    book = ReceiptBook(sample=0.0)
    assert book.watch("x", "chat_completions", "m", "t") is None  # not in the sample
    watch = book.watch("req", "chat_completions", "m", "t", asked=True)
    assert watch is not None
    life = RequestLife("req", "chat_completions")
    life.watch(watch)
    life.decided(choice("r0"))
    life.decided(choice("r1"))
    life.dispatched("r1")
    life.finish(200, Usage(12, 3, 0))
    (receipt,) = book.recent(1)
    assert (receipt["replica"], receipt["status"], receipt["prompt_tokens"]) == ("r1", 200, 12)
    assert receipt["replica_s"] is not None and receipt["class"] == "unscored"


def test_the_shadows_choice_for_a_failed_attempt_ends_when_the_next_decision_comes() -> None:
    scorer = ShadowScorer([make_policy("least_loaded")], lambda _: 0)
    life = RequestLife("req", "chat_completions")
    life.watch(scorer.watch(life))
    life.decided(choice("r0"))
    assert sum(scorer.shadows[0].in_flight.values()) == 1
    life.decided(choice("r1"))  # a retry: the first attempt's shadow choice is over
    assert sum(scorer.shadows[0].in_flight.values()) == 1
    life.finish(200)
    assert scorer.shadows[0].in_flight == {}


def chunked_stream(chunks: list[bytes | None]) -> Handler:
    """A replica streaming `data: 1` and then `chunks` as separate chunked writes; `None` drops the connection
    there (abruptly: no terminating chunk). Real sockets, not a stand-in: the compiled build takes only the
    real classes (a fake UpstreamResponse or registry is refused by its type)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for chunk in [b"data: 1\n\n", *chunks]:
            if chunk is None:
                writer.transport.abort()
                return
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
            await asyncio.sleep(0.01)  # one read each, as a replica's tokens come
        writer.write(b"0\r\n\r\n")
        await reader.read()  # keep-alive until the router lets the connection go

    return handle


async def stream(address: Address, pool: UpstreamPool, registry: ReplicaRegistry, streams: OpenStreams) -> Streaming:
    """A stream from the replica at `address` whose first bytes are in, its slot taken, as the dispatcher
    hands it to the exchange."""
    metrics = RouterMetrics(registry, "least_loaded")
    (replica,) = registry
    registry.acquire(replica.id)
    response = await pool.post(address, "/v1/completions", b"{}", {})
    first = await response.readany()
    return Streaming(replica.id, 200, "text/event-stream", response, first, registry, metrics, streams)


async def relay(streaming: Streaming, leave_after: int | None = None) -> list[bytes]:
    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            if leave_after is not None and len(sent) >= leave_after:
                raise asyncio.CancelledError  # the client left: the exchange's task is cancelled
            sent.append(message["body"])

    try:
        await streaming.relay(send, [], UsageTap(False))
    except asyncio.CancelledError:
        pass
    return sent


@pytest.mark.parametrize(
    ("chunks", "leave_after", "outcome", "upstream_end"),
    [
        ([b"data: 2\n", b"\n", SSE_DONE], None, 200, "released"),  # whole, an event split across reads
        ([b"data: 2\n\n", None], None, 502, "closed"),  # the replica broke off: an error event and [DONE]
        ([b"data: 2\n\n", b"data: 3\n\n", SSE_DONE], 1, CLIENT_CLOSED, "closed"),  # the client left
    ],
)
async def test_a_stream_relays_in_one_loop_and_ends_once_with_one_outcome(
    chunks: list[bytes | None], leave_after: int | None, outcome: int, upstream_end: str
) -> None:
    streams = OpenStreams()
    async with serving(chunked_stream(chunks)) as (address, _):
        registry, pool = ReplicaRegistry([f"http://{address.host_header}"]), UpstreamPool()
        streaming = await stream(address, pool, registry, streams)
        sent = await relay(streaming, leave_after)
        (replica,) = registry
        assert streaming.outcome == outcome and replica.in_flight == 0  # its slot given back once
        # Whole, the connection went back to the pool; otherwise it was dropped (the replica aborts the request).
        assert len(pool._idle.get(address, [])) == (upstream_end == "released")
        assert streams.cut_all("gone") == 0  # it left the open streams
    if outcome == 200:
        assert b"".join(sent) == b"data: 1\n\ndata: 2\n\n" + SSE_DONE
    if outcome == 502:
        assert sent[-3].startswith(b'data: {"error"') and sent[-2] == SSE_DONE and sent[-1] == b""
        assert (replica.last_error or "").startswith("stream broke")  # the replica is blamed
