"""Decoding vLLM's KV-cache events off the wire, in both formats vLLM has used.

A ZMQ message is [topic, sequence number (8 bytes, big-endian), msgpack payload]; the payload is an
array [timestamp, [event, ...], data_parallel_rank?]. vLLM 0.32 sends each event as a map tagged by
"type"; older releases sent positional arrays whose first item is the tag:
["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium?],
["BlockRemoved", block_hashes, medium?], ["AllBlocksCleared"].
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

EngineHash = int | bytes
"""vLLM's own block hash: a 64-bit int by default, raw bytes with some hash settings."""

# Blocks offloaded to other tiers (CPU memory, storage) do not save the GPU a prefill.
ROUTABLE_MEDIA = (None, "GPU")


class EventDecodeError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[Any, ...] | None = None
    """Per block: what besides tokens went into the engine's hash (LoRA, images, cache salt), or None."""
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    sequence: int
    timestamp: float
    events: tuple[KvEvent, ...]


_DECODER = msgspec.msgpack.Decoder()


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """One multipart message: [topic, seq, payload] (or [seq, payload] from a topic-less publisher)."""
    if len(frames) == 3:
        _, seq_frame, payload = frames
    elif len(frames) == 2:
        seq_frame, payload = frames
    else:
        raise EventDecodeError(f"expected 2 or 3 frames, got {len(frames)}")
    if len(seq_frame) != 8:
        raise EventDecodeError(f"sequence frame is {len(seq_frame)} bytes, expected 8")
    try:
        batch = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"payload is not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise EventDecodeError("payload is not [timestamp, [events], ...]")
    timestamp = batch[0] if isinstance(batch[0], int | float) else 0.0
    events = tuple(decode_event(raw) for raw in batch[1])
    return EventBatch(int.from_bytes(seq_frame, "big"), float(timestamp), events)


def decode_event(raw: Any) -> KvEvent:
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        fields = _positional(kind, raw[1:])
    else:
        raise EventDecodeError(f"event is neither a map nor a tagged array: {raw!r:.80}")
    try:
        if kind == "BlockStored":
            hashes = _hashes(fields["block_hashes"])
            extra = fields.get("extra_keys")
            return BlockStored(
                block_hashes=hashes,
                parent_block_hash=_hash_or_none(fields.get("parent_block_hash")),
                token_ids=tuple(array("I", fields["token_ids"])),  # checked and copied in C: ~100 per event
                block_size=int(fields["block_size"]),
                extra_keys=_frozen(extra) if isinstance(extra, list) else None,
                medium=fields.get("medium"),
            )
        if kind == "BlockRemoved":
            return BlockRemoved(_hashes(fields["block_hashes"]), fields.get("medium"))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise EventDecodeError(f"malformed {kind} event: {exc!r}") from None
    raise EventDecodeError(f"unknown event type {kind!r}")


_POSITIONAL_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _positional(kind: str, values: list[Any]) -> dict[str, Any]:
    names = _POSITIONAL_FIELDS.get(kind, ())
    return dict(zip(names, values, strict=False))


def _frozen(value: Any) -> Any:
    """msgpack arrays as tuples, all the way down: vLLM sends a LoRA block's extra keys as `(name,)`, and
    the router's own keys (`index.block_keys`) hash that tuple's repr."""
    return tuple(_frozen(item) for item in value) if isinstance(value, list) else value


def _hashes(values: Any) -> tuple[EngineHash, ...]:
    if not isinstance(values, list):
        raise TypeError("block_hashes is not an array")
    return tuple(_hash(value) for value in values)


def _hash(value: Any) -> EngineHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise TypeError(f"block hash {value!r:.40} is neither an int nor bytes")
    return value


def _hash_or_none(value: Any) -> EngineHash | None:
    return None if value is None else _hash(value)
