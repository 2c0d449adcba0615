"""A request's way through flow control, around its dispatch: whose it is and at what priority (tenants),
whether its tenant is within its quotas, what it is expected to cost (for the fair queue), and, once
answered, what it really took: usage per tenant, the quota window, the fair queue's correction.

The exchange calls `begin` before dispatch and watches the request's life with the pass it returns.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import orjson

from dpserve.policies.base import RequestFeatures
from dpserve.router.flow.admission import Admission, Rejected, Ticket
from dpserve.router.flow.quotas import QuotaBook
from dpserve.router.flow.tenants import Caller, Priority, Tenant, Tenants
from dpserve.router.flow.usage import UsageBook
from dpserve.router.observe.life import RequestLife, Usage, Watch

log = logging.getLogger("dpserve.flow")

EXPECTED_COMPLETION_TOKENS = 128
"""What an answer is taken to cost before it is known, when the request's `max_tokens` is larger or unset."""
BYTES_PER_TOKEN = 4
"""A prompt's size in tokens, roughly, when it was not tokenized."""
VLLM_PRIORITY = {Priority.CRITICAL: -2, Priority.STANDARD: 0, Priority.BATCH: 2}
"""vLLM's `priority` request field (lower is scheduled first; 0 is its default). A request with an SLO goes
one lower, ahead of its class's best effort: in vLLM's queue it waits behind those promised a time only."""


class Pass(Watch):
    """One request admitted to flow control, following it to its end: charged once when admission lets it
    go (retries included), its wait added up, and at the end what it took counted for its tenant."""

    __slots__ = ("_flow", "tenant", "ticket")

    def __init__(self, flow: Flow, tenant: Tenant, ticket: Ticket) -> None:
        self._flow = flow
        self.tenant = tenant
        self.ticket = ticket

    def admitted(self, waited_s: float) -> None:
        ticket = self.ticket
        ticket.charged += ticket.cost
        ticket.cost = 0.0
        ticket.queue_s += waited_s

    def finished(self, life: RequestLife) -> None:
        self._flow.end(self, life.status, life.usage)


class Flow:
    def __init__(
        self,
        tenants: Tenants,
        quotas: QuotaBook,
        usage: UsageBook,
        admission: Admission,
        pass_priority: bool = False,
    ) -> None:
        """`pass_priority`: tell vLLM each request's class (`priority`), for replicas that run
        `--scheduling-policy priority`."""
        self.tenants = tenants
        self.quotas = quotas
        self.usage = usage
        self._admission = admission
        self.pass_priority = pass_priority

    def identify(self, caller: Caller | None, headers: Mapping[str, str]) -> Tenant:
        """The request's tenant and class (OpenAIError 400/403 for headers it may not use)."""
        return self.tenants.identify(caller, headers)

    def begin(self, tenant: Tenant, features: RequestFeatures, payload: Mapping[str, Any], body_bytes: int) -> Pass:
        """Checks the tenant's quotas (Rejected, 429 with Retry-After, when over one) and counts the
        request in; the pass's ticket goes with it into the admission queue."""
        quota = tenant.rules.quota
        if quota.limited:  # only tenants with quotas are counted in the window (and told to peers)
            over = self.quotas.check(tenant.name, quota)
            if over is not None:
                raise Rejected(over.limit, over.message, over.retry_after_s)
            self.quotas.start(tenant.name)
        cost = prompt_tokens_guess(features, body_bytes) + completion_tokens_guess(payload)
        return Pass(self, tenant, Ticket(tenant.name, tenant.rules.weight, float(cost)))

    def end(self, flow: Pass, status: int, usage: Usage | None) -> None:
        """The answer is done (or failed, or the client left): counts what it took (once: the request's
        life ends once)."""
        tenant, ticket = flow.tenant, flow.ticket
        name, rules = tenant.name, tenant.rules
        if usage is None:
            prompt = cached = completion = 0
        else:
            prompt, cached, completion = usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens
        if rules.quota.limited:
            self.quotas.finish(name, prompt + completion)
        charged = ticket.charged
        if charged:  # admitted: it was charged its guess, now corrected by what it took
            self._admission.settle(name, prompt + completion - charged, rules.weight)
        # Positional: a call with keywords costs more, and this runs once per request.
        self.usage.record(name, status >= 400, prompt, cached, completion, ticket.queue_s)

    def status(self) -> dict[str, Any]:
        """For /status: whether requests are held past capacity, how many wait and the longest so far, how
        many gave up after `--queue-timeout`, the tenants by name."""
        admission = self._admission
        return {
            "flow_control": admission.flow_control,
            "queued": admission.depth,
            "queued_by_priority": admission.depth_by_priority(),
            "oldest_queued_s": round(admission.oldest_wait_s(), 3),
            "queue_timeout_s": admission.timeout_s,
            "queue_timeouts": admission.timeouts,
            "slo_wait": admission.wait_model(),
            "tenants": sorted(self.tenants.named),
        }

    def upstream_fields(self, tenant: Tenant, slo_bound: bool = False) -> dict[str, Any]:
        """Fields the router adds to the body it forwards for this tenant's request (`slo_bound`: it carries
        an SLO)."""
        if self.pass_priority:
            return {"priority": VLLM_PRIORITY[tenant.priority] - slo_bound}
        return {}


def prompt_tokens_guess(features: RequestFeatures, body_bytes: int) -> int:
    prefix = features.prefix
    if prefix is not None and prefix.tokens_per_block and prefix.total_blocks:
        return prefix.total_blocks * prefix.tokens_per_block
    return body_bytes // BYTES_PER_TOKEN


def completion_tokens_guess(payload: Mapping[str, Any]) -> int:
    asked = payload.get("max_completion_tokens") or payload.get("max_tokens") or payload.get("max_output_tokens")
    if type(asked) is int and 0 < asked < EXPECTED_COMPLETION_TOKENS:  # not bool, which is not int itself
        return asked
    return EXPECTED_COMPLETION_TOKENS


def with_fields(raw: bytes, payload: Mapping[str, Any], fields: Mapping[str, Any]) -> bytes:
    """The body with `fields` added (or replaced). Keys the payload lacks are spliced in after the opening
    brace, so the client's bytes are not serialized again; otherwise the payload is."""
    if not fields:
        return raw
    if payload and not any(key in payload for key in fields):
        start = raw.find(b"{")
        if start >= 0:
            return raw[: start + 1] + orjson.dumps(dict(fields))[1:-1] + b"," + raw[start + 1 :]
    return orjson.dumps({**payload, **fields})
