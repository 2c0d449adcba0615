"""Routing receipts: for a sample of requests, what the policy predicted (the cached tokens on the replica it
chose, the best prediction on any candidate and where, the load it weighed) beside what the replica then
realized (the answer's `usage.prompt_tokens_details.cached_tokens`, streams included through the usage
chunk the router asks for), with a class that explains a miss:

- `hit`: realized ≈ predicted, and something was predicted;
- `cold`: no candidate held the prefix, and none was found: a workload miss;
- `evicted`: the index said cached, the engine had dropped it (a stale index: lost or late events);
- `balanced`: the policy chose a replica with fewer cached tokens than another had, for its load;
- `mispredicted`: realized > predicted: the index missed blocks the engine had;
- `unscored`: nothing to compare (a policy that reads no prefix, an error, a client that left).

"≈" is within one block: vLLM recomputes the last block of a fully cached prompt, and caches only whole
blocks. Every sampled request gets exactly one class, so the class counts add up to the receipts.

Bookkeeping only, no I/O: the counters are read at scrape time, the ring by `/admin/receipts`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from dpserve.kvindex.text_prefix import ChunkTokens
from dpserve.policies.base import PrefixMatch, PrefixSource, ReplicaView
from dpserve.router.observe.life import Choice, RequestLife, Watch

HIT = "hit"
COLD = "cold"
EVICTED = "evicted"
BALANCED = "balanced"
MISPREDICTED = "mispredicted"
UNSCORED = "unscored"
CLASSES = (HIT, COLD, EVICTED, BALANCED, MISPREDICTED, UNSCORED)


def classify(predicted: int | None, best: int | None, realized: int | None, block_tokens: int) -> str:
    """The class of one receipt (tokens throughout; `block_tokens` the index's block size)."""
    if predicted is None or realized is None:
        return UNSCORED
    slack = max(block_tokens, 1)
    if realized < predicted - slack:
        return EVICTED
    if realized > predicted + slack:
        return MISPREDICTED
    if best is not None and best > predicted:
        return BALANCED
    return COLD if predicted == 0 else HIT


@dataclass
class Receipt:
    """One request's routing, filled in twice: when the policy decides (again on a retry), and when the
    answer is done."""

    request_id: str
    at: float
    """Wall-clock time the request came in."""
    endpoint: str
    model: str
    tenant: str
    policy: str = ""
    replica: str | None = None
    reason: str = ""
    """The policy's reason (`dpserve_routing_decision_reasons_total`)."""
    source: str | None = None
    """Where the prediction came from (`kv_events`, `routed_text`); None: the policy predicted nothing."""
    block_tokens: int = 0
    prompt_blocks: int = 0
    predicted: int | None = None
    """Cached tokens the index said the chosen replica holds of the prompt."""
    best: int | None = None
    best_replica: str | None = None
    load: int = 0
    """The chosen replica's load (requests in flight or queued there) when the policy weighed it."""
    best_load: int | None = None
    status: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    realized: int | None = None
    dispatched: float | None = None
    """When the last attempt was sent (the dispatcher's clock, `time.perf_counter`)."""
    replica_s: float | None = None
    """Seconds from that send to the answer's end: what `dpserve tune` fits its fleet's timing to."""
    predicted_ttft_s: float | None = None
    """The time to first token the policy predicted at the chosen replica, from the send (None: none)."""
    realized_ttft_s: float | None = None
    """A stream's time from the send to its first event there."""
    verdict: str = UNSCORED
    keys: tuple[int, ...] = ()
    """The prompt's block keys (hashes, no text): what `dpserve tune` replays, in the log only."""

    def decided(
        self,
        policy: str,
        replica: str,
        reason: str,
        prefix: PrefixMatch | None,
        candidates: Sequence[ReplicaView],
        engine_block: int = 0,
    ) -> None:
        """What the policy chose and predicted, from the snapshot it chose from. `engine_block`: the chosen
        replica's KV block in tokens (0: not known), what a routed-text prediction is rounded down to (the
        engine caches whole blocks; a KV-event match already counts them)."""
        self.policy, self.replica, self.reason = policy, replica, reason
        chosen = next((c for c in candidates if c.id == replica), None)
        self.load = chosen.load if chosen is not None else 0
        if prefix is None:
            self.source = self.predicted = self.best = self.best_replica = self.best_load = None
            self.keys = ()
            return
        per_block = prefix.tokens_per_block
        text = prefix.source is PrefixSource.ROUTED_TEXT
        whole = engine_block if text and engine_block > 0 else 1
        self.source = prefix.source.value
        self.keys = () if text else prefix.keys
        # A class's slack is one block of what was counted; text chunks do not end where the engine's do.
        self.block_tokens, self.prompt_blocks = max(per_block, whole), prefix.total_blocks
        self.predicted = prefix.blocks(replica) * per_block // whole * whole
        best_replica, best_blocks = replica, prefix.blocks(replica)
        for candidate in candidates:
            blocks = prefix.blocks(candidate.id)
            if blocks > best_blocks:
                best_replica, best_blocks = candidate.id, blocks
        self.best, self.best_replica = best_blocks * per_block // whole * whole, best_replica
        best = next((c for c in candidates if c.id == best_replica), None)
        self.best_load = best.load if best is not None else None

    def to_dict(self, keys: bool = False) -> dict[str, Any]:
        """`keys`: with the prompt's block keys (for the log; long)."""
        out = {
            "request_id": self.request_id,
            "at": self.at,
            "endpoint": self.endpoint,
            "model": self.model,
            "tenant": self.tenant,
            "policy": self.policy,
            "replica": self.replica,
            "reason": self.reason,
            "class": self.verdict,
            "source": self.source,
            "block_tokens": self.block_tokens,
            "prompt_blocks": self.prompt_blocks,
            "predicted_cached_tokens": self.predicted,
            "best_predicted_cached_tokens": self.best,
            "best_replica": self.best_replica,
            "load": self.load,
            "best_load": self.best_load,
            "status": self.status,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "realized_cached_tokens": self.realized,
            "replica_s": None if self.replica_s is None else round(self.replica_s, 6),
            "predicted_ttft_ms": _ms(self.predicted_ttft_s),
            "realized_ttft_ms": _ms(self.realized_ttft_s),
        }
        if keys:
            out["keys"] = list(self.keys)
        return out


class ReceiptWatch(Watch):
    """A sampled request's receipt, filled in from its life: the policy's choice (the last, on a retry),
    when it was sent, and at the end what the replica realized."""

    __slots__ = ("_book", "receipt")

    def __init__(self, book: ReceiptBook, receipt: Receipt) -> None:
        self._book = book
        self.receipt = receipt

    def decided(self, choice: Choice) -> None:
        decision = choice.decision
        receipt = self.receipt
        receipt.decided(
            choice.policy, decision.id, decision.reason, choice.features.prefix, choice.candidates, choice.engine_block
        )
        receipt.predicted_ttft_s = decision.ttft_s if decision.ttft_s >= 0 else None
        receipt.realized_ttft_s = None

    def dispatched(self, replica_id: str, at: float) -> None:
        self.receipt.dispatched = at

    def first_byte(self, replica_id: str, at: float) -> None:
        receipt = self.receipt
        if receipt.dispatched is not None:
            receipt.realized_ttft_s = at - receipt.dispatched

    def finished(self, life: RequestLife) -> None:
        if not life.stream:  # a whole answer's first byte is its last: no time to first token to compare
            self.receipt.realized_ttft_s = None
        usage = life.usage
        if usage is None:
            self._book.close(self.receipt, life.status, None, None)
        else:
            self._book.close(
                self.receipt, life.status, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens
            )


@dataclass
class _Tally:
    receipts: int = 0
    prompt_tokens: int = 0
    predicted: int = 0
    realized: int = 0
    hit_error_blocks: float = 0.0
    """Sum of |realized - predicted| over `hit`s, in blocks (for the mean)."""


class ReceiptBook:
    """Receipts for a sample of requests (`sample`: the share, 0 to 1; a request that asks for its receipt
    always gets one), the last `keep` of them, and counts by class and replica since start."""

    def __init__(
        self,
        sample: float = 0.1,
        keep: int = 1024,
        clock: Callable[[], float] = time.time,
        chunk_tokens: ChunkTokens | None = None,
        timer: Callable[[], float] = time.perf_counter,
        on_closed: Callable[[Receipt], None] | None = None,
    ) -> None:
        """`clock`: a receipt's wall-clock time; `timer`: the dispatcher's, for its time on the replica.
        `chunk_tokens`: taught what a text chunk is in tokens by each routed-text receipt's answer."""
        if not 0.0 <= sample <= 1.0:
            raise ValueError(f"--receipts-sample {sample}: must be between 0 and 1")
        if keep < 0:
            raise ValueError(f"--receipts-keep {keep}: must be 0 or more")
        self.sample = sample
        self._due = 0.0
        """The share of a receipt owed so far: every request adds `sample`, a receipt takes 1 (an even sample)."""
        self._clock = clock
        self._timer = timer
        self._chunk_tokens = chunk_tokens
        self._ring: deque[Receipt] = deque(maxlen=keep)
        self.by_class: dict[str, int] = dict.fromkeys(CLASSES, 0)
        self.by_replica: dict[tuple[str, str], int] = {}
        """(replica, class) -> receipts."""
        self._scored = _Tally()
        self._on_closed = on_closed
        """Called with each receipt once its answer is done (`--receipts-log`)."""

    def open(self, request_id: str, endpoint: str, model: str, tenant: str, asked: bool = False) -> Receipt | None:
        """A receipt for this request when it falls in the sample (or `asked`), else None."""
        if not asked:
            due = self._due + self.sample
            if due < 1.0:
                self._due = due
                return None
            self._due = due - 1.0
        return Receipt(request_id, self._clock(), endpoint, model, tenant)

    def watch(
        self, request_id: str, endpoint: str, model: str, tenant: str, asked: bool = False
    ) -> ReceiptWatch | None:
        """A receipt following this request when it falls in the sample (or `asked`), else None."""
        receipt = self.open(request_id, endpoint, model, tenant, asked)
        return ReceiptWatch(self, receipt) if receipt is not None else None

    def close(
        self,
        receipt: Receipt,
        status: int,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        completion_tokens: int | None = None,
    ) -> None:
        """The answer is done: what the replica realized, the class, the counts."""
        receipt.status = status
        if status < 400 and prompt_tokens is not None:
            receipt.prompt_tokens, receipt.realized = prompt_tokens, cached_tokens
            receipt.completion_tokens = completion_tokens
            if receipt.dispatched is not None:
                receipt.replica_s = max(0.0, self._timer() - receipt.dispatched)
            if self._chunk_tokens is not None and receipt.source == PrefixSource.ROUTED_TEXT.value:
                self._chunk_tokens.learn(receipt.model, receipt.prompt_blocks, prompt_tokens)
        verdict = receipt.verdict = classify(receipt.predicted, receipt.best, receipt.realized, receipt.block_tokens)
        self.by_class[verdict] += 1
        key = (receipt.replica or "none", verdict)
        self.by_replica[key] = self.by_replica.get(key, 0) + 1
        if verdict != UNSCORED:
            tally = self._scored
            tally.receipts += 1
            tally.prompt_tokens += receipt.prompt_tokens or 0
            tally.predicted += receipt.predicted or 0
            tally.realized += receipt.realized or 0
            if verdict == HIT:
                error = abs((receipt.realized or 0) - (receipt.predicted or 0))
                tally.hit_error_blocks += error / max(receipt.block_tokens, 1)
        self._ring.append(receipt)
        if self._on_closed is not None:
            self._on_closed(receipt)

    def recent(self, limit: int) -> list[dict[str, Any]]:
        """The last `limit` receipts, newest first."""
        ring = self._ring
        return [ring[-1 - i].to_dict() for i in range(min(limit, len(ring)))]

    def summary(self) -> dict[str, Any]:
        """For /status: the classes, and over scored receipts the predicted and realized hit rates (cached
        tokens over prompt tokens) and the mean error of a hit, in blocks."""
        tally = self._scored
        hits = self.by_class[HIT]
        return {
            "sample": self.sample,
            "receipts": sum(self.by_class.values()),
            "classes": dict(self.by_class),
            "scored": tally.receipts,
            "prompt_tokens": tally.prompt_tokens,
            "predicted_cached_tokens": tally.predicted,
            "realized_cached_tokens": tally.realized,
            "predicted_hit_rate": tally.predicted / tally.prompt_tokens if tally.prompt_tokens else None,
            "realized_hit_rate": tally.realized / tally.prompt_tokens if tally.prompt_tokens else None,
            "hit_mean_error_blocks": tally.hit_error_blocks / hits if hits else None,
        }

    def tokens(self) -> tuple[int, int, int]:
        """(prompt, predicted cached, realized cached) tokens over scored receipts."""
        tally = self._scored
        return tally.prompt_tokens, tally.predicted, tally.realized


class ReceiptCollector(Collector):
    """dpserve_receipts_* series, read from a `ReceiptBook` at scrape time (nothing per request)."""

    def __init__(self, book: ReceiptBook) -> None:
        self._book = book

    def collect(self) -> Iterator[Metric]:
        receipts = CounterMetricFamily(
            "dpserve_receipts",
            "Sampled requests by replica and routing class (hit, cold, evicted, balanced, mispredicted, unscored).",
            labels=["replica", "class"],
        )
        for (replica, verdict), count in sorted(self._book.by_replica.items()):
            receipts.add_metric([replica, verdict], count)
        tokens = CounterMetricFamily(
            "dpserve_receipt_tokens",
            "Over scored receipts: prompt tokens, and the cached tokens predicted and realized.",
            labels=["kind"],
        )
        prompt, predicted, realized = self._book.tokens()
        tokens.add_metric(["prompt"], prompt)
        tokens.add_metric(["predicted_cached"], predicted)
        tokens.add_metric(["realized_cached"], realized)
        yield from (receipts, tokens)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)
