"""The end of a background task (probes, KV-event subscribers, GPU sampling, discovery): each is started
with its app and stopped with it."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    """Cancels `task` (none: nothing to do) and returns once it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
