"""Which GPU each replica runs on: from a hint (`--replica URL@gpu=N`, or what the launcher set in
CUDA_VISIBLE_DEVICES), else from the processes NVML sees on each GPU. Pure: no NVML, no sockets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dpserve.gpu.sample import GpuSample

GPU_HINT = "@gpu="


@dataclass(frozen=True)
class ReplicaClue:
    id: str
    hint: tuple[str, ...] = ()
    """GPU indices or UUIDs the replica was said to run on ("0", "GPU-3f2a..."); empty: not said."""
    pids: frozenset[int] = frozenset()
    """The replica's processes (its server and their children), when it runs on this host."""
    share: tuple[int, int] = (0, 1)
    """(rank, engines): one engine of a data-parallel server whose processes are `pids`: it holds the
    rank-th of the equal shares of the GPUs those processes use, in index order (vLLM's order)."""


def parse_replica_spec(text: str) -> tuple[str, tuple[str, ...]]:
    """`URL` or `URL@gpu=N[,M]` (N an index or a GPU UUID) -> (URL without a trailing slash, hint)."""
    url, marker, gpus = text.partition(GPU_HINT)
    hint: tuple[str, ...] = ()
    if marker:
        hint = tuple(part.strip() for part in gpus.split(",") if part.strip())
        if not hint:
            raise ValueError(f"--replica {text}: `{GPU_HINT}` needs a GPU index or UUID after it")
    return url.rstrip("/"), hint


def place_replicas(clues: Sequence[ReplicaClue], gpus: Sequence[GpuSample]) -> dict[str, tuple[int, ...]]:
    """Replica id -> indices of its GPUs. A hint wins over process matching; unknown replicas are left out."""
    placed: dict[str, tuple[int, ...]] = {}
    for clue in clues:
        if clue.hint:
            wanted = set(clue.hint)
            indices = tuple(g.index for g in gpus if str(g.index) in wanted or (g.uuid and g.uuid in wanted))
        else:
            indices = tuple(g.index for g in gpus if any(p.pid in clue.pids for p in g.processes))
            rank, engines = clue.share
            size = len(indices) // engines
            indices = indices[rank * size : (rank + 1) * size] if engines > 1 else indices
        if indices:
            placed[clue.id] = indices
    return placed
