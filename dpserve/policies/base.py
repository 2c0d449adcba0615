"""What a routing policy sees: a request's features and a snapshot of each candidate replica."""

from __future__ import annotations

import enum
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from mypy_extensions import mypyc_attr

from dpserve.policies.latency import ReplicaLatency


class PrefixSource(enum.Enum):
    """Where a request's prefix match comes from."""

    KV_EVENTS = "kv_events"
    """Token blocks the replicas reported caching (precise)."""
    ROUTED_TEXT = "routed_text"
    """Text chunks the router itself sent each replica (approximate)."""


@dataclass(init=False)
class PrefixMatch:
    """How much of the request's prompt each replica already holds, in blocks from the start."""

    source: PrefixSource
    total_blocks: int
    """Full blocks (KV blocks, or text chunks) in the prompt."""
    tokens_per_block: int
    matched: Mapping[str, int]
    """Replica id -> leading blocks it holds (absent = 0)."""
    keys: tuple[int, ...]
    """The blocks' chained keys, for recording where the prompt went."""
    held: Mapping[str, int]
    """Replica id -> blocks it holds in all (from the index): how much of the fleet's cached prefixes it
    already owns, so a new prefix can go where there is least."""
    prompt_tokens: int
    """Tokens in the prompt (0 where not counted: routed text)."""
    peers: int
    """Other routers whose routes count in `held` (peers and sibling workers heard lately): each sees the
    others' routes a moment late, so their `held` counts differ and new prefixes may reach them together."""

    def __init__(
        self,
        source: PrefixSource,
        total_blocks: int,
        tokens_per_block: int,
        matched: Mapping[str, int] | None = None,
        keys: tuple[int, ...] = (),
        held: Mapping[str, int] | None = None,
        prompt_tokens: int = 0,
        peers: int = 0,
    ) -> None:
        # Written out: dataclass's __init__ is interpreted even when compiled (see RequestFeatures).
        self.source = source
        self.total_blocks = total_blocks
        self.tokens_per_block = tokens_per_block
        self.matched = {} if matched is None else matched
        self.keys = keys
        self.held = {} if held is None else held
        self.prompt_tokens = prompt_tokens
        self.peers = peers

    def with_matches(
        self, matched: Mapping[str, int], held: Mapping[str, int] | None = None, peers: int | None = None
    ) -> PrefixMatch:
        """A copy with these matches (and holdings and peers, where given): `dataclasses.replace`, compiled."""
        held = self.held if held is None else held
        peers = self.peers if peers is None else peers
        return PrefixMatch(
            self.source, self.total_blocks, self.tokens_per_block, matched, self.keys, held, self.prompt_tokens, peers
        )

    def blocks(self, replica_id: str) -> int:
        return self.matched.get(replica_id, 0)

    @property
    def best(self) -> int:
        return max(self.matched.values(), default=0)


@dataclass(init=False)
class Slo:
    """What the client was promised for one request (`x-slo-ttft-ms`, `x-slo-tpot-ms`, or its tenant's rules)."""

    ttft_s: float | None
    """Its first token within this many seconds of reaching the router; None: no promise."""
    tpot_s: float | None
    """Each later token within this many seconds, on average; None: no promise."""
    queue: bool
    """Sent anyway when no replica is predicted to meet it (its tenant says so), instead of refused at once."""

    def __init__(self, ttft_s: float | None, tpot_s: float | None, queue: bool = False) -> None:
        # Written out: dataclass's __init__ is interpreted even when compiled (see RequestFeatures).
        self.ttft_s = ttft_s
        self.tpot_s = tpot_s
        self.queue = queue


