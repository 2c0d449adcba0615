"""Replaying a recorded workload (routing receipts with their prompts' block keys) through kv_aware with
other weights, in a model of the fleet: each replica's KV cache as an LRU of block keys
(`kvindex/modelled.py`), and its time in the form of the simulator's latency model (`sim/engine.py`: time
to first token = uncached prompt tokens x prefill time x batch slowdown; then each token x decode time x
slowdown; at most `max_num_seqs` running, the rest wait for the first to finish), the per-token times as
given or fitted to the recorded fleet (`tune/timing.py`). Requests arrive when they came.

Pure and deterministic: a setting's outcome depends only on the trace and the model's parameters.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dpserve.kvindex.modelled import ModelledCaches, cacheable_blocks
from dpserve.policies.balance import BalanceGuard
from dpserve.policies.base import PrefixMatch, PrefixSource, ReplicaSnapshot, RequestFeatures
from dpserve.policies.kv_aware import KvAware, KvAwareWeights
from dpserve.sim.engine import LatencyModel


@dataclass(frozen=True, slots=True)
class TraceRequest:
    at: float
    keys: tuple[int, ...]
    block_tokens: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None
    """What vLLM reported cached for it where it went."""
    seconds: float | None = None
    """Its time on that replica, send to the answer's end (`replica_s`)."""


def read_receipts(lines: Iterable[str]) -> tuple[list[TraceRequest], list[str]]:
    """The replayable requests of a receipts log (`--receipts-log`), oldest first, and the replicas named.
    A receipt without block keys (a policy that reads no prefix, an error) is skipped."""
    requests: list[TraceRequest] = []
    replicas: set[str] = set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise ValueError(f"line {number} is not JSON") from None
        if not isinstance(row, dict):
            raise ValueError(f"line {number} is not a receipt")
        if row.get("replica"):
            replicas.add(str(row["replica"]))
        keys, prompt = row.get("keys"), row.get("prompt_tokens")
        if not keys or not isinstance(prompt, int) or not row.get("block_tokens"):
            continue
        at, completion = row.get("at"), row.get("completion_tokens")
        if not isinstance(at, int | float) or not all(isinstance(k, int) for k in keys):
            raise ValueError(f"line {number} is not a receipt (its `at` or `keys`)")
        cached, seconds = row.get("realized_cached_tokens"), row.get("replica_s")
        requests.append(
            TraceRequest(
                float(at),
                tuple(keys),
                int(row["block_tokens"]),
                prompt,
                completion if isinstance(completion, int) else 0,
                cached if isinstance(cached, int) else None,
                float(seconds) if isinstance(seconds, int | float) and seconds >= 0 else None,
            )
        )
    requests.sort(key=lambda r: r.at)
    return requests, sorted(replicas)


@dataclass(frozen=True, slots=True)
class Setting:
    load_weight: float
    kv_weight: float
    held_weight: float
    balance_rel: float
    balance_abs: int

    def flags(self) -> str:
        return (
            f"--kv-load-weight {self.load_weight:g} --kv-cache-weight {self.kv_weight:g} "
            f"--kv-held-weight {self.held_weight:g} --balance-rel {self.balance_rel:g} "
            f"--balance-abs {self.balance_abs}"
        )


DEFAULTS = Setting(
    KvAwareWeights().load_weight,
    KvAwareWeights().kv_weight,
    KvAwareWeights().held_weight,
    BalanceGuard().relative,
    BalanceGuard().absolute,
)


def grid(
    load_weights: Sequence[float] = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2),
    kv_weights: Sequence[float] = (0.0, 0.2, 0.5),
    held_weights: Sequence[float] = (0.0, 0.5, 1.0, 2.0),
    guards: Sequence[tuple[float, int]] = ((1.25, 4), (1.5, 8), (2.0, 16)),
) -> list[Setting]:
    """Every combination, the defaults always among them."""
    settings = [
        Setting(load, kv, held, rel, absolute)
        for load, kv, held, (rel, absolute) in itertools.product(load_weights, kv_weights, held_weights, guards)
    ]
    return settings if DEFAULTS in settings else [DEFAULTS, *settings]


