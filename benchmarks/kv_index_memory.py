"""What one block entry of the router's KV index costs in memory: `python -m benchmarks.kv_index_memory`.

Fills a `KvIndex` the way vLLM's events do (chains of `BlockStored`, 16-token blocks, 64-bit engine hashes)
with `--entries` entries spread over `--replicas` replicas, each chain shared by `--copies` of them, and
measures the Python heap it holds with tracemalloc (everything allocated and still alive, less the events
themselves, which are dropped after each store). Prints bytes per entry, measured and as the router's own
`dpserve_kv_index_bytes` estimates it (`KvIndex.approx_bytes`), and what the default bound
(`--kv-index-max-entries`) costs when full. Exits 1 when a figure is nonsense (0 or no entries)."""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tracemalloc
from collections.abc import Sequence

from dpserve.config import RouterSettings
from dpserve.kvindex.events import BlockStored
from dpserve.kvindex.index import KvIndex

BLOCK_SIZE = 16
CHAIN_BLOCKS = 64
"""Blocks per prompt: a 1024-token prompt."""


def fill(index: KvIndex, entries: int, replicas: int, copies: int, seed: int) -> None:
    """Chains of CHAIN_BLOCKS blocks, each stored on `copies` of the replicas (their own engine hashes, as two
    engines hash the same tokens alike only by chance of seeds), until the index holds `entries`."""
    rng = random.Random(seed)
    names = [f"r{i}" for i in range(replicas)]
    while index.entries < entries:
        tokens = tuple(rng.randrange(32_000) for _ in range(BLOCK_SIZE * CHAIN_BLOCKS))
        for replica in rng.sample(names, copies):
            hashes = tuple(rng.getrandbits(64) for _ in range(CHAIN_BLOCKS))
            index.store(replica, BlockStored(hashes, None, tokens, BLOCK_SIZE))


def measure(entries: int, replicas: int, copies: int, seed: int) -> tuple[int, float, float]:
    """(entries held, measured bytes per entry, estimated bytes per entry)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = KvIndex(max_entries=entries * 2)
    fill(index, entries, replicas, copies, seed)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return index.entries, held / index.entries, index.approx_bytes() / index.entries


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=200_000)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--copies", default="1,2", help="replicas holding each prompt, comma-separated cases")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    bound = RouterSettings().kv_index_max_entries
    print(f"KvIndex memory, {args.entries} entries over {args.replicas} replicas, Python {sys.version.split()[0]}")
    print("| replicas per prompt | entries | measured bytes/entry | estimated bytes/entry | default bound full |")
    print("|---:|---:|---:|---:|---:|")
    sane = True
    for copies in (int(c) for c in args.copies.split(",")):
        held, measured, estimated = measure(args.entries, args.replicas, copies, args.seed)
        full_gib = measured * bound / 2**30
        print(f"| {copies} | {held} | {measured:.0f} | {estimated:.0f} | {full_gib:.2f} GiB ({bound} entries) |")
        sane = sane and held >= args.entries and measured > 0 and estimated > 0
    return 0 if sane else 1


if __name__ == "__main__":
    raise SystemExit(main())