@dataclass(init=False)
class RequestFeatures:
    """A request as a policy sees it. Not changed once made (`dataclasses.replace` makes another)."""

    endpoint: str
    model: str
    stream: bool
    prefix: PrefixMatch | None
    """Filled only for policies that use it (see `Policy.needs`)."""
    session_key: str | None
    """`x-session-id` header, else the body's `user`; filled only for policies that use it."""
    preferred: tuple[str, ...]
    """What the policy itself prefers over the whole fleet (`Policy.preferred`), filled when it chooses
    among a sample of a larger fleet (a session's ring cannot be read off a sample)."""
    bound: str | None
    """The replica the session's requests last went to, through this router or a peer (session policy)."""
    priority: int
    """0 critical, 1 standard, 2 batch (`router/flow/tenants.py`): how much of a full replica it may take."""
    adapter: str | None
    """The LoRA adapter `model` names, if it names one: it goes where the adapter is, or is loaded
    (`policies/adapters.py`)."""
    slo: Slo | None
    """What the client was promised; None: best effort."""
    body_bytes: int
    """The request body's size: the prompt's length where its tokens are not counted (no prefix read)."""

    # Fields, eq and repr from dataclass; __init__ written out, because the one dataclass makes is
    # interpreted even where the class is compiled (mypyc), and this is made per request.
    def __init__(
        self,
        endpoint: str,
        model: str,
        stream: bool,
        prefix: PrefixMatch | None = None,
        session_key: str | None = None,
        preferred: tuple[str, ...] = (),
        bound: str | None = None,
        priority: int = 1,
        adapter: str | None = None,
        slo: Slo | None = None,
        body_bytes: int = 0,
    ) -> None:
        self.endpoint = endpoint
        self.model = model
        self.stream = stream
        self.prefix = prefix
        self.session_key = session_key
        self.preferred = preferred
        self.bound = bound
        self.priority = priority
        self.adapter = adapter
        self.slo = slo
        self.body_bytes = body_bytes

    @property
    def prompt_tokens(self) -> int:
        """The prompt's tokens as counted for its prefix, else guessed from the body (about 4 bytes each)."""
        prefix = self.prefix
        if prefix is not None and prefix.prompt_tokens > 0:
            return prefix.prompt_tokens
        return self.body_bytes // 4

    def uncached_tokens(self, replica_id: str) -> int:
        """The prompt tokens `replica_id` must compute: the prompt less the whole blocks it holds of it."""
        prefix = self.prefix
        cached = prefix.blocks(replica_id) * prefix.tokens_per_block if prefix is not None else 0
        left = self.prompt_tokens - cached
        return left if left > 0 else 0

    # Copies with one field changed: `dataclasses.replace`, which runs interpreted, costs ~20k instructions.
    def with_prefix(self, prefix: PrefixMatch | None) -> RequestFeatures:
        made = self._copy()
        made.prefix = prefix
        return made

    def with_preferred(self, preferred: tuple[str, ...]) -> RequestFeatures:
        made = self._copy()
        made.preferred = preferred
        return made

    def with_priority(self, priority: int) -> RequestFeatures:
        made = self._copy()
        made.priority = priority
        return made

    def with_slo(self, slo: Slo | None, body_bytes: int) -> RequestFeatures:
        made = self._copy()
        made.slo, made.body_bytes = slo, body_bytes
        return made

    def _copy(self) -> RequestFeatures:
        return RequestFeatures(
            self.endpoint,
            self.model,
            self.stream,
            self.prefix,
            self.session_key,
            self.preferred,
            self.bound,
            self.priority,
            self.adapter,
            self.slo,
            self.body_bytes,
        )


