"""How long one routing decision takes as the fleet grows: 2 to 64 replicas, every policy.

A decision is what the router does per request between reading the body and sending it on: find the
routable replicas with room, read the prefix indexes for them, and let the policy choose. It is timed
through the router's own `Dispatcher.decide`, in process and without sockets, on a fleet in a busy
state: uneven loads and KV usage, KV and text indexes that hold the prompts' prefixes on a few
replicas each, and requests cycling over those prompts and over session keys.

    python -m benchmarks.decision_time [--counts 2,4,8,16,32,64] [--repeats 9] [--decisions 1000]
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dpserve.config import RouterSettings
from dpserve.kvindex.events import BlockStored
from dpserve.kvindex.index import KvIndex, block_keys
from dpserve.kvindex.recent import RecentRoutes
from dpserve.kvindex.text_prefix import CHARS_PER_TOKEN, CHUNK_CHARS, TextPrefixIndex, text_keys
from dpserve.policies import POLICY_NAMES, PrefixMatch, PrefixSource, RequestFeatures, make_policy
from dpserve.replicas.catalog import ModelCatalog
from dpserve.replicas.registry import ReplicaRegistry
from dpserve.router.observe.metrics import RouterMetrics
from dpserve.router.parts import admission_for, policy_tuning, selector_for
from dpserve.router.routing.selection import Selector

MODEL = "dpserve-tiny"
BLOCK_SIZE = 16
PROMPTS = 64
PROMPT_TOKENS = 1024
HOLDERS_PER_PROMPT = 2
DEFAULT_COUNTS = (2, 4, 8, 16, 32, 64)
FLAT_RATIO = 1.3
"""`flat`: the time at the largest fleet is at most this multiple of the time at the first size larger than
the route sample (16 to 64 replicas: an O(replicas) decision would grow about 4-fold). Up to the sample size
every replica is weighed, so the time grows with the few replicas there are (the table shows by how much)."""


@dataclass(frozen=True)
class DecisionReport:
    rows: list[dict[str, Any]]
    text: str


def _fleet(count: int, rng: random.Random) -> tuple[ReplicaRegistry, ModelCatalog]:
    registry = ReplicaRegistry([f"http://127.0.0.1:{20000 + i}" for i in range(count)])
    catalog = ModelCatalog(registry)
    for replica in registry:
        registry.probe_succeeded(replica.id)
        catalog.set_model_cards(replica.id, ({"id": MODEL},))
        replica.block_size = BLOCK_SIZE
        replica.in_flight = rng.randrange(0, 32)
        replica.kv_usage = rng.random()
    return registry, catalog


def _prompts(rng: random.Random) -> list[list[int]]:
    # Pairs of prompts share a system prompt (half their tokens), like chat traffic does.
    prompts = []
    for i in range(PROMPTS):
        shared = random.Random(i // 2).choices(range(32000), k=PROMPT_TOKENS // 2)
        prompts.append(shared + rng.choices(range(32000), k=PROMPT_TOKENS // 2))
    return prompts


def _features(policy_name: str, prompts: list[list[int]], index: int) -> RequestFeatures:
    prompt = prompts[index % len(prompts)]
    if policy_name == "kv_aware":
        keys = tuple(block_keys(prompt, BLOCK_SIZE))
        return RequestFeatures(
            "completions", MODEL, False, PrefixMatch(PrefixSource.KV_EVENTS, len(keys), BLOCK_SIZE, keys=keys)
        )
    if policy_name == "prefix":
        keys = tuple(text_keys(f"{MODEL}\0{_text(prompt)}"))
        prefix = PrefixMatch(PrefixSource.ROUTED_TEXT, len(keys), CHUNK_CHARS // CHARS_PER_TOKEN, keys=keys)
        return RequestFeatures("completions", MODEL, False, prefix)
    if policy_name == "session":
        return RequestFeatures("completions", MODEL, False, session_key=f"user-{index % 997}")
    return RequestFeatures("completions", MODEL, False)


def _text(prompt: list[int]) -> str:
    return " ".join(str(token) for token in prompt)


def _selector(policy_name: str, count: int, seed: int) -> tuple[Selector, list[RequestFeatures]]:
    rng = random.Random(seed)
    settings = RouterSettings()
    registry, catalog = _fleet(count, rng)
    policy = make_policy(policy_name, random.Random(seed), policy_tuning(settings))
    metrics = RouterMetrics(registry, policy.name)
    kv_index = KvIndex() if policy_name == "kv_aware" else None
    text_index = TextPrefixIndex() if policy_name == "prefix" else None
    recent = RecentRoutes(time.monotonic) if policy_name == "kv_aware" else None
    prompts = _prompts(rng)
    ids = [replica.id for replica in registry]
    for number, prompt in enumerate(prompts):
        for holder in rng.sample(ids, min(HOLDERS_PER_PROMPT, count)):
            if kv_index is not None:
                hashes = tuple(range(number * 1000, number * 1000 + len(prompt) // BLOCK_SIZE))
                kv_index.store(holder, BlockStored(hashes, None, tuple(prompt), BLOCK_SIZE))
            if text_index is not None:
                text_index.record(text_keys(f"{MODEL}\0{_text(prompt)}"), holder)
    admission = admission_for(settings)
    indexes = (kv_index, text_index, recent)
    selector = selector_for(settings, registry, catalog, policy, admission, metrics, *indexes, rng=random.Random(seed))
    return selector, [_features(policy_name, prompts, i) for i in range(PROMPTS * 2)]


def time_policy(policy_name: str, counts: Sequence[int], decisions: int, repeats: int) -> dict[int, float]:
    """Seconds per decision at each fleet size: the best of `repeats` rounds, the sizes interleaved in
    every round (so a noisy moment on the machine hits them alike), with the garbage collector paused as
    timeit does: the least disturbed run is the best estimate of the code's own cost."""
    fleets = {count: _selector(policy_name, count, seed=count) for count in counts}
    for selector, requests in fleets.values():
        for request in requests:  # warm caches (the catalog's views, the session rings)
            selector.decide(request)
    best = dict.fromkeys(counts, float("inf"))
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            for count, (selector, requests) in fleets.items():
                started = time.perf_counter()
                for i in range(decisions):
                    if selector.decide(requests[i % len(requests)]) is None:
                        raise RuntimeError("no decision: every replica was full")
                best[count] = min(best[count], (time.perf_counter() - started) / decisions)
    finally:
        if collecting:
            gc.enable()
    return best


