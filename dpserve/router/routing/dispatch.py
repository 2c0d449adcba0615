"""Sending one request to the replica the selector chooses: admission (waiting for room), the attempt,
retries on other replicas before the first byte (never after), and the replica's slot returned when the
answer, buffered or streamed, is done."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import orjson

from dpserve.policies.base import ReplicaView, RequestFeatures, pick_least_loaded
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.health import Outcome, classify_status
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.flow.admission import Admission, Ticket
from dpserve.router.http.errors import OpenAIError, no_replica
from dpserve.router.http.upstream_client import (
    Address,
    ResponseTooLarge,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
)
from dpserve.router.observe.metrics import RouterMetrics
from dpserve.router.quality.receipts import Receipt
from dpserve.router.routing.adapter_loader import AdapterLoader, AdapterLoadFailed
from dpserve.router.routing.selection import Selector

log = logging.getLogger("dpserve.dispatch")

SSE_EVENT_END = b"\n\n"
SSE_DONE = b"data: [DONE]\n\n"
# Failures before any byte reached the client: the request may safely go to another replica.
RETRYABLE = (UpstreamError, TimeoutError)
# Answers another replica may do better with: its failure or its backpressure.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryRules:
    """How many other replicas a request may try before its first byte, and the pause between tries:
    exponential from `backoff_s`, capped, with full jitter so retries of many requests do not align."""

    retries: int = 2
    backoff_s: float = 0.025
    backoff_cap_s: float = 0.5

    def pause(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.5, 1.0) * min(self.backoff_cap_s, self.backoff_s * 2.0 ** (attempt - 1))


@dataclass(frozen=True, slots=True)
class Outbound:
    """What goes to a replica: the method, the path (with any query string), the body and headers."""

    method: str
    path: str
    body: bytes
    headers: dict[str, str]


@dataclass(slots=True)
class Buffered:
    """A complete, non-streamed answer."""

    replica_id: str
    status: int
    content_type: str
    body: bytes
    retry_after: str | None = None
    """The replica's Retry-After, relayed on 429 and 503."""


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
    """An open stream whose first event has arrived: its whole life on the replica's side. Iterate it to
    relay the rest; `finish` (idempotent) drops the upstream connection, returns the replica's slot and
    leaves the open streams, whether or not iteration ever began."""

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
        ends: Sequence[Callable[[], None]] = (),
    ) -> None:
        self.replica_id = replica_id
        self._ends = ends
        self._adapter = adapter
        self.status = status
        self.content_type = content_type
        self.completed = False
        self.broken = False
        self._resp = resp
        self._first = first
        self._registry = registry
        self._metrics = metrics
        self._finished = False
        self._cut_reason: str | None = None
        self._open = open_streams
        open_streams.add(self)

    def cut(self, reason: str) -> None:
        """End the stream early on the router's own behalf (shutdown past its grace period): the
        client still gets an error event and [DONE], and the replica is not blamed."""
        self._cut_reason = reason
        self._resp.close()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._relay()

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        self._open.discard(self)
        if self.completed:
            self._resp.release()  # whole: the connection goes back to the pool
        else:
            # Closing drops the connection, so the replica aborts the request when the client left.
            self._resp.close()
        self._registry.release(self.replica_id)
        if self._adapter is not None:
            self._registry.release_adapter(self.replica_id, self._adapter)
        for end in self._ends:
            end()

    async def _relay(self) -> AsyncIterator[bytes]:
        """Chunks as they arrive, cut at event boundaries so a broken stream never ends mid-event."""
        pending = b""
        resp = self._resp
        try:
            chunk = self._first
            while chunk:
                if not pending and chunk.endswith(SSE_EVENT_END):
                    yield chunk
                else:
                    data = pending + chunk
                    cut = data.rfind(SSE_EVENT_END)
                    if cut < 0:
                        pending = data
                    else:
                        pending = data[cut + 2 :]
                        yield data[: cut + 2]
                chunk = await resp.readany()
            if pending:
                yield pending
            self.completed = True
        except RETRYABLE as exc:
            # Bytes already reached the client, so no retry: end the stream cleanly with an error.
            self.broken = True
            if self._cut_reason is not None:
                yield stream_error_event(self._cut_reason, "router_shutdown")
                yield SSE_DONE
                return
            log.warning("stream from replica %s broke mid-response (%s)", self.replica_id, type(exc).__name__)
            self._registry.observe(self.replica_id, Outcome.FAILED, f"stream broke: {type(exc).__name__}")
            self._metrics.broken_streams.labels(self.replica_id).inc()
            yield stream_error_event("The replica serving this stream failed mid-response.")
            yield SSE_DONE
        finally:
            self.finish()


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
        clock: Callable[[], float] = time.perf_counter,
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
        self._clock = clock

    async def send(
        self,
        features: RequestFeatures,
        request: Outbound,
        started: float,
        ticket: Ticket | None = None,
        receipt: Receipt | None = None,
    ) -> Buffered | Streaming:
        """To the replica the selector chooses, retried on others before the first byte. `ticket`: the
        request's tenant and expected cost for the admission queue; it learns how long it waited. `receipt`:
        what the policy chose and predicted is written on it (on a retry, the last attempt's)."""
        tried: list[str] = []
        last_failure: Buffered | None = None
        last_load_failure: AdapterLoadFailed | None = None
        retries = self._retry.retries
        for attempt in range(retries + 1):
            if attempt:
                await asyncio.sleep(self._retry.pause(attempt, self._rng))
            candidates = await self._admitted(features, tried, ticket)
            if not candidates:
                break
            ends: list[Callable[[], None]] = []
            replica_id = self._selector.choose(features, candidates, receipt, ends).id
            if receipt is not None:
                receipt.dispatched = self._clock()
            tried.append(replica_id)
            is_last = attempt == retries
            adapter = features.adapter
            try:
                if adapter is not None:
                    outcome = await self._adapter_attempt(replica_id, adapter, features, request, started, ends)
                else:
                    outcome = await self._attempt(replica_id, features, request, started, ends=ends)
            except AdapterLoadFailed as failed:
                last_load_failure = failed
                if not is_last:
                    self._metrics.retries.labels("adapter_load").inc()
                continue
            except RETRYABLE as exc:
                reason = type(exc).__name__
                # Nothing listening there ejects at once; a dropped or slow connection counts towards it.
                refused = isinstance(exc, UpstreamConnectError)
                self._registry.observe(replica_id, Outcome.REFUSED if refused else Outcome.FAILED, reason)
                log.warning("replica %s failed before the first byte (%s)", replica_id, reason)
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
        started: float,
        ends: Sequence[Callable[[], None]] = (),
    ) -> Buffered | Streaming:
        """One attempt of a LoRA request: the adapter is loaded there first if it must be (requests for
        it meanwhile join that load), and it counts as in use there until the answer is done."""
        registry, loader = self._registry, self._adapters
        registry.hold_adapter(replica_id, adapter)  # before any await: not an idle adapter to unload
        handed_over = False
        try:
            if loader is not None:
                await loader.ready(replica_id, adapter)
            outcome = await self._attempt(replica_id, features, request, started, adapter, ends)
            # 404 for an adapter it was thought to hold: the replica restarted, or someone unloaded it.
            # Loaded again there, and tried once more.
            if outcome.status == 404 and loader is not None and not isinstance(outcome, Streaming):
                loader.forget(replica_id, adapter)
                await loader.ready(replica_id, adapter)
                outcome = await self._attempt(replica_id, features, request, started, adapter, ends)
            handed_over = isinstance(outcome, Streaming)
            return outcome
        finally:
            if not handed_over:
                registry.release_adapter(replica_id, adapter)

    async def send_to_any(self, features: RequestFeatures, request: Outbound, started: float) -> Buffered | Streaming:
        """To any healthy replica, the least loaded, for what every replica answers alike (no model named)."""
        healthy = [replica for replica in self._registry.healthy() if not replica.draining]
        if not healthy:
            raise no_replica("No healthy replica to ask right now.")
        return await self.send_to(pick_least_loaded(healthy, self._rng).id, features, request, started)

    async def send_to(
        self, replica_id: str, features: RequestFeatures, request: Outbound, started: float
    ) -> Buffered | Streaming:
        """To one replica, chosen by what it holds (a stored response), not by a policy: no retry
        elsewhere, and a draining replica still answers for what it holds."""
        replica = self._registry.find(replica_id)
        if replica is None or not replica.healthy:
            raise no_replica(f"The replica holding this ({replica_id}) is not available right now.")
        try:
            outcome = await self._attempt(replica_id, features, request, started)
        except RETRYABLE as exc:
            refused = isinstance(exc, UpstreamConnectError)
            self._registry.observe(replica_id, Outcome.REFUSED if refused else Outcome.FAILED, type(exc).__name__)
            raise OpenAIError(
                502, "The replica holding this failed before answering.", type="server_error", code="upstream_error"
            ) from None
        self._registry.observe(replica_id, classify_status(outcome.status), f"HTTP {outcome.status}")
        return outcome

    async def _admitted(
        self, features: RequestFeatures, tried: Sequence[str], ticket: Ticket | None
    ) -> list[ReplicaView]:
        """Candidates with room, after waiting in the admission queue when every one is full."""
        admission = self._admission
        candidates = self._selector.candidates
        if not admission.holds:
            return candidates(features, tried)
        found = candidates(features, tried)
        priority = features.priority
        tenant, weight, cost = ("", 1.0, 0.0) if ticket is None else (ticket.tenant, ticket.weight, ticket.cost)
        # Room now and nobody waiting before it: admitted without the waiting path's closure and coroutine.
        if found and admission.admit_at_once(priority, tenant, weight, cost):
            waited = 0.0
        else:

            def has_room() -> bool:
                nonlocal found
                found = candidates(features, tried)
                # No candidate at all is not a reason to wait: the caller answers at once.
                return bool(found) or all(r.id in tried for r in self._catalog.routable(features.model))

            try:
                waited = await admission.wait_for_room(has_room, priority, tenant, weight, cost)
            except OpenAIError as rejected:
                self._metrics.admission_rejections.labels(rejected.code or "rejected").inc()
                raise
        if ticket is not None:
            ticket.charged += ticket.cost
            ticket.cost = 0.0
            ticket.queue_s += waited
        self._metrics.queue_wait.observe(waited)
        return found

    async def _attempt(
        self,
        replica_id: str,
        features: RequestFeatures,
        request: Outbound,
        started: float,
        adapter: str | None = None,
        ends: Sequence[Callable[[], None]] = (),
    ) -> Buffered | Streaming:
        """`ends`: run when the attempt ends, here or when its stream finishes (each may run more than once:
        an adapter's attempt retried after a 404 ends twice)."""
        registry = self._registry
        address = self._address(registry.get(replica_id).url)
        registry.acquire(replica_id)
        handed_over = False
        resp: UpstreamResponse | None = None
        try:
            resp = await self._upstream.request(address, request.method, request.path, request.body, request.headers)
            content_type = resp.content_type
            stream = features.stream and resp.status == 200
            if not stream:
                metrics = self._metrics
                metrics.labeled(metrics.first_byte, features.endpoint, "false").observe(self._clock() - started)
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
            self._metrics.labeled(self._metrics.first_byte, features.endpoint, "true").observe(self._clock() - started)
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
                ends,
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
                for end in ends:
                    end()

    def _address(self, url: str) -> Address:
        address = self._addresses.get(url)
        if address is None:
            address = self._addresses[url] = Address.from_url(url)
        return address


def stream_error_event(message: str, code: str = "stream_broken") -> bytes:
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + orjson.dumps(error) + SSE_EVENT_END
