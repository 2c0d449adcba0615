from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import psutil

from dpserve.up.process import BACKOFF_MAX_S, ManagedProcess, next_backoff

# A parent that spawns a child and sleeps: stands in for vLLM's API server and its engine core.
PARENT_WITH_CHILD = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
)


def assert_dies(process: psutil.Process) -> None:
    """A killed process still needs CPU time to exit: on a loaded machine, give it a few seconds."""
    _gone, alive = psutil.wait_procs([process], timeout=5)
    assert not alive or alive[0].status() == psutil.STATUS_ZOMBIE, f"pid {process.pid} survived"


async def _first_child(parent: psutil.Process) -> psutil.Process:
    for _ in range(100):
        if parent.children():
            return parent.children()[0]
        await asyncio.sleep(0.1)
    raise AssertionError("the child never started")


def test_backoff_doubles_up_to_a_cap_and_resets_after_a_stable_run() -> None:
    backoff = None
    seen = []
    for _ in range(8):
        backoff = next_backoff(backoff, ran_for_s=2)
        seen.append(backoff)
    assert seen[:4] == [1, 2, 4, 8] and seen[-1] == BACKOFF_MAX_S
    assert next_backoff(BACKOFF_MAX_S, ran_for_s=3600) == 1


async def test_stop_kills_the_whole_process_group(tmp_path: Path) -> None:
    proc = ManagedProcess("p", [sys.executable, "-c", PARENT_WITH_CHILD], {}, tmp_path / "p.log")
    await proc.start()
    assert proc.pid is not None
    parent = psutil.Process(proc.pid)
    child = await _first_child(parent)
    await proc.stop(grace_s=5)
    assert_dies(child)
    assert proc.state == "stopped"


async def test_supervise_restarts_a_killed_process_and_cleans_its_orphans(tmp_path: Path) -> None:
    proc = ManagedProcess("p", [sys.executable, "-c", PARENT_WITH_CHILD], {}, tmp_path / "p.log")
    await proc.start()
    stopping = asyncio.Event()
    exits: list[int | None] = []
    supervisor = asyncio.create_task(proc.supervise(stopping, lambda p, code, backoff: exits.append(code)))
    assert proc.pid is not None
    parent = psutil.Process(proc.pid)
    orphan = await _first_child(parent)
    parent.kill()  # the leader dies, its child would linger without the group kill
    for _ in range(100):
        if proc.restarts:
            break
        await asyncio.sleep(0.1)
    assert proc.restarts == 1 and exits == [-9]
    assert proc.pid != parent.pid
    assert_dies(orphan)
    stopping.set()
    await proc.stop(grace_s=5)
    await asyncio.wait_for(supervisor, 5)
