"""A real OTLP/gRPC trace receiver (the tests' and `benchmarks.tracing_cost`'s): the collector's own service
definition (`opentelemetry-proto`), served by grpc on a free loopback port; every span it receives, decoded,
with the service that sent it."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    events: tuple[tuple[str, dict[str, Any]], ...]
    """(name, attributes) of each event, in order."""

    @property
    def event_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.events)


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._receiver = receiver

    def Export(self, request: Any, context: Any) -> Any:
        for resource_spans in request.resource_spans:
            attributes = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(attributes.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self._receiver.add(
                        ReceivedSpan(
                            service,
                            span.name,
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            span.kind,
                            {a.key: _value(a.value) for a in span.attributes},
                            tuple(
                                (event.name, {a.key: _value(a.value) for a in event.attributes})
                                for event in span.events
                            ),
                        )
                    )
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Service(self), self._server)  # type: ignore[no-untyped-call]
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"

    def add(self, span: ReceivedSpan) -> None:
        with self._lock:
            self.spans.append(span)

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)

    def wait_for(self, count: int, timeout_s: float, **match: str) -> list[ReceivedSpan]:
        """The spans whose fields equal `match`, once there are at least `count` of them."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                found = [s for s in self.spans if all(getattr(s, key) == value for key, value in match.items())]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    def settled(self, quiet_s: float, timeout_s: float) -> int:
        """How many spans there are once none has arrived for `quiet_s` (or `timeout_s` has passed): an exporter
        sends on its own schedule, so a count taken any earlier may miss a batch or take the next one's."""
        deadline = time.monotonic() + timeout_s
        count, since = len(self.spans), time.monotonic()
        while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
            time.sleep(0.05)
            if len(self.spans) != count:
                count, since = len(self.spans), time.monotonic()
        return count
