"""SIGTERM on the router process: it stops accepting at once, lets streams in flight finish within the
grace period, then exits; past the grace period it cuts them and exits anyway, never hangs."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from tests.integration.conftest import running_sim, start_router, stop_router

pytestmark = pytest.mark.integration

# 50 ms per streamed token: 40 tokens take about 2 s.
SLOW_SIM = ("--decode-ms-per-token", "50")
STREAM = {"model": "dpserve-tiny", "prompt": "count slowly", "max_tokens": 40, "stream": True}


async def refuses_connections(url: str) -> bool:
    """True once a new request gets no answer: refused outright, or (when it raced into the listen backlog
    just before the socket closed) accepted by the kernel and closed unanswered."""
    try:
        async with httpx.AsyncClient(timeout=1) as fresh:
            await fresh.get(f"{url}/health")
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        return True
    return False


async def wait_exit(process: object, timeout_s: float) -> float:
    started = time.monotonic()
    while process.poll() is None:  # type: ignore[attr-defined]
        assert time.monotonic() - started < timeout_s, "the router did not exit"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


@pytest.mark.timeout(60)
async def test_sigterm_lets_a_stream_in_flight_finish_and_accepts_nothing_new() -> None:
    with running_sim(*SLOW_SIM) as sim:
        router = start_router([sim.url], "least_loaded", "--gpu-interval", "0", "--shutdown-grace", "20")
        try:
            events: list[str] = []
            async with (
                httpx.AsyncClient(timeout=30) as client,
                client.stream("POST", f"{router.url}/v1/completions", json=STREAM) as response,
            ):
                lines = response.aiter_lines()
                while not events:
                    line = await anext(lines)
                    if line.startswith("data: "):
                        events.append(line)
                router.process.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                refused_after = None
                async for line in lines:
                    if line.startswith("data: "):
                        events.append(line)
                    if refused_after is None and await refuses_connections(router.url):
                        refused_after = time.monotonic() - signalled
            stream_done_after = time.monotonic() - signalled
            exited_after = await wait_exit(router.process, 15) + stream_done_after
        finally:
            stop_router(router)
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    assert len(events) >= 40  # every token arrived, then [DONE]
    assert refused_after is not None, "new connections were still accepted"
    # Refused while the stream still had most of its way to go: at the signal, not near the stream's end.
    assert refused_after < stream_done_after / 2, (refused_after, stream_done_after)
    assert stream_done_after > 1.0  # the stream really outlived the signal
    print(
        f"\nshutdown: new connections refused {refused_after * 1000:.0f} ms after SIGTERM; the stream finished "
        f"{stream_done_after:.1f} s after it ({len(events)} events); the router exited at {exited_after:.1f} s"
    )


@pytest.mark.timeout(60)
async def test_past_the_grace_period_streams_end_with_an_error_event_and_the_router_exits() -> None:
    with running_sim(*SLOW_SIM) as sim:
        router = start_router([sim.url], "least_loaded", "--gpu-interval", "0", "--shutdown-grace", "0.5")
        try:
            async with (
                httpx.AsyncClient(timeout=30) as client,
                client.stream("POST", f"{router.url}/v1/completions", json={**STREAM, "max_tokens": 400}) as response,
            ):
                lines = response.aiter_lines()
                await anext(lines)
                router.process.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                events = [line async for line in lines if line.startswith("data: ")]
            ended_after = time.monotonic() - signalled
            exited_after = await wait_exit(router.process, 10) + ended_after
        finally:
            stop_router(router)
    # Ended by the router before uvicorn's own cut: a proper end, not a broken chunked body.
    assert events[-1] == "data: [DONE]" and '"code":"router_shutdown"' in events[-2]
    # 0.5 s of grace, not the 20 s the stream would take (400 tokens at 50 ms): a quarter of that at most.
    whole_stream_s = 400 * 0.050
    assert ended_after < whole_stream_s / 4 and exited_after < whole_stream_s / 4, (ended_after, exited_after)
