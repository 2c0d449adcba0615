"""The router process against raw-socket replicas: what reaches the client, byte for byte and header by
header, when a replica sends what real vLLM cannot be made to send on demand."""

from __future__ import annotations

import hashlib
import json
import socket

import httpx
import openai
import psutil
import pytest

from dpserve.config import RouterSettings
from tests.integration.conftest import start_router, stop_router
from tests.integration.raw_replica import RawReplica, Seen, json_answer

pytestmark = pytest.mark.integration

EMBEDDING = json.dumps({"object": "embedding", "index": 0, "embedding": [0.123456789] * 1000}).encode()


def big_embeddings(megabytes: int) -> bytes:
    count = megabytes * 1024 * 1024 // len(EMBEDDING) + 1
    return b'{"object":"list","model":"m","data":[' + b",".join([EMBEDDING] * count) + b"]}"


def test_a_20_mb_answer_arrives_whole_and_the_router_memory_stays_bounded() -> None:
    body = big_embeddings(20)
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    digest = hashlib.sha256(body).hexdigest()
    with RawReplica({"/v1/embeddings": lambda seen: answer}) as replica:
        router = start_router([replica.url], "least_loaded")
        try:
            process = psutil.Process(router.process.pid)
            idle_rss = process.memory_info().rss
            peak = idle_rss
            with httpx.Client(timeout=60) as client:
                for _ in range(100):
                    got = client.post(f"{router.url}/v1/embeddings", json={"model": "m", "input": "x"})
                    assert got.status_code == 200
                    assert hashlib.sha256(got.content).hexdigest() == digest
                    peak = max(peak, process.memory_info().rss)
            after = process.memory_info().rss
            print(f"router RSS: idle {idle_rss / 2**20:.0f} MiB, peak {peak / 2**20:.0f}, after {after / 2**20:.0f}")
            assert after <= 2 * idle_rss + 64 * 2**20, (idle_rss, after)
        finally:
            stop_router(router)


def test_an_answer_over_the_bound_is_a_502_and_the_router_serves_the_next_request() -> None:
    body = big_embeddings(2)
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    routes = {"/v1/embeddings": lambda seen: answer, "/tokenize": lambda seen: json_answer({"tokens": [1]})}
    with RawReplica(routes) as replica:
        router = start_router([replica.url], "least_loaded", "--max-response-bytes", str(1024 * 1024))
        try:
            got = httpx.post(f"{router.url}/v1/embeddings", json={"model": "m", "input": "x"}, timeout=30)
            assert got.status_code == 502
            error = got.json()["error"]
            assert error["code"] == "response_too_large" and "--max-response-bytes" in error["message"]
            assert len(replica.requests("/v1/embeddings")) == 1  # not retried: the bound is the router's
            assert httpx.post(f"{router.url}/tokenize", json={"prompt": "x"}, timeout=10).json() == {"tokens": [1]}
            replicas = httpx.get(f"{router.url}/admin/replicas", timeout=5).json()["replicas"]
            assert replicas[0]["state"] == "healthy" and replicas[0]["ejections"] == 0
        finally:
            stop_router(router)


