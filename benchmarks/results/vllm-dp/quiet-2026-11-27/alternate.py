"""The 2026-11-27 checks behind docs/benchmarks/vllm-dp.md's "again, on a quiet machine": streamed chats (300
random words, 16 tokens, 4 in flight, 80 per run) against several URLs in ABBA order, req/s and TTFT p50.

    python alternate.py URL [URL ...]           # e.g. the DP server, a router given URL@dp=2, one without @dp
    python alternate.py --pin URL               # the DP server, unpinned then pinned (X-data-parallel-rank)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import time

import aiohttp

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


async def one(session: aiohttp.ClientSession, url: str, prompt: str, rank: int | None) -> float:
    body = {"model": "dpserve-tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 16}
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    started, first = time.monotonic(), 0.0
    async with session.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not first and line.startswith(b"data: {"):
                first = time.monotonic() - started
    return first


async def run(url: str, pin: bool, seed: int, count: int = 80, concurrency: int = 4) -> tuple[float, float]:
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(300)) for _ in range(count)]
    turn = itertools.count()
    ttfts: list[float] = []
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            while prompts:
                prompt = prompts.pop()
                ttfts.append(await one(session, url, prompt, next(turn) % 2 if pin else None))

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.monotonic() - started
    return count / seconds, sorted(ttfts)[len(ttfts) // 2] * 1000


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pin", action="store_true")
    parser.add_argument("urls", nargs="+")
    args = parser.parse_args()
    cases = [(args.urls[0], False), (args.urls[0], True)] if args.pin else [(url, False) for url in args.urls]
    for round_ in range(2 if not args.pin else 3):
        order = cases if round_ % 2 == 0 else cases[::-1]
        for index, (url, pin) in enumerate(order):
            rps, p50 = await run(url, pin, seed=round_ * 10 + index)
            print(f"round {round_} {url}{' pinned' if pin else ''}: {rps:.1f} req/s, TTFT p50 {p50:.0f} ms", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
