"""KV-cache events on ZMQ in vLLM 0.32's wire format, so a subscriber cannot tell a sim from vLLM.

Each batch is one multipart message: [topic (empty, as vLLM's default), sequence number (8 bytes,
big-endian, from 0), payload], the payload a msgpack array [timestamp, [event, ...], data_parallel_rank],
each event a map tagged by "type" with the fields vLLM's own events carry (block hashes are unsigned
64-bit ints, as vLLM sends them by default). With data parallelism each engine publishes on its own
endpoint, as vLLM's `ZmqEventPublisher.offset_endpoint_port` derives it from the configured one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from dpserve.kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

MEDIUM = "GPU"
SEND_HWM = 100_000


def event_to_wire(event: KvEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": None,
            "extra_keys": [None] * len(event.block_hashes),
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": MEDIUM, "group_idx": 0}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(events: Sequence[KvEvent], timestamp: float, data_parallel_rank: int = 0) -> bytes:
    return msgspec.msgpack.encode([timestamp, [event_to_wire(event) for event in events], data_parallel_rank])


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """Engine R's endpoint, as vLLM's: a tcp port + R (port 0 stays 0, the OS picks), an inproc name + `_dp{R}`."""
    if data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        if ":" in endpoint:
            base, port = endpoint.rsplit(":", 1)
            if int(port) == 0:
                return endpoint
            return f"{base}:{int(port) + data_parallel_rank}"
        return endpoint
    raise ValueError(f"KV-event endpoint {endpoint!r}: must contain 'inproc' or 'tcp' with data parallelism")


class KvEventBindError(OSError):
    """The endpoint a publisher must bind is taken (or cannot be bound)."""


class KvEventPublisher:
    """A ZMQ PUB socket. PUB never blocks a sender: with no subscriber, or one too slow, batches are
    dropped, and the sequence numbers let a subscriber see the gap (as with vLLM). Engine `data_parallel_rank`'s
    publisher binds its offset endpoint and stamps its rank on every batch. `offset`: the endpoint's offset
    when it is not the rank (`dpserve sim --count`: replica I's engine R on offset I x engines + R);
    `context`: the ZMQ context (none: the process's shared one)."""

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        data_parallel_rank: int = 0,
        *,
        offset: int | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self._context: zmq.Context[zmq.Socket[bytes]] = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._socket.setsockopt(zmq.LINGER, 0)
        bind = offset_endpoint(endpoint, data_parallel_rank if offset is None else offset)
        try:
            self._socket.bind(bind)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            raise KvEventBindError(f"KV events: cannot bind {bind}: {exc}") from None
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        """Where it is bound (the port the OS chose, for port 0)."""
        self._rank = data_parallel_rank
        self._topic = topic.encode()
        self._seq = 0

    @property
    def published(self) -> int:
        """Batches published so far, dropped ones included: the sequence number the next one gets."""
        return self._seq

    def publish(self, events: Sequence[KvEvent]) -> None:
        payload = encode_batch(events, time.time(), self._rank)
        try:
            self._socket.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # dropped at the high-water mark; the sequence number still advances
        self._seq += 1

    def close(self) -> None:
        self._socket.close(linger=0)