@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_reaches_the_client_and_hop_by_hop_headers_do_not(status: int) -> None:
    extra = b"retry-after: 7\r\nconnection: keep-alive\r\nkeep-alive: timeout=5\r\nproxy-authenticate: Basic\r\n"
    extra += b"x-internal-secret: 1\r\n"
    error = {"error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": None}}
    with RawReplica({"/v1/completions": lambda seen: json_answer(error, status, extra)}) as replica:
        router = start_router([replica.url], "least_loaded", "--retries", "0")
        try:
            got = httpx.post(f"{router.url}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
            assert got.status_code == status
            assert got.headers["retry-after"] == "7"
            for hop in ("keep-alive", "proxy-authenticate", "x-internal-secret"):
                assert hop not in got.headers
            assert got.json()["error"]["message"] == "busy"
        finally:
            stop_router(router)


def test_204_is_relayed_without_a_body_or_a_length() -> None:
    with RawReplica({"/tokenize": lambda seen: b"HTTP/1.1 204 No Content\r\n\r\n"}) as replica:
        router = start_router([replica.url], "least_loaded")
        try:
            got = httpx.post(f"{router.url}/tokenize", json={"prompt": "x"}, timeout=10)
            assert got.status_code == 204 and got.content == b""
            assert "content-length" not in got.headers and "transfer-encoding" not in got.headers
        finally:
            stop_router(router)


def test_a_keep_alive_connection_the_replica_drops_as_a_request_arrives_is_not_held_against_it() -> None:
    def second_request_dropped(seen: Seen) -> bytes | None:
        # As a replica whose keep-alive timer fires just as the router reuses the connection.
        return json_answer({"choices": [{"text": "ok"}]}) if seen.index == 0 else None

    with RawReplica({"/v1/completions": second_request_dropped}) as replica:
        router = start_router([replica.url], "least_loaded", "--retries", "0")
        try:
            with httpx.Client(timeout=10) as client:
                for _ in range(20):
                    got = client.post(f"{router.url}/v1/completions", json={"model": "m", "prompt": "x"})
                    assert got.status_code == 200, got.text
            replicas = httpx.get(f"{router.url}/admin/replicas", timeout=5).json()["replicas"]
            assert replicas[0]["state"] == "healthy" and replicas[0]["ejections"] == 0
            assert replicas[0]["last_error"] is None
        finally:
            stop_router(router)


def test_request_ids_and_headers_are_checked_at_the_door() -> None:
    with RawReplica({"/tokenize": lambda seen: json_answer({"tokens": [1]})}) as replica:
        router = start_router([replica.url], "least_loaded")
        try:
            with httpx.Client(timeout=10) as client:
                long_id = client.post(
                    f"{router.url}/tokenize", json={"prompt": "x"}, headers={"x-request-id": "a" * 129}
                )
                assert long_id.status_code == 400 and "x-request-id" in long_id.json()["error"]["message"]
                spaced = client.post(f"{router.url}/tokenize", json={"prompt": "x"}, headers={"x-request-id": "a b"})
                assert spaced.status_code == 400
                fine = client.post(f"{router.url}/tokenize", json={"prompt": "x"}, headers={"x-request-id": "a" * 128})
                assert fine.status_code == 200 and fine.headers["x-request-id"] == "a" * 128
            assert replica.requests("/tokenize")[-1].headers["x-request-id"] == "a" * 128
            # A control character in a header: the router's HTTP parser refuses it, in OpenAI's shape.
            raw = b"POST /tokenize HTTP/1.1\r\nhost: x\r\nx-request-id: a\x01b\r\ncontent-length: 2\r\n\r\n{}"
            port = int(router.url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(raw)
                reply = sock.recv(65536)
            assert reply.startswith(b"HTTP/1.1 400") and b'"error"' in reply
            assert httpx.post(f"{router.url}/tokenize", json={"prompt": "x"}, timeout=10).status_code == 200
        finally:
            stop_router(router)


def test_audio_is_relayed_as_multipart_bytes_with_the_official_sdk() -> None:
    transcript = {"text": "hello from the stand-in"}
    with RawReplica({"/v1/audio/transcriptions": lambda seen: json_answer(transcript)}) as replica:
        router = start_router([replica.url], "least_loaded")
        try:
            client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
            audio = b"RIFF" + bytes(range(256)) * 64  # not parsed by anyone but the replica
            result = client.audio.transcriptions.create(model="m", file=("clip.wav", audio, "audio/wav"))
            assert result.text == transcript["text"]
            seen = replica.requests("/v1/audio/transcriptions")[0]
            assert seen.headers["content-type"].startswith("multipart/form-data; boundary=")
            assert audio in seen.body and b'name="model"' in seen.body
            # Malformed multipart: a 400 at the router, and the next request is served.
            bad = httpx.post(
                f"{router.url}/v1/audio/transcriptions",
                content=b"--XX\r\nno headers, no end",
                headers={"content-type": "multipart/form-data; boundary=XX"},
                timeout=10,
            )
            assert bad.status_code == 400 and "multipart" in bad.json()["error"]["message"]
            no_boundary = httpx.post(
                f"{router.url}/v1/audio/translations",
                content=b"x",
                headers={"content-type": "multipart/form-data"},
                timeout=10,
            )
            assert no_boundary.status_code == 400
            assert len(replica.requests("/v1/audio/transcriptions")) == 1
            assert client.audio.transcriptions.create(model="m", file=("clip.wav", audio)).text == transcript["text"]
        finally:
            stop_router(router)


VLLM_AUDIO_LIMIT_BYTES = 25 * 1024 * 1024
"""vLLM's largest upload: VLLM_MAX_AUDIO_CLIP_FILESIZE_MB (25, in MiB) for an audio clip."""


def test_the_default_body_limit_lets_vllms_largest_upload_through_and_refuses_past_it() -> None:
    transcript = {"text": "a long clip"}
    with RawReplica({"/v1/audio/transcriptions": lambda seen: json_answer(transcript)}) as replica:
        router = start_router([replica.url], "least_loaded")  # the default --max-body-bytes
        try:
            client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=120)
            audio = bytes(range(256)) * (VLLM_AUDIO_LIMIT_BYTES // 256)
            result = client.audio.transcriptions.create(model="m", file=("clip.wav", audio, "audio/wav"))
            assert result.text == transcript["text"]
            (seen,) = replica.requests("/v1/audio/transcriptions")
            assert len(seen.body) > VLLM_AUDIO_LIMIT_BYTES and audio in seen.body  # the whole clip, relayed
            # Past the limit: refused as soon as the head announces it (the body is never read).
            limit = RouterSettings().max_body_bytes
            port = int(router.url.rsplit(":", 1)[1])
            head = (
                f"POST /v1/audio/transcriptions HTTP/1.1\r\nhost: x\r\ncontent-length: {limit + 1}\r\n"
                "content-type: multipart/form-data; boundary=XX\r\n\r\n"
            )
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(head.encode() + b"--XX\r\n")
                reply = receive_all(sock)
            status, _, body = reply.partition(b"\r\n\r\n")
            assert status.startswith(b"HTTP/1.1 413"), reply[:200]
            error = json.loads(body)["error"]
            assert error["code"] == "body_too_large" and error["type"] == "invalid_request_error"
            assert str(limit) in error["message"]
            assert len(replica.requests("/v1/audio/transcriptions")) == 1
        finally:
            stop_router(router)


def receive_all(sock: socket.socket) -> bytes:
    """What the peer sends until it closes the connection."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_an_unknown_response_id_is_a_404_after_asking_every_replica() -> None:
    missing = {"error": {"message": "Response not found", "type": "invalid_request_error", "param": None, "code": 404}}

    def by_id(seen: Seen) -> bytes:
        return json_answer(missing, 404)

    with RawReplica({"/v1/responses/resp_nope": by_id}) as one, RawReplica({"/v1/responses/resp_nope": by_id}) as two:
        router = start_router([one.url, two.url], "least_loaded")
        try:
            got = httpx.get(f"{router.url}/v1/responses/resp_nope", timeout=10)
            assert got.status_code == 404 and got.json()["error"]["code"] == "response_not_found"
            assert len(one.requests("/v1/responses/resp_nope")) == len(two.requests("/v1/responses/resp_nope")) == 1
            assert httpx.get(f"{router.url}/v1/responses/bad%20id", timeout=10).status_code == 404
            assert httpx.get(f"{router.url}/v1/models", timeout=10).status_code == 200
        finally:
            stop_router(router)
