"""The monitor's reads over the lean client (`PooledReads`), against raw loopback replicas: answers whole,
connections kept, the key sent, and each way of getting no answer told apart."""

from __future__ import annotations

import asyncio
import socket

import pytest

from dpserve.replicas.access import ReplicaAccess
from dpserve.replicas.monitor import ProbeFailed
from dpserve.router.http.replica_reads import PooledReads
from tests.unit.test_upstream import serving


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_reads_come_whole_over_one_kept_connection_with_the_key() -> None:
    heads: list[bytes] = []

    async def replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            heads.append(head)
            body = b"vllm:num_requests_running 0\n" * 2000 if head.startswith(b"GET /metrics") else b""
            status = b"503 Service Unavailable" if head.startswith(b"GET /v1/models") else b"200 OK"
            writer.write(b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body))
            await writer.drain()

    reads = PooledReads(ReplicaAccess(key="sekret"), timeout_s=2.0)
    async with serving(replica) as (address, connections):
        url = f"http://{address.host}:{address.port}"
        assert await reads.get(url, "/health") == (200, b"")
        status, body = await reads.get(url, "/metrics")
        assert status == 200 and len(body) == 2000 * 28
        assert await reads.get(url, "/v1/models") == (503, b"")  # the monitor judges the status
    reads.close()
    assert len(connections) == 1
    assert [head.split(b" ")[1] for head in heads] == [b"/health", b"/metrics", b"/v1/models"]
    assert all(b"Authorization: Bearer sekret" in head for head in heads)


async def test_nothing_listening_is_a_refused_read() -> None:
    reads = PooledReads(ReplicaAccess(), timeout_s=2.0)
    with pytest.raises(ProbeFailed) as failed:
        await reads.get(f"http://127.0.0.1:{free_port()}", "/health")
    assert failed.value.refused


async def test_a_replica_that_never_answers_fails_the_read_at_the_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    reads = PooledReads(ReplicaAccess(), timeout_s=0.2)
    async with serving(silent) as (address, _):
        started = asyncio.get_running_loop().time()
        with pytest.raises(ProbeFailed) as failed:
            await reads.get(f"http://{address.host}:{address.port}", "/health")
        waited = asyncio.get_running_loop().time() - started
    reads.close()
    assert not failed.value.refused and 0.15 < waited < 2.0
    assert "/health" in str(failed.value)


async def test_a_broken_answer_fails_the_read_and_the_next_read_connects_afresh() -> None:
    answered = [0]

    async def replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        answered[0] += 1
        if answered[0] == 1:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort")  # then the connection ends
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()

    reads = PooledReads(ReplicaAccess(), timeout_s=2.0)
    async with serving(replica) as (address, connections):
        url = f"http://{address.host}:{address.port}"
        with pytest.raises(ProbeFailed):
            await reads.get(url, "/metrics")
        assert await reads.get(url, "/health") == (200, b"ok")
    reads.close()
    assert len(connections) == 2