def decision_report(
    counts: Sequence[int] = DEFAULT_COUNTS,
    policies: Sequence[str] = POLICY_NAMES,
    decisions: int = 1000,
    repeats: int = 9,
) -> DecisionReport:
    rows: list[dict[str, Any]] = []
    for policy_name in policies:
        for count, seconds in time_policy(policy_name, counts, decisions, repeats).items():
            rows.append({"policy": policy_name, "replicas": count, "us_per_decision": round(seconds * 1e6, 2)})
    return DecisionReport(rows, format_report(rows, counts, policies))


def format_report(rows: list[dict[str, Any]], counts: Sequence[int], policies: Sequence[str]) -> str:
    """The table, and per policy whether the time stays flat once the fleet outgrows the route sample."""
    micros = {(row["policy"], row["replicas"]): row["us_per_decision"] for row in rows}
    sample = RouterSettings().route_sample
    # The first size the router samples at: from there on a decision must not cost more with more replicas.
    reference = min((count for count in counts if count > sample), default=counts[0])
    width = max(len(name) for name in policies)
    lines = [f"policy decision time, microseconds per request (route sample {sample}):"]
    header = "  ".join(f"{count:>7}" for count in counts)
    lines.append(
        f"  {'replicas':>{width}}  {header}  {f'{counts[-1]}/{counts[0]}':>7}  {f'{counts[-1]}/{reference}':>7}"
    )
    verdicts = []
    for name in policies:
        values = [micros[(name, count)] for count in counts]
        overall = values[-1] / values[0]
        past_sample = values[-1] / micros[(name, reference)]
        cells = "  ".join(f"{value:7.1f}" for value in values)
        lines.append(f"  {name:>{width}}  {cells}  {overall:6.2f}x  {past_sample:6.2f}x")
        verdicts.append((name, past_sample <= FLAT_RATIO))
    flat = [name for name, ok in verdicts if ok]
    growing = [name for name, ok in verdicts if not ok]
    lines.append(
        f"decision time flat from {reference} to {counts[-1]} replicas (at most {FLAT_RATIO:g}x for "
        f"{counts[-1] // reference}x the replicas; up to {sample}, every replica is weighed): "
        + ("PASS" if not growing else "FAIL")
        + f" — flat: {', '.join(flat) or 'none'}"
        + (f"; grows: {', '.join(growing)}" if growing else "")
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dpserve bench decision-time", description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default=",".join(map(str, DEFAULT_COUNTS)), help="replica counts")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument("--decisions", type=int, default=1000, help="decisions per timed run")
    parser.add_argument("--repeats", type=int, default=9, help="timed runs per cell (the best is kept)")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    policies = [p for p in args.policies.split(",") if p]
    print(decision_report(counts, policies, args.decisions, args.repeats).text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
