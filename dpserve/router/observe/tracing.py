"""OpenTelemetry traces of the requests the router relays (`--otlp-traces-endpoint`, vLLM's name for it).

Each request is a server span, the child of the client's `traceparent` when it sent one, with each routing
decision as an event (policy, candidates, the chosen replica and its predicted cached tokens); under it,
the wait for admission when there was one, and each attempt at a replica as a client span (a retry is a
sibling), with the first byte as an event. The attempt's context goes to the replica in `traceparent` and
`tracestate`, so a vLLM that traces (`vllm serve --otlp-traces-endpoint`) puts its own span under the
router's attempt.

The exporter and sampler follow the OpenTelemetry SDK's own variables, as vLLM's do:
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (`grpc`, the default, or `http/protobuf`), `OTEL_SERVICE_NAME`,
`OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG`, `OTEL_EXPORTER_OTLP_HEADERS`. Off (no endpoint):
nothing here is built and a request's life has no trace watch; the SDK is imported only when on.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dpserve.router.observe.life import Choice, RequestLife, Watch

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACE_HEADERS = ("traceparent", "tracestate")
"""W3C trace context: read from the client, written to the replica."""
SERVICE_NAME = "dpserve-router"


def trace_context(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's W3C trace context among its headers (none: empty)."""
    return {name: headers[name] for name in TRACE_HEADERS if name in headers}


def span_exporter(endpoint: str) -> SpanExporter:
    """The OTLP exporter `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` names, as vLLM picks its own."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = protocol or "grpc"
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        # Plain text unless the endpoint says https: a collector beside the router, as vLLM assumes.
        return GrpcExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter(endpoint=endpoint)
    raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL {protocol!r}: grpc or http/protobuf")


class Tracing:
    """The router's tracer: started with the app, flushed and stopped with it."""

    def __init__(self, endpoint: str, exporter: SpanExporter | None = None) -> None:
        """`exporter`: instead of OTLP to `endpoint` (tests hand an in-memory one)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; the sampler comes from
        # OTEL_TRACES_SAMPLER(_ARG), parent-based always-on when unset.
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or SERVICE_NAME})
        self._provider: TracerProvider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(exporter or span_exporter(endpoint)))
        self.tracer: Tracer = self._provider.get_tracer("dpserve.router")
        self.propagator: TraceContextTextMapPropagator = TraceContextTextMapPropagator()

    def watch(self, life: RequestLife, headers: Mapping[str, str], method: str, route: str, path: str) -> RequestTrace:
        """`headers`: the client's, for its trace context; `route`: the path as a template (the span's name)."""
        return RequestTrace(self, life, headers, method, route, path)

    def stop(self) -> None:
        """Exports what is still buffered, then stops."""
        self._provider.shutdown()


class RequestTrace(Watch):
    """One request's spans."""

    __slots__ = ("_attempt", "_context", "_life", "_recording", "_span", "_tracing")

    def __init__(
        self, tracing: Tracing, life: RequestLife, headers: Mapping[str, str], method: str, route: str, path: str
    ) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        self._tracing = tracing
        self._life = life
        received = trace_context(headers)
        parent = tracing.propagator.extract(received) if received else None
        self._span: Span = tracing.tracer.start_span(
            f"{method} {route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": method,
                "http.route": route,
                "url.path": path,
                "dpserve.endpoint": life.endpoint,
                "dpserve.request_id": life.request_id,
            },
        )
        self._context = trace.set_span_in_context(self._span)
        self._attempt: Span | None = None
        ids = self._span.get_span_context()
        life.trace_ids = (format(ids.trace_id, "032x"), format(ids.span_id, "016x"))
        self._recording = self._span.is_recording()
        if not self._recording:
            # Not sampled: no attempt spans, and the replica is told so (the flag in the request's context).
            carrier: dict[str, str] = {}
            tracing.propagator.inject(carrier, context=self._context)
            life.trace_headers = carrier

    def admitted(self, waited_s: float) -> None:
        if waited_s <= 0 or not self._recording:  # admitted at once: nothing to see, a span less to export
            return
        now = time.time_ns()
        span = self._tracing.tracer.start_span(
            "admission", context=self._context, start_time=now - int(waited_s * 1e9), attributes=self._who()
        )
        span.set_attribute("dpserve.queue_wait_s", waited_s)
        span.end(end_time=now)

    def decided(self, choice: Choice) -> None:
        """An event on the request's span, not a span of its own: it takes no time, and every span costs
        the router's CPU to build and export (measured: docs/router.md, "Tracing")."""
        if not self._recording:
            return
        decision, prefix = choice.decision, choice.features.prefix
        attributes: dict[str, Any] = {
            "dpserve.policy": choice.policy,
            "dpserve.replica": decision.id,
            "dpserve.reason": decision.reason,
            "dpserve.candidates": [c.id for c in choice.candidates],
        }
        if prefix is not None:
            attributes["dpserve.predicted_cached_tokens"] = prefix.blocks(decision.id) * prefix.tokens_per_block
        self._span.add_event("route", attributes)

    def dispatched(self, replica_id: str, at: float) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        if not self._recording:
            return
        if self._attempt is not None:  # the one before failed: this is a retry, its sibling
            self._attempt.set_attribute("dpserve.retried", True)
            self._attempt.end()
        attempt = self._attempt = self._tracing.tracer.start_span(
            "attempt", context=self._context, kind=SpanKind.CLIENT, attributes={"dpserve.replica": replica_id}
        )
        carrier: dict[str, str] = {}
        self._tracing.propagator.inject(carrier, context=trace.set_span_in_context(attempt))
        self._life.trace_headers = carrier

    def first_byte(self, replica_id: str, at: float) -> None:
        if self._attempt is not None:
            self._attempt.add_event("first byte", {"dpserve.stream": self._life.stream})

    def finished(self, life: RequestLife) -> None:
        from opentelemetry.trace import Status, StatusCode

        span = self._span
        if not self._recording:
            span.end()
            return
        attributes: dict[str, Any] = {"http.response.status_code": life.status, **self._who()}
        if life.replica_id is not None:
            attributes["dpserve.replica"] = life.replica_id
        usage = life.usage
        if usage is not None:
            attributes["gen_ai.usage.input_tokens"] = usage.prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = usage.completion_tokens
            attributes["dpserve.cached_tokens"] = usage.cached_tokens
        span.set_attributes(attributes)
        if life.status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        if self._attempt is not None:
            self._attempt.set_attribute("http.response.status_code", life.status)
            self._attempt.end()
        span.end()

    def _who(self) -> dict[str, Any]:
        return {"dpserve.tenant": self._life.tenant} if self._life.tenant else {}
