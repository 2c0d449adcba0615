"""The policy benchmark's workloads and their oracle hit rates.

Each workload is a list of chat requests in issue order, grouped into "threads" that must run one
request after another (a conversation's turns); independent threads run concurrently.
- shared_prefix: G groups x P prompts; each group has a long system prompt of its own; the prompts are
  interleaved across groups (g0, g1, ..., g0, g1, ...), each with a short question of its own.
- multi_turn: C conversations x T turns; each turn resends the conversation's whole history (with a
  fixed assistant reply per turn, so the tokens are known in advance) plus a new user message.

The oracle hit rate is computed from the requests' token ids as vLLM counts hits: a request hits its
longest run of leading full blocks already computed, less the block holding its last token.
- `oracle_unbounded`: every distinct block is computed once in the whole fleet and hit ever after.
- `oracle_partitioned`: the groups (or conversations) dealt evenly over the replicas, each replica an
  LRU cache of a given size (the simulator's cache model), requests in issue order.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dpserve.kvindex.index import block_keys
from dpserve.sim.cache import NoRoom, PrefixCache

WORDS = (
    "the router sends each request to the replica whose cache holds its prefix while keeping every gpu "
    "busy queue batch token block engine latency stream model prompt answer system user question data "
    "parallel serving throughput memory schedule prefill decode attention layer weight tensor kernel"
).split()


@dataclass
class BenchRequest:
    thread: int
    """Requests of one thread run in order; threads run concurrently."""
    group: int
    """The shared-prefix group, or the conversation: what a perfect partition keeps together."""
    messages: list[dict[str, str]]
    session: str
    token_ids: tuple[int, ...] = ()
    """Filled by the benchmark from a replica's /tokenize (the ids vLLM will see)."""

    def body(self, model: str, max_tokens: int, stream: bool) -> dict[str, Any]:
        return {
            "model": model,
            "messages": self.messages,
            "max_tokens": max_tokens,
            "stream": stream,
            "user": self.session,
            "temperature": 0,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        }


@dataclass
class Workload:
    name: str
    requests: list[BenchRequest]
    groups: int
    description: str
    threads: int = field(init=False)

    def __post_init__(self) -> None:
        self.threads = len({r.thread for r in self.requests})


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def shared_prefix(groups: int, prompts: int, prefix_words: int, question_words: int, seed: int) -> Workload:
    rng = random.Random(seed)
    systems = [f"Group {g}. " + _text(rng, prefix_words) for g in range(groups)]
    requests: list[BenchRequest] = []
    for p in range(prompts):
        # Every group once per round, in a new order each round: a fixed order would let round robin
        # pin each group to one replica whenever the group count is a multiple of the replica count.
        for g in rng.sample(range(groups), groups):
            messages = [
                {"role": "system", "content": systems[g]},
                {"role": "user", "content": f"Question {p}: " + _text(rng, question_words)},
            ]
            # Every request is its own thread: concurrency decides how many run at once.
            requests.append(BenchRequest(len(requests), g, messages, f"group-{g}"))
    return Workload(
        "shared_prefix",
        requests,
        groups,
        f"{groups} groups x {prompts} prompts, ~{prefix_words}-word system prompt each, interleaved",
    )


def multi_turn(conversations: int, turns: int, opening_words: int, turn_words: int, seed: int) -> Workload:
    rng = random.Random(seed)
    requests = []
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": f"Conversation {c}. " + _text(rng, opening_words)}] for c in range(conversations)
    ]
    for t in range(turns):
        for c in range(conversations):
            history = histories[c]
            history.append({"role": "user", "content": f"Turn {t}: " + _text(rng, turn_words)})
            requests.append(BenchRequest(c, c, [dict(m) for m in history], f"conversation-{c}"))
            history.append({"role": "assistant", "content": _text(rng, turn_words)})
    return Workload(
        "multi_turn",
        requests,
        conversations,
        f"{conversations} conversations x {turns} turns, each turn resending the history",
    )


def _hit_blocks(keys: Sequence[int], num_tokens: int, block_size: int, present: set[int]) -> int:
    limit = min(len(keys), (num_tokens - 1) // block_size)
    count = 0
    while count < limit and keys[count] in present:
        count += 1
    return count


def oracle_unbounded(requests: Sequence[BenchRequest], block_size: int) -> float:
    seen: set[int] = set()
    hits = queries = 0
    for request in requests:
        keys = block_keys(request.token_ids, block_size)
        hits += _hit_blocks(keys, len(request.token_ids), block_size, seen) * block_size
        queries += len(request.token_ids)
        seen.update(keys)
    return hits / queries if queries else 0.0


def oracle_partitioned(
    requests: Sequence[BenchRequest], block_size: int, replicas: int, capacity_blocks: int, max_tokens: int
) -> float:
    """Groups dealt round-robin over the replicas; each replica's cache replayed request by request."""
    caches = [PrefixCache(capacity_blocks, block_size) for _ in range(replicas)]
    hits = queries = 0
    for request in requests:
        cache = caches[request.group % replicas]
        try:
            allocation = cache.allocate(list(request.token_ids), max_tokens)
        except NoRoom:  # cannot happen one request at a time unless the request alone is too big
            queries += len(request.token_ids)
            continue
        hits += allocation.hit_tokens
        queries += len(request.token_ids)
        cache.free(allocation)
    return hits / queries if queries else 0.0
