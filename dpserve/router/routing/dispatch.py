"""Sending one request to the replica the selector chooses: admission (waiting for room), the attempt,
retries on other replicas before the first byte (never after), and the replica's slot returned when the
answer, buffered or streamed, is done."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

import orjson
from starlette.types import Send

from dpserve.policies.base import ReplicaView, RequestFeatures, pick_least_loaded
from dpserve.policies.slo import FAIR_CHANCE
from dpserve.replicas.access import KEY_REFUSED
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.health import Outcome, classify_status
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.flow.admission import Admission, Ticket
from dpserve.router.flow.slo import slo_unattainable
from dpserve.router.flow.usage_stream import UsageTap
from dpserve.router.http.errors import CLIENT_CLOSED, OpenAIError, no_replica, replica_misconfigured
from dpserve.router.http.upstream_client import (
    Address,
    ReplicaMisconfigured,
    ResponseTooLarge,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
)
from dpserve.router.observe.life import RequestLife
from dpserve.router.observe.logs import request_fields
from dpserve.router.observe.metrics import RouterMetrics
from dpserve.router.routing.adapter_loader import AdapterLoader, AdapterLoadFailed
from dpserve.router.routing.selection import Selector

log = logging.getLogger("dpserve.dispatch")

SSE_EVENT_END = b"\n\n"
SSE_DONE = b"data: [DONE]\n\n"
# Failures before any byte reached the client: the request may safely go to another replica.
RETRYABLE = (UpstreamError, TimeoutError)
# Answers another replica may do better with: its failure or its backpressure.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
DATA_PARALLEL_RANK = "X-data-parallel-rank"
"""vLLM's request header that sends a request to one engine of a data-parallel server."""


@dataclass(frozen=True)
class RetryRules:
    """How many other replicas a request may try before its first byte, and the pause between tries:
    exponential from `backoff_s`, capped, with full jitter so retries of many requests do not align."""

    retries: int = 2
    backoff_s: float = 0.025
    backoff_cap_s: float = 0.5

    def pause(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.5, 1.0) * min(self.backoff_cap_s, self.backoff_s * 2.0 ** (attempt - 1))


