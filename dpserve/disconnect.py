"""Noticing that an HTTP client went away while its request is still being worked on (ASGI)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


async def until_disconnect(receive: Receive, work: Awaitable[T], discard: Callable[[T], None] | None = None) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled (a result it
    still produced goes to `discard`) and ClientGone is raised. Call after the body has been read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        late = await task
        if discard is not None:
            discard(late)
    raise ClientGone


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
