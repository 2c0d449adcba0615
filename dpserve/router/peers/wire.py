"""What routers say to each other, on the wire: length-prefixed msgpack frames, checked field by field on the
way in. A peer is another process, perhaps another version or a broken one: anything it sends that is not
exactly this shape is a `PeerWireError` (the link is dropped and tried again later), and every collection is
bounded, so no peer can make this router hold unbounded memory."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dpserve.router.scale.held import Held

VERSION = 1
LENGTH = struct.Struct(">I")
MAX_FRAME_BYTES = 8 * 1024 * 1024
MAX_REPLICAS = 4096
"""Replica URLs one update may name (in-flight counts, verdicts)."""
MAX_ROUTES = 8192
"""Routes one update may carry; a router sends at most this many per interval (older ones are dropped)."""
MAX_KEYS_PER_ROUTE = 65536
MAX_BINDINGS = 8192
MAX_USAGE = 4096
"""Tenants in one update's usage report."""
MAX_MODELS = 1024
"""Models in one update's count of requests held."""
MAX_TEXT = 512
MAX_COUNT = 1_000_000
KEY_LIMIT = 1 << 64
SNAPSHOT_MAX_BYTES = 512 * 1024 * 1024
_DECODER = msgspec.msgpack.Decoder()


class PeerWireError(ValueError):
    """A peer sent something that is not a well-formed update or snapshot."""


@dataclass(frozen=True)
class PeerUpdate:
    """One router's news since its last update. `in_flight` and `unhealthy` are whole (each update
    replaces the last, so a lost update costs nothing); `routes` and `bindings` are what is new."""

    origin: str
    """The sending router's id for this life of its process (a restart is a new origin)."""
    seq: int
    sent_at: float
    """The sender's wall clock (seconds since the epoch), to tell stale updates."""
    in_flight: dict[str, int] = field(default_factory=dict)
    """Replica URL -> requests the sender has in flight there."""
    unhealthy: tuple[str, ...] = ()
    """Replica URLs the sender has ejected."""
    routes: list[tuple[str, Sequence[int]]] = field(default_factory=list)
    """(replica URL, block keys of a prompt just sent there), oldest first."""
    bindings: list[tuple[str, str]] = field(default_factory=list)
    """(session key, replica URL): where a session's requests now go."""
    usage: list[tuple[str, int, int]] = field(default_factory=list)
    """(tenant, requests started, tokens answered) since the sender's last update: its share of quotas."""
    held: tuple[tuple[str, Held], ...] = ()
    """(model, the requests the sender holds for it, on its wall clock): whole, like the counts; the scale
    signal's queue is every router's (`scale/advisor.py`)."""
    leaving: bool = False
    """The sender is shutting down: forget it at once."""


@dataclass(frozen=True)
class PeerSnapshot:
    """What a starting router loads from a peer before it serves."""

    origin: str
    kv: list[tuple[str, int | None, list[tuple[int | bytes, int, int]]]]
    """(replica URL, block size, [(engine hash, router key, copies), ...] oldest first) per replica."""
    recent: list[tuple[int, str, float]]
    """(block key, replica URL, age in seconds) of routes still within the sender's TTL."""


def frame(payload: bytes) -> bytes:
    return LENGTH.pack(len(payload)) + payload


def encode_update(update: PeerUpdate) -> bytes:
    """One update as a frame (length prefix included)."""
    body: dict[str, Any] = {
        "v": VERSION,
        "o": update.origin,
        "s": update.seq,
        "t": update.sent_at,
        "f": update.in_flight,
        "u": list(update.unhealthy),
    }
    if update.routes:
        body["r"] = [[url, list(keys)] for url, keys in update.routes]
    if update.bindings:
        body["b"] = [list(pair) for pair in update.bindings]
    if update.usage:
        body["q"] = [list(entry) for entry in update.usage]
    if update.held:
        body["h"] = [[model, *held] for model, held in update.held]
    if update.leaving:
        body["x"] = True
    return frame(msgspec.msgpack.encode(body))


