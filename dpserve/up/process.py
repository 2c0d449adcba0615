"""One supervised child process: started in its own process group, restarted with backoff when it dies."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0  # a child that ran this long restarts with the shortest backoff again


def next_backoff(previous: float | None, ran_for_s: float) -> float:
    if previous is None or ran_for_s >= STABLE_AFTER_S:
        return BACKOFF_START_S
    return min(BACKOFF_MAX_S, previous * 2)


class ManagedProcess:
    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path | None,
        cpus: Sequence[int] | None = None,
    ) -> None:
        self.name = name
        self.argv = tuple(argv)
        self.env = {**os.environ, **env}
        self.log_path = log_path
        self.cpus = tuple(cpus) if cpus else None
        self.process: asyncio.subprocess.Process | None = None
        self.started_at = 0.0
        self.restarts = 0
        self.state = "stopped"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    async def start(self) -> None:
        # Opening a local log file is instant; the child inherits the descriptor.
        log = open(self.log_path, "ab") if self.log_path else None  # noqa: ASYNC230
        cpus = self.cpus
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv,
                env=self.env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT if log else None,
                # Its own group, so stopping it also stops whatever it spawned (vLLM's engine core).
                start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )
        finally:
            if log:
                log.close()
        self.started_at = time.monotonic()
        self.state = "starting"

    def kill_group(self, sig: int) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    async def stop(self, grace_s: float) -> None:
        """SIGTERM to the whole group, SIGKILL after `grace_s`."""
        self.state = "stopping"
        if self.process is None:
            return
        self.kill_group(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.process.wait(), grace_s)
        except TimeoutError:
            pass
        # Children of the group may outlive the leader (an orphaned engine core): no survivors.
        self.kill_group(signal.SIGKILL)
        await self.process.wait()
        self.state = "stopped"

    async def supervise(
        self,
        stopping: asyncio.Event,
        on_restart: Callable[[ManagedProcess, int | None, float], None],
        after_start: Callable[[ManagedProcess], Awaitable[None]] | None = None,
    ) -> None:
        """Restart the process whenever it exits, until `stopping` is set."""
        backoff: float | None = None
        while not stopping.is_set():
            assert self.process is not None
            exit_code = await self.process.wait()
            if stopping.is_set():
                return
            self.kill_group(signal.SIGKILL)
            ran_for = time.monotonic() - self.started_at
            backoff = next_backoff(backoff, ran_for)
            self.state = "restarting"
            on_restart(self, exit_code, backoff)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), backoff)
            if stopping.is_set():
                return
            self.restarts += 1
            await self.start()
            if after_start is not None:
                await after_start(self)


def terminate(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited after `grace_s` (a child this process started)."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def log_tail(path: Path | None, lines: int = 30) -> str:
    if path is None or not path.exists():
        return ""
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        handle.seek(max(0, handle.tell() - 16384))
        text = handle.read().decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])