@dataclass(init=False)
class Outbound:
    """What goes to a replica: the method, the path (with any query string), the body and headers."""

    method: str
    path: str
    body: bytes
    headers: dict[str, str]

    def __init__(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> None:
        # Written out: dataclass's __init__ is interpreted even when compiled (see policies.base.RequestFeatures).
        self.method = method
        self.path = path
        self.body = body
        self.headers = headers


@dataclass(init=False)
class Buffered:
    """A complete, non-streamed answer."""

    replica_id: str
    status: int
    content_type: str
    body: bytes
    retry_after: str | None
    """The replica's Retry-After, relayed on 429 and 503."""

    def __init__(
        self, replica_id: str, status: int, content_type: str, body: bytes, retry_after: str | None = None
    ) -> None:
        # Written out: dataclass's __init__ is interpreted even when compiled (see policies.base.RequestFeatures).
        self.replica_id = replica_id
        self.status = status
        self.content_type = content_type
        self.body = body
        self.retry_after = retry_after


class OpenStreams:
    """The streams being relayed, so a shutdown past its grace period can end each one properly."""

    def __init__(self) -> None:
        self._streams: set[Streaming] = set()

    def add(self, stream: Streaming) -> None:
        self._streams.add(stream)

    def discard(self, stream: Streaming) -> None:
        self._streams.discard(stream)

    def cut_all(self, reason: str) -> int:
        """Ends every open stream (see `Streaming.cut`); how many there were."""
        streams = list(self._streams)
        for stream in streams:
            stream.cut(reason)
        return len(streams)


class Streaming:
    """An open stream whose first event has arrived, and its whole life: `relay` is its one loop, from the
    replica to the client, and its one end, which drops or returns the upstream connection, returns the
    replica's slot, leaves the open streams and sets the one `outcome`."""

    def __init__(
        self,
        replica_id: str,
        status: int,
        content_type: str,
        resp: UpstreamResponse,
        first: bytes,
        registry: ReplicaRegistry,
        metrics: RouterMetrics,
        open_streams: OpenStreams,
        adapter: str | None = None,
        request_id: str | None = None,
    ) -> None:
        self.replica_id = replica_id
        self._request_id = request_id
        self._adapter = adapter
        self.status = status
        self.content_type = content_type
        self.first = first
        """The stream's first bytes, read before the router committed to this replica."""
        self.completed = False
        self._done = False
        """`[DONE]` reached the client: whatever happens after, it was served."""
        self.broken = False
        self.ending = False
        """The last message is on its way to the client: a disconnect from here on is the exchange's end."""
        self.outcome = CLIENT_CLOSED
        """The status the client's request ended with: the replica's, 502 when the stream broke, 499 when
        the client left before `[DONE]`."""
        self._resp = resp
        self._registry = registry
        self._metrics = metrics
        self._cut_reason: str | None = None
        self._open = open_streams
        open_streams.add(self)

    def cut(self, reason: str) -> None:
        """End the stream early on the router's own behalf (shutdown past its grace period): the
        client still gets an error event and [DONE], and the replica is not blamed."""
        self._cut_reason = reason
        self._resp.close()

    async def relay(self, send: Send, headers: list[tuple[bytes, bytes]], tap: UsageTap) -> None:
        """Relays the stream to the client as it comes, cut at event boundaries so a broken stream never
        ends mid-event, each event through `tap` (usage read, and taken out when the router asked for it)."""
        try:
            await send({"type": "http.response.start", "status": self.status, "headers": headers})
            await self._relay_events(send, tap)
            held = tap.flush()  # a last event held back to see whether a usage chunk followed it
            if held:
                await send({"type": "http.response.body", "body": held, "more_body": True})
            self.ending = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._end(self._done)

    def _end(self, done: bool) -> None:
        self._open.discard(self)
        if self.completed:
            self._resp.release()  # whole: the connection goes back to the pool
        else:
            # Closing drops the connection, so the replica aborts the request when the client left.
            self._resp.close()
        self._registry.release(self.replica_id)
        if self._adapter is not None:
            self._registry.release_adapter(self.replica_id, self._adapter)
        if self.broken:
            self.outcome = 502
        elif self.completed or done:
            self.outcome = self.status

    async def _relay_events(self, send: Send, tap: UsageTap) -> None:
        """The replica's chunks as they arrive, whole events only; on a break, an error event and [DONE].
        A loop rather than an async generator: mypyc compiles this file and has none. Only the replica's
        reads are in the `try`: the client's send failing is the client's end, not a broken stream."""
        pending = b""
        resp = self._resp
        chunk = self.first
        while chunk:
            if not pending and chunk.endswith(SSE_EVENT_END):
                await self._forward(chunk, send, tap)
            else:
                data = pending + chunk
                cut = data.rfind(SSE_EVENT_END)
                if cut < 0:
                    pending = data
                else:
                    pending = data[cut + 2 :]
                    await self._forward(data[: cut + 2], send, tap)
            try:
                chunk = await resp.readany()
            except RETRYABLE as exc:
                # Bytes already reached the client, so no retry: end the stream cleanly with an error.
                self.broken = True
                await self._forward(self._break_event(type(exc).__name__), send, tap)
                await self._forward(SSE_DONE, send, tap)
                return
        if pending:
            await self._forward(pending, send, tap)
        self.completed = True

    async def _forward(self, event: bytes, send: Send, tap: UsageTap) -> None:
        out = tap.feed(event)
        if out:
            await send({"type": "http.response.body", "body": out, "more_body": True})
            self._done = out.endswith(SSE_DONE)

    def _break_event(self, error: str) -> bytes:
        """The error event a broken stream ends with: the router's own reason when it cut the stream."""
        if self._cut_reason is not None:
            return stream_error_event(self._cut_reason, "router_shutdown")
        log.warning(
            "stream from replica %s broke mid-response (%s)",
            self.replica_id,
            error,
            extra={"request_id": self._request_id, "replica": self.replica_id},
        )
        self._registry.observe(self.replica_id, Outcome.FAILED, f"stream broke: {error}")
        self._metrics.broken_streams.labels(self.replica_id).inc()
        return stream_error_event("The replica serving this stream failed mid-response.")


class Dispatcher:
    def __init__(
        self,
        registry: ReplicaRegistry,
        catalog: ModelCatalog,
        selector: Selector,
        upstream: UpstreamPool,
        metrics: RouterMetrics,
        retry: RetryRules,
        admission: Admission,
        open_streams: OpenStreams,
        rng: random.Random | None = None,
        adapters: AdapterLoader | None = None,
    ) -> None:
        self._adapters = adapters
        self._registry = registry
        self._catalog = catalog
        self._selector = selector
        self._upstream = upstream
        self._addresses: dict[str, Address] = {}
        self._metrics = metrics
        self._retry = retry
        self._admission = admission
        self._open_streams = open_streams
        self._rng = rng or random.Random()

    async def send(
        self, features: RequestFeatures, request: Outbound, life: RequestLife, ticket: Ticket | None = None
    ) -> Buffered | Streaming:
        """To the replica the selector chooses, retried on others before the first byte; each step told to
        the request's `life`. `ticket`: the request's tenant and expected cost for the admission queue."""
        tried: list[str] = []
        last_failure: Buffered | None = None
        last_load_failure: AdapterLoadFailed | None = None
        refusals: list[tuple[str, str]] = []  # replicas that refused the router itself, and why
        retries = self._retry.retries
        for attempt in range(retries + 1):
            if attempt:
                life.backing_off()
                await asyncio.sleep(self._retry.pause(attempt, self._rng))
            candidates = await self._admitted(features, tried, ticket, life)
            if not candidates:
                break
            choice = self._selector.choose(features, candidates)
            life.decided(choice)
            slo = features.slo
            if slo is not None and not choice.decision.meets_slo and not slo.queue:
                raise slo_unattainable(slo, choice.decision.ttft_s, life.queued_s)  # at once, not after its deadline
            replica_id = choice.decision.id
            life.dispatched(replica_id)
            tried.append(replica_id)
            is_last = attempt == retries
            adapter = features.adapter
            try:
                if adapter is not None:
                    outcome = await self._adapter_attempt(replica_id, adapter, features, request, life)
                else:
                    outcome = await self._attempt(replica_id, features, request, life)
            except AdapterLoadFailed as failed:
                last_load_failure = failed
                if not is_last:
                    self._metrics.retries.labels("adapter_load").inc()
                continue
            except ReplicaMisconfigured as misconfigured:  # not `exc`: mypyc types a reused name by its first clause
                # Out of routing until a probe finds it usable; another replica may take the request.
                self._registry.set_misconfigured(replica_id, misconfigured.cause)
                refusals.append((replica_id, misconfigured.cause))
                if not is_last:
                    self._metrics.retries.labels("misconfigured").inc()
                continue
            except RETRYABLE as exc:
                reason = type(exc).__name__
                # Nothing listening there ejects at once; a dropped or slow connection counts towards it.
                refused = isinstance(exc, UpstreamConnectError)
                self._registry.observe(replica_id, Outcome.REFUSED if refused else Outcome.FAILED, reason)
                log.warning(
                    "replica %s failed before the first byte (%s)", replica_id, reason, extra=request_fields(life)
                )
                if not is_last:
                    self._metrics.retries.labels(reason).inc()
                continue
            status = outcome.status
            self._registry.observe(replica_id, classify_status(status), None if status < 300 else f"HTTP {status}")
            if status in RETRY_STATUSES and isinstance(outcome, Buffered) and not is_last:
                self._metrics.retries.labels(f"http_{status}").inc()
                last_failure = outcome
                continue
            return outcome
        if last_failure is not None:
            return last_failure
        refusals = refusals or self._catalog.refusing(features.model)
        if refusals:
            raise replica_misconfigured(refusals)
        if last_load_failure is not None:
            raise OpenAIError(
                502,
                f"The LoRA adapter `{last_load_failure.adapter}` could not be loaded on a replica: "
                f"{last_load_failure.message}",
                type="server_error",
                code="adapter_load_failed",
            )
        if not tried:
            raise no_replica(f"No healthy replica serves the model `{features.model}` right now.")
        raise OpenAIError(
            502,
            "The replica failed before answering and no other replica could take the request.",
            type="server_error",
            code="upstream_unavailable",
        )

    async def _adapter_attempt(
        self,
        replica_id: str,
        adapter: str,
        features: RequestFeatures,
        request: Outbound,
        life: RequestLife,
    ) -> Buffered | Streaming:
        """One attempt of a LoRA request: the adapter is loaded there first if it must be (requests for
        it meanwhile join that load), and it counts as in use there until the answer is done."""
        registry, loader = self._registry, self._adapters
        registry.hold_adapter(replica_id, adapter)  # before any await: not an idle adapter to unload
        handed_over = False
        try:
            if loader is not None:
                await loader.ready(replica_id, adapter)
            outcome = await self._attempt(replica_id, features, request, life, adapter)
            # 404 for an adapter it was thought to hold: the replica restarted, or someone unloaded it.
            # Loaded again there, and tried once more.
            if outcome.status == 404 and loader is not None and not isinstance(outcome, Streaming):
                loader.forget(replica_id, adapter)
                await loader.ready(replica_id, adapter)
                outcome = await self._attempt(replica_id, features, request, life, adapter)
            handed_over = isinstance(outcome, Streaming)
            return outcome
        finally:
            if not handed_over:
                registry.release_adapter(replica_id, adapter)

    async def send_to_any(
        self, features: RequestFeatures, request: Outbound, life: RequestLife
    ) -> Buffered | Streaming:
        """To any healthy replica, the least loaded, for what every replica answers alike (no model named)."""
        healthy = [replica for replica in self._registry.healthy() if not replica.draining]
        if not healthy:
            refusing = self._catalog.refusing(None)
            raise replica_misconfigured(refusing) if refusing else no_replica("No healthy replica to ask right now.")
        return await self.send_to(pick_least_loaded(healthy, self._rng).id, features, request, life)

    async def send_to(
        self, replica_id: str, features: RequestFeatures, request: Outbound, life: RequestLife | None
    ) -> Buffered | Streaming:
        """To one replica, chosen by what it holds (a stored response), not by a policy: no retry
        elsewhere, and a draining replica still answers for what it holds. `life` None: the router's own
        question (looking for a stored response), not a client's request."""
        replica = self._registry.find(replica_id)
        if replica is None or not replica.healthy:
            raise no_replica(f"The replica holding this ({replica_id}) is not available right now.")
        try:
            if life is not None:
                life.dispatched(replica_id)
            outcome = await self._attempt(replica_id, features, request, life)
        except ReplicaMisconfigured as misconfigured:
            self._registry.set_misconfigured(replica_id, misconfigured.cause)
            raise replica_misconfigured([(replica_id, misconfigured.cause)]) from None
        except RETRYABLE as exc:
            refused = isinstance(exc, UpstreamConnectError)
            self._registry.observe(replica_id, Outcome.REFUSED if refused else Outcome.FAILED, type(exc).__name__)
            raise OpenAIError(
                502, "The replica holding this failed before answering.", type="server_error", code="upstream_error"
            ) from None
        self._registry.observe(replica_id, classify_status(outcome.status), f"HTTP {outcome.status}")
        return outcome

    async def _admitted(
        self, features: RequestFeatures, tried: Sequence[str], ticket: Ticket | None, life: RequestLife
    ) -> list[ReplicaView]:
        """Candidates with room, after waiting in the admission queue when every one is full."""
        admission = self._admission
        candidates = self._selector.candidates
        if not admission.holds:
            return candidates(features, tried)
        admission.arrived(features.slo is not None)
        found = candidates(features, tried)
        priority = features.priority
        tenant, weight, cost = ("", 1.0, 0.0) if ticket is None else (ticket.tenant, ticket.weight, ticket.cost)
        # Room now and nobody waiting before it: admitted without the waiting path's closure and coroutine.
        if found and admission.admit_at_once(priority, tenant, weight, cost):
            waited = 0.0
        else:
            self._refuse_late(features, tried)

            def has_room() -> bool:
                nonlocal found
                found = candidates(features, tried)
                # No candidate at all is not a reason to wait: the caller answers at once.
                return bool(found) or all(r.id in tried for r in self._catalog.routable(features.model))

            slo = features.slo  # a promised first token is refused at its deadline, never sent after it
            within = slo.ttft_s if slo is not None and not slo.queue else None
            try:
                promised = slo is not None
                waited = await admission.wait_for_room(
                    has_room, priority, tenant, weight, cost, within, promised, features.model
                )
            except OpenAIError as rejected:
                self._metrics.admission_rejections.labels(rejected.code or "rejected").inc()
                raise
        life.admitted(waited)
        return found

    def _refuse_late(self, features: RequestFeatures, tried: Sequence[str]) -> None:
        """A request with a TTFT SLO that would wait in the router's queue is refused at once (429) when its
        expected wait there and then its first token on the nearest replica are predicted past its SLO, and
        recent waits give it no fair chance: it would only be refused at its deadline."""
        slo = features.slo
        if slo is None or slo.queue or slo.ttft_s is None:
            return
        admission = self._admission
        wait = admission.expected_wait_s(features.priority)
        nearest = self._selector.too_late(features, tried, wait)
        # Predicted late, it may still wait on a fair chance: a share of recent waits that ran as much shorter
        # than predicted as it needs (past its deadline it is refused there, never sent late).
        if nearest is not None and admission.wait_chance(wait, slo.ttft_s - (nearest - wait)) < FAIR_CHANCE:
            self._metrics.admission_rejections.labels("slo_unattainable").inc()
            raise slo_unattainable(slo, nearest)

    async def _attempt(
        self,
        replica_id: str,
        features: RequestFeatures,
        request: Outbound,
        life: RequestLife | None,
        adapter: str | None = None,
    ) -> Buffered | Streaming:
        """One try on one replica. Its slot is taken here and returned when the answer is read, or by the
        stream this hands over."""
        registry = self._registry
        replica = registry.get(replica_id)
        address = self._address(replica.url)
        registry.acquire(replica_id)
        handed_over = False
        resp: UpstreamResponse | None = None
        try:
            headers = request.headers
            if life is not None and life.trace_headers:  # this attempt's span, for the replica's to nest under
                headers = {**headers, **life.trace_headers}
            if replica.rank is not None:  # one engine of a data-parallel server: vLLM's header pins it
                headers = {**headers, DATA_PARALLEL_RANK: str(replica.rank)}
            resp = await self._upstream.request(address, request.method, request.path, request.body, headers)
            if resp.status == 401:  # vLLM's key check, the only 401 it gives: the router's key, not the client's
                if resp.sent_old_key:  # the key file changed meanwhile: tried again (elsewhere), no verdict
                    raise UpstreamError("it refused the replicas' previous key, replaced as the request went")
                raise ReplicaMisconfigured(KEY_REFUSED)
            content_type = resp.content_type
            stream = features.stream and resp.status == 200
            if not stream:
                if life is not None:
                    life.first_byte(replica_id, False)
                try:
                    answer = await resp.read()
                except ResponseTooLarge as exc:
                    # The router's own bound, the same on every replica: no retry, and not the replica's fault.
                    raise OpenAIError(
                        502,
                        f"The replica's answer is larger than this router's limit of {exc.limit} bytes "
                        "(--max-response-bytes); it was not relayed.",
                        type="server_error",
                        code="response_too_large",
                    ) from None
                return Buffered(replica_id, resp.status, content_type, answer, resp.retry_after)
            # Wait for the first event before committing to this replica: a replica that dies
            # before it can still be replaced, since the client has seen nothing yet.
            first = await resp.readany()
            if not first:
                raise UpstreamError("stream closed before the first event")
            if life is not None:
                life.first_byte(replica_id, True)
            handed_over = True
            return Streaming(
                replica_id,
                resp.status,
                content_type,
                resp,
                first,
                registry,
                self._metrics,
                self._open_streams,
                adapter,
                life.request_id if life is not None else None,
            )
        except BaseException:
            if resp is not None:
                resp.close()
            raise
        finally:
            if not handed_over:
                if resp is not None:
                    resp.release()
                registry.release(replica_id)

    def _address(self, url: str) -> Address:
        address = self._addresses.get(url)
        if address is None:
            address = self._addresses[url] = Address.from_url(url)
        return address


def stream_error_event(message: str, code: str = "stream_broken") -> bytes:
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + orjson.dumps(error) + SSE_EVENT_END