def frame_length(prefix: bytes) -> int:
    """The payload length a frame's 4-byte prefix announces, refused past `MAX_FRAME_BYTES`."""
    length: int = LENGTH.unpack(prefix)[0]
    if length > MAX_FRAME_BYTES:
        raise PeerWireError(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
    return length


def decode_update(payload: bytes) -> PeerUpdate:
    body = _unpack(payload)
    if not isinstance(body, dict) or body.get("v") != VERSION:
        raise PeerWireError("not a version-1 update")
    in_flight = _mapping(body.get("f", {}), "f")
    unhealthy = _list(body.get("u", []), "u", MAX_REPLICAS)
    routes = _list(body.get("r", []), "r", MAX_ROUTES)
    bindings = _list(body.get("b", []), "b", MAX_BINDINGS)
    usage = _list(body.get("q", []), "q", MAX_USAGE)
    held = _list(body.get("h", []), "h", MAX_MODELS)
    leaving = body.get("x", False)
    if not isinstance(leaving, bool):
        raise PeerWireError("x: not a boolean")
    return PeerUpdate(
        origin=_text(body.get("o"), "o"),
        seq=_count(body.get("s"), "s", 1 << 62),
        sent_at=_number(body.get("t"), "t"),
        in_flight={_text(url, "f"): _count(n, "f", MAX_COUNT) for url, n in in_flight.items()},
        unhealthy=tuple(_text(url, "u") for url in unhealthy),
        routes=[_route(route) for route in routes],
        bindings=[_binding(pair) for pair in bindings],
        usage=[_usage(entry) for entry in usage],
        held=tuple(_held(entry) for entry in held),
        leaving=leaving,
    )


def encode_snapshot(snapshot: PeerSnapshot) -> bytes:
    body = {
        "v": VERSION,
        "o": snapshot.origin,
        "kv": [[url, size, [list(entry) for entry in entries]] for url, size, entries in snapshot.kv],
        "recent": [list(entry) for entry in snapshot.recent],
    }
    return msgspec.msgpack.encode(body)


def decode_snapshot(payload: bytes, max_blocks: int) -> PeerSnapshot:
    """A peer's snapshot, of at most `max_blocks` KV blocks in all (the receiving index's own bound)."""
    body = _unpack(payload)
    if not isinstance(body, dict) or body.get("v") != VERSION:
        raise PeerWireError("not a version-1 snapshot")
    kv: list[tuple[str, int | None, list[tuple[int | bytes, int, int]]]] = []
    budget = max_blocks
    for item in _list(body.get("kv", []), "kv", MAX_REPLICAS):
        if not isinstance(item, list) or len(item) != 3:
            raise PeerWireError("kv: not [url, block size, entries]")
        url, size, raw_entries = item
        entries = _list(raw_entries, "kv entries", budget)
        budget -= len(entries)
        kv.append(
            (
                _text(url, "kv"),
                None if size is None else _count(size, "kv block size", MAX_COUNT),
                [_kv_entry(entry) for entry in entries],
            )
        )
    recent = [_recent_entry(entry) for entry in _list(body.get("recent", []), "recent", max_blocks)]
    return PeerSnapshot(origin=_text(body.get("o"), "o"), kv=kv, recent=recent)


def _unpack(payload: bytes) -> Any:
    try:
        return _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise PeerWireError(f"undecodable: {exc}") from None


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_TEXT:
        raise PeerWireError(f"{name}: not a short text")
    return value


def _count(value: Any, name: str, limit: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
        raise PeerWireError(f"{name}: not a count in 0..{limit}")
    return value


def _number(value: Any, name: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
        raise PeerWireError(f"{name}: not a number")
    return float(value)


def _key(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < KEY_LIMIT:
        raise PeerWireError(f"{name}: not a 64-bit block key")
    return value


def _list(value: Any, name: str, limit: int) -> list[Any]:
    if not isinstance(value, list) or len(value) > limit:
        raise PeerWireError(f"{name}: not a list of at most {limit}")
    return value


def _mapping(value: Any, name: str) -> dict[Any, Any]:
    if not isinstance(value, dict) or len(value) > MAX_REPLICAS:
        raise PeerWireError(f"{name}: not a map of at most {MAX_REPLICAS}")
    return value


def _route(value: Any) -> tuple[str, list[int]]:
    if not isinstance(value, list) or len(value) != 2:
        raise PeerWireError("r: not [url, keys]")
    keys = _list(value[1], "r keys", MAX_KEYS_PER_ROUTE)
    return _text(value[0], "r"), [_key(key, "r keys") for key in keys]


def _binding(value: Any) -> tuple[str, str]:
    if not isinstance(value, list) or len(value) != 2:
        raise PeerWireError("b: not [session key, url]")
    return _text(value[0], "b"), _text(value[1], "b")


def _usage(value: Any) -> tuple[str, int, int]:
    if not isinstance(value, list) or len(value) != 3:
        raise PeerWireError("q: not [tenant, requests, tokens]")
    return _text(value[0], "q"), _count(value[1], "q requests", MAX_COUNT), _count(value[2], "q tokens", 1 << 40)


def _held(value: Any) -> tuple[str, Held]:
    if not isinstance(value, list) or len(value) != 5:
        raise PeerWireError("h: not [model, queued, since, cold, since]")
    model = value[0]
    if not isinstance(model, str) or len(model) > MAX_TEXT:  # "": a request that named no model, none known
        raise PeerWireError("h: not a short text")
    sinces = [_number(value[index], "h since") for index in (2, 4)]
    if not all(math.isfinite(since) for since in sinces):
        raise PeerWireError("h since: not finite")
    return model, Held(
        _count(value[1], "h queued", MAX_COUNT), sinces[0], _count(value[3], "h cold", MAX_COUNT), sinces[1]
    )


def _kv_entry(value: Any) -> tuple[int | bytes, int, int]:
    if not isinstance(value, list) or len(value) != 3:
        raise PeerWireError("kv entry: not [engine hash, key, copies]")
    engine_hash, key, copies = value
    if isinstance(engine_hash, bool) or not isinstance(engine_hash, int | bytes):
        raise PeerWireError("kv entry: an engine hash is an integer or bytes")
    if isinstance(engine_hash, bytes) and len(engine_hash) > 64:
        raise PeerWireError("kv entry: an engine hash of more than 64 bytes")
    return engine_hash, _key(key, "kv entry"), _count(copies, "kv entry copies", MAX_COUNT)


def _recent_entry(value: Any) -> tuple[int, str, float]:
    if not isinstance(value, list) or len(value) != 3:
        raise PeerWireError("recent: not [key, url, age]")
    return _key(value[0], "recent"), _text(value[1], "recent"), max(0.0, _number(value[2], "recent age"))
