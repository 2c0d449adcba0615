"""One request's life in the router, as one object whose events the features observe.

The exchange (`routing/proxied_endpoints.py`) makes a `RequestLife` per request and attaches a `Watch` for
each feature that follows it: metrics, flow control (its tenant's quota, usage and fair-queue charge),
a routing receipt, the shadow policies, and later tracing. The dispatcher reports what happens as it
happens: admitted (after any wait in the queue), decided (the policy's choice; again on a retry),
dispatched (sent to a replica), first byte (the replica's answer began). The exchange finishes the life
exactly once, with one outcome, whatever happened between (answered, refused, failed, the client gone).

No feature reaches into another's state, and nothing is passed down the path to be filled in: a watch
keeps what it needs for its request, and reads the life at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from mypy_extensions import mypyc_attr

from dpserve.policies.base import Decision, ReplicaView, RequestFeatures
from dpserve.router.http.errors import CLIENT_CLOSED

NO_HEADERS: Mapping[str, str] = {}
"""Shared and never written: an untraced request allocates nothing for its trace context."""

# Where a request is, as the router sees it: what a client that leaves is counted by.
RECEIVED = "received"
"""Its body being read and checked."""
QUEUED = "queued"
"""Checked, not yet sent: deciding, waiting in the router's admission queue, or waiting for a replica to start."""
BACKOFF = "backoff"
"""An attempt failed before its first byte; the retry waits its back-off."""
AT_REPLICA = "replica"
"""Sent, no answer yet: waiting in the replica's queue or computing its first token there."""
ANSWERING = "answering"
"""The answer began (its headers; a stream's first event)."""


@dataclass(init=False)
class Usage:
    """What an answer took, as the replica reported it."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    """usage.prompt_tokens_details.cached_tokens (input_tokens_details for the responses API); 0 when absent."""

    def __init__(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        # Written out: dataclass's __init__ is interpreted even when compiled (see policies.base.RequestFeatures).
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.cached_tokens = cached_tokens


@dataclass(init=False)
class Choice:
    """One routing decision and the snapshot it was made from."""

    policy: str
    decision: Decision
    features: RequestFeatures
    """As the policy saw them: with the prefix matched against the candidates."""
    candidates: Sequence[ReplicaView]
    engine_block: int
    """The chosen replica's KV block in tokens (0: not known)."""

    def __init__(
        self,
        policy: str,
        decision: Decision,
        features: RequestFeatures,
        candidates: Sequence[ReplicaView],
        engine_block: int,
    ) -> None:
        # Written out: dataclass's __init__ is interpreted even when compiled (see policies.base.RequestFeatures).
        self.policy = policy
        self.decision = decision
        self.features = features
        self.candidates = candidates
        self.engine_block = engine_block


@mypyc_attr(allow_interpreted_subclasses=True)  # the tracer, the log and the shadows are interpreted
class Watch:
    """A feature following one request. Each event is a no-op unless a watch overrides it."""

    __slots__ = ()

    def admitted(self, waited_s: float) -> None:
        """Admission let the request go to a replica, after `waited_s` in its queue (once per attempt)."""

    def decided(self, choice: Choice) -> None:
        """The policy chose (again on a retry)."""

    def dispatched(self, replica_id: str, at: float) -> None:
        """The request went to `replica_id` (again on a retry)."""

    def first_byte(self, replica_id: str, at: float) -> None:
        """The replica's answer began (its headers; a stream's first event)."""

    def finished(self, life: RequestLife) -> None:
        """The request is over: exactly once."""


class RequestLife:
    """One request, from the router's first look at it to its last byte."""

    __slots__ = (
        "_clock",
        "_watches",
        "ended_at",
        "endpoint",
        "is_finished",
        "model",
        "queued_s",
        "refused",
        "replica_id",
        "request_id",
        "stage",
        "started",
        "status",
        "stream",
        "tenant",
        "trace_headers",
        "trace_ids",
        "usage",
    )

    def __init__(self, request_id: str, endpoint: str, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.request_id = request_id
        self.endpoint = endpoint
        self.stream = False
        """The answer streams: known at its first byte."""
        self.started = self._clock()
        self.stage = RECEIVED
        """Where it is now (RECEIVED, QUEUED, BACKOFF, AT_REPLICA, ANSWERING)."""
        self._watches: list[Watch] = []
        self.replica_id: str | None = None
        """The replica whose answer the client got (or is getting); None before one began."""
        self.status = CLIENT_CLOSED
        """The answer's status as the client got it (client gone until one is set)."""
        self.usage: Usage | None = None
        self.queued_s = 0.0
        """Seconds it waited in the router's queue, its attempts' waits added."""
        self.refused = False
        """The router answered with its own error (a bad request, no room, no replica), not a replica's answer."""
        self.is_finished = False
        self.ended_at = 0.0
        self.tenant = ""
        """Whose request, once flow control knows (for traces and logs)."""
        self.model = ""
        """The model (or adapter) it asked for, once read from its body (a metrics label)."""
        self.trace_headers: Mapping[str, str] = NO_HEADERS
        """The trace context of the current attempt, for the replica (`traceparent`); empty when not traced."""
        self.trace_ids: tuple[str, str] | None = None
        """(trace id, span id) of the request's own span when traced, for its log lines."""

    def watch(self, watch: Watch | None) -> None:
        if watch is not None:
            self._watches.append(watch)

    def admitted(self, waited_s: float) -> None:
        self.queued_s += waited_s
        for watch in self._watches:
            watch.admitted(waited_s)

    def decided(self, choice: Choice) -> None:
        for watch in self._watches:
            watch.decided(choice)

    def checked(self) -> None:
        """Read and checked: on its way to a replica (through the admission queue, if it must wait)."""
        self.stage = QUEUED

    def backing_off(self) -> None:
        """An attempt failed before its first byte; the next one waits its back-off first."""
        self.stage = BACKOFF

    def dispatched(self, replica_id: str) -> None:
        self.stage = AT_REPLICA
        at = self._clock()
        for watch in self._watches:
            watch.dispatched(replica_id, at)

    def first_byte(self, replica_id: str, stream: bool) -> None:
        """`stream`: the answer streams (a stream asked for can come back as one JSON error)."""
        at = self._clock()
        self.stage = ANSWERING
        self.replica_id, self.stream = replica_id, stream
        for watch in self._watches:
            watch.first_byte(replica_id, at)

    def finish(self, status: int, usage: Usage | None = None, refused: bool = False) -> None:
        """The one outcome. A second call is a bug on the path, not a second outcome: it is ignored."""
        if self.is_finished:
            return
        self.is_finished = True
        self.ended_at = self._clock()
        self.status, self.usage, self.refused = status, usage, refused
        for watch in self._watches:
            watch.finished(self)