@dataclass(frozen=True, slots=True)
class Outcome:
    setting: Setting
    hit_rate: float
    """Cached prompt tokens over prompt tokens, as vLLM's prefix-cache counters count them."""
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    max_share: float
    """Requests on the busiest replica over the fair share."""


@dataclass(frozen=True, slots=True)
class FleetModel:
    replicas: tuple[str, ...]
    kv_blocks: int = 0
    """Each replica's KV cache in blocks; 0: unbounded."""
    latency: LatencyModel = field(default_factory=LatencyModel)
    max_num_seqs: int = 256


def replay(requests: Sequence[TraceRequest], fleet: FleetModel, setting: Setting) -> Outcome:
    weights = KvAwareWeights(setting.load_weight, setting.kv_weight, setting.held_weight)
    policy = KvAware(random.Random(0), weights, BalanceGuard(setting.balance_rel, setting.balance_abs))
    rng = random.Random(0)
    caches = ModelledCaches()
    running: dict[str, list[float]] = {replica: [] for replica in fleet.replicas}  # heaps of finish times
    served = dict.fromkeys(fleet.replicas, 0)
    latency = fleet.latency
    start = requests[0].at if requests else 0.0
    ttfts: list[float] = []
    prompt = cached = 0
    for request in requests:
        now = request.at - start
        for finishes in running.values():
            while finishes and finishes[0] <= now:
                heapq.heappop(finishes)
        views = []
        for replica in fleet.replicas:
            usage = min(1.0, caches.blocks(replica) / fleet.kv_blocks) if fleet.kv_blocks else 0.0
            views.append(ReplicaSnapshot(replica, in_flight=len(running[replica]), kv_usage=usage))
        keys = request.keys
        matched = {replica: caches.leading(replica, keys) for replica in fleet.replicas}
        held = {replica: caches.blocks(replica) for replica in fleet.replicas}
        prefix = PrefixMatch(
            PrefixSource.KV_EVENTS, len(keys), request.block_tokens, matched, keys, held, request.prompt_tokens
        )
        chosen = policy.choose(RequestFeatures("completions", "", False, prefix=prefix), views).id
        hit = min(matched[chosen], cacheable_blocks(len(keys), request.prompt_tokens, request.block_tokens))
        finishes = running[chosen]
        wait = 0.0
        if len(finishes) >= fleet.max_num_seqs:  # a full batch: it starts when the first running one ends
            wait = max(0.0, heapq.heappop(finishes) - now)
        factor = latency.factor(len(finishes) + 1, rng)
        uncached = max(0, request.prompt_tokens - hit * request.block_tokens)
        ttft = wait + uncached * latency.prefill_s_per_token * factor
        heapq.heappush(finishes, now + ttft + request.completion_tokens * latency.decode_s_per_token * factor)
        caches.add(chosen, keys, fleet.kv_blocks)
        served[chosen] += 1
        ttfts.append(ttft)
        prompt += request.prompt_tokens
        cached += hit * request.block_tokens
    ttfts.sort()
    count = len(ttfts)
    fair = count / len(fleet.replicas) if fleet.replicas else 0
    return Outcome(
        setting,
        cached / prompt if prompt else 0.0,
        1000 * sum(ttfts) / count if count else 0.0,
        1000 * ttfts[count // 2] if count else 0.0,
        1000 * ttfts[min(count - 1, int(count * 0.99))] if count else 0.0,
        max(served.values()) / fair if fair else 0.0,
    )


def tune(requests: Sequence[TraceRequest], fleet: FleetModel, settings: Sequence[Setting]) -> list[Outcome]:
    """Every setting's outcome, best first: the lowest mean time to first token (what cache hits and
    balance both come to), then the higher hit rate, then the defaults (no change without a gain). Both
    compared as printed (0.1 ms, 3 decimals): a gain too small to show is no gain."""
    outcomes = [replay(requests, fleet, setting) for setting in settings]
    return sorted(outcomes, key=lambda o: (round(o.ttft_mean_ms, 1), -round(o.hit_rate, 3), o.setting != DEFAULTS))