class ReplicaView(Protocol):
    """What a policy reads of a replica: a `ReplicaSnapshot`, or the router's live `Replica` (a decision
    runs without awaiting, so nothing changes under it: reading the live object is reading a snapshot,
    without building one per candidate)."""

    @property
    def id(self) -> str: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def peer_in_flight(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...
    @property
    def kv_blocks(self) -> int:
        """Its KV cache in blocks (`num_gpu_blocks` from its metrics); 0 while not read."""
        ...

    @property
    def load(self) -> int: ...
    @property
    def capacity(self) -> int:
        """Requests it runs at once, learned from its metrics (perhaps one more being tried); 0 while not known."""
        ...

    @property
    def confirmed_capacity(self) -> int:
        """Requests it was last seen to run when full (without the one being tried); 0 while not known."""
        ...

    @property
    def slots(self) -> int:
        """Requests it runs at once as far as known: the capacity, else the most seen running while requests
        waited, else as told (`--replica-max-num-seqs`); 0 while none of those. Routing's, not flow control's."""
        ...

    @property
    def slow_refill(self) -> bool:
        """Its slots were seen idle while requests were on their way to it: one waiting in its engine helps."""
        ...

    @property
    def latency(self) -> ReplicaLatency:
        """Its latency model and what was sent there not yet answering (`policies/latency.py`)."""
        ...


class LoadFromCounts:
    """`load` from the router's in-flight count and the replica's scraped counts."""

    __slots__ = ()
    in_flight: int
    """Requests the router has dispatched to this replica and not yet seen finish (always fresh)."""
    running: int
    waiting: int
    """`vllm:num_requests_running` / `_waiting` from the last scrape (up to one interval old)."""
    peer_in_flight: int
    """What the router's peers (other routers, other workers) say they have in flight there (up to one
    peer update old; 0 without peers)."""
    in_flight_at_scrape: int
    """The router's own and its peers' in-flight counts when that scrape answered."""

    @property
    def external_load(self) -> int:
        """Requests the replica reported beyond the routers': traffic from other clients."""
        return max(0, self.running + self.waiting - self.in_flight_at_scrape)

    @property
    def load(self) -> int:
        # The routers' fresh counts plus what the replica holds for others; summing in_flight with the
        # raw scraped counts would count every routed request twice.
        return self.in_flight + self.peer_in_flight + max(0, self.running + self.waiting - self.in_flight_at_scrape)


@dataclass(frozen=True)
class ReplicaSnapshot(LoadFromCounts):
    """A replica's state at the moment of one routing decision (tests and tools build these)."""

    id: str
    in_flight: int = 0
    running: int = 0
    waiting: int = 0
    in_flight_at_scrape: int = 0
    kv_usage: float = 0.0
    kv_blocks: int = 0
    peer_in_flight: int = 0
    capacity: int = 0
    confirmed_capacity: int = 0
    slots: int = 0
    slow_refill: bool = False
    latency: ReplicaLatency = field(default_factory=ReplicaLatency, compare=False)


@dataclass(init=False)
class Decision:
    id: str
    """The chosen replica."""
    reason: str
    """Why, for the `dpserve_routing_decisions_total{policy,reason}` metric (a small fixed set per policy)."""
    ttft_s: float
    """Predicted time to first token there (-1: the policy predicts none)."""
    ttft_inputs: tuple[float, ...]
    """What that prediction was made from (the latency model's inputs), to learn from the answer."""
    uncached_tokens: int
    """Prompt tokens the chosen replica must compute, as predicted."""
    meets_slo: bool
    """False: no replica was predicted to meet the request's SLO (this is the one predicted nearest)."""

    def __init__(
        self,
        id: str,
        reason: str,
        ttft_s: float = -1.0,
        ttft_inputs: tuple[float, ...] = (),
        uncached_tokens: int = 0,
        meets_slo: bool = True,
    ) -> None:
        # Written out: dataclass's __init__ is interpreted even when compiled (see RequestFeatures).
        self.id = id
        self.reason = reason
        self.ttft_s = ttft_s
        self.ttft_inputs = ttft_inputs
        self.uncached_tokens = uncached_tokens
        self.meets_slo = meets_slo


class Sampling(enum.Enum):
    """How much of a large fleet a policy must see to choose well, so that a decision can cost the same
    with 64 replicas as with 8."""

    ALL = "all"
    """Every candidate (a hash ring's answer depends on the whole set)."""
    WINDOW = "window"
    """A window of replicas at a random offset, plus those likely to hold the prompt's prefix: choosing
    the best of a few random replicas keeps nearly all the balance of choosing among all of them (the
    power of d choices)."""
    TURN = "turn"
    """The next replica in turn (round robin)."""


class Need(enum.Enum):
    KV_PREFIX = "kv_prefix"
    TEXT_PREFIX = "text_prefix"
    SESSION = "session"


@mypyc_attr(allow_interpreted_subclasses=True)  # a policy of one's own needs no compiler
class Policy(Protocol):
    """What the router asks of a policy. Policies subclass it for the hooks' defaults; the router never
    looks at which policy it holds, only at these."""

    name: str
    needs: frozenset[Need]
    """Which request features the router must compute for this policy (the rest stay empty)."""
    sampling: Sampling
    """What the policy needs to see of a large fleet (see `Sampling`)."""

    def choose(self, features: RequestFeatures, candidates: Sequence[ReplicaView]) -> Decision:
        """Pick one of `candidates` (never empty, all healthy and serving the model)."""
        ...

    def preferred(self, features: RequestFeatures, fleet: tuple[str, ...]) -> tuple[str, ...]:
        """Replicas of the whole fleet (ids, sorted) this request should go to if they can take it, best
        first. When the router samples a large fleet they join the sample and reach `choose` as
        `features.preferred`; with `Sampling.TURN` they are the whole sample. Nothing by default."""
        return ()


def pick_least_loaded(candidates: Sequence[ReplicaView], rng: random.Random) -> ReplicaView:
    """The least loaded candidate (see `least_loaded_of`), ties at random: "always the first" piles every
    burst onto replica 0 (a known failure of peer routers)."""
    tied = least_loaded_of(candidates)
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def least_loaded_of(candidates: Sequence[ReplicaView]) -> list[ReplicaView]:
    """The candidates sharing the lowest load, and among those the emptiest KV cache."""
    tied: list[ReplicaView] = []
    best = 0
    for candidate in candidates:  # one pass: `load` is computed once per candidate
        load = candidate.load
        if not tied or load < best:
            best, tied = load, [candidate]
        elif load == best:
            tied.append(candidate)
    if len(tied) > 1:
        least_kv = min(c.kv_usage for c in tied)
        tied = [c for c in tied if c.kv_usage <= least_kv + 1e-9]
    return tied
