"""Each router's batch runner: claims queued lines from the store while the fleet has room for them
(`room.py`), runs each through the router's own path (`line_call.py`), keeps each answer as it ends, and
ends batches: completed, cancelled, or expired past their window. A heartbeat keeps its claims; stopping,
it hands its unfinished lines back at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp

from dpserve.router.batch.line_call import LineAnswer, call_line
from dpserve.router.batch.store import Answer, BatchDb, Claimed, Counts, wall_seconds

log = logging.getLogger("dpserve.router")

ROOM_RECHECK_S = 0.05
"""While lines wait for room, how often the runner looks again (room other requests leave as they end);
not a listener on the request path, which stays the same for a router with no batch at all."""
REFUSED_PAUSE_S = (0.2, 5.0)
"""After the router refused a line for now (its queue full, a quota spent): the pause before claiming
more, at least and at most (a Retry-After in between is followed)."""


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


@dataclass
class BatchProgress:
    """What this router's runner has done, for /status and metrics."""

    lines_done: int = 0
    lines_failed: int = 0
    lines_requeued: int = 0
    """Lines the router refused for now, queued again."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    counts: dict[str, Counts] = field(default_factory=dict)
    """The active batches' lines by state, every router's, as of the last look."""


class BatchRunner:
    def __init__(
        self,
        db: BatchDb,
        app: Callable[[], ASGIApp],
        room: Callable[[int], int],
        router_id: str,
        lease_s: float,
        poll_interval_s: float,
    ) -> None:
        """`app`: the hot path now; `room(running)`: lines that may start beside the running ones."""
        self.db = db
        self._app = app
        self._room = room
        self.router_id = router_id
        self.lease_s = lease_s
        self.poll_interval_s = poll_interval_s
        self.progress = BatchProgress()
        self._running: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._claimable: list[str] = []
        """Batches in progress, as of the last look."""
        self._stale = True
        """Look at the store before claiming: a batch was created or cancelled, or may have ended."""
        self._starved = False
        """The last claim found fewer lines than it asked for: no more until the next look."""
        self._next_refresh = 0.0
        self._draining = False
        self._paused_until = 0.0
        self._task: asyncio.Task[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None

    @property
    def running(self) -> int:
        return len(self._running)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="dpserve-batch-runner")
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat(), name="dpserve-batch-heartbeat")

    def notify(self) -> None:
        """A batch was created or cancelled here: look at the store now."""
        self._stale = True
        self._wake.set()

    def drain(self) -> None:
        """The router is stopping: no more lines claimed (those running may end within the grace)."""
        self._draining = True

    async def stop(self) -> None:
        # Read first: a cancelled line's task takes itself out of `_running` as it ends.
        running = list(self._running)
        for task in (self._task, self._heartbeat, *self._running.values()):
            if task is not None:
                task.cancel()
        for task in (self._task, self._heartbeat, *self._running.values()):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        # Handed back now, not when the lease lapses: a peer (or this router restarted) takes them at once.
        self._running.clear()
        with contextlib.suppress(Exception):
            await self.db.call(self.db.store.leave, self.router_id, running)

    async def _beat(self) -> None:
        while True:
            now = time.time()
            try:
                requeued = await self.db.call(self.db.store.heartbeat, self.router_id, now + self.lease_s, now)
            except Exception:
                log.exception("batch store: heartbeat failed")
            else:
                if requeued:
                    log.info("batch store: %d lines of routers gone silent queued again", requeued)
                    self._wake.set()
            await asyncio.sleep(self.lease_s / 4)

    async def _loop(self) -> None:
        # Known to the store before the first claim: a claim is held only by a router with a heartbeat.
        while True:
            try:
                await self.db.call(self.db.store.heartbeat, self.router_id, time.time() + self.lease_s, time.time())
                break
            except Exception:
                log.exception("batch store: cannot reach it; trying again in %g s", self.poll_interval_s)
                await asyncio.sleep(self.poll_interval_s)
        while True:
            try:
                await self._tick()
            except Exception:
                log.exception("batch runner: a look at the store failed")
                self._stale = True
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._next_look_s())

    def _next_look_s(self) -> float:
        wait = self._next_refresh - time.monotonic()
        if self._claimable and not self._starved and not self._draining:
            wait = min(wait, ROOM_RECHECK_S)
        pause = self._paused_until - time.monotonic()
        if pause > 0:
            wait = min(wait, pause)
        return max(0.01, wait)

    async def _tick(self) -> None:
        if self._stale or time.monotonic() >= self._next_refresh:
            await self._refresh()
        if time.monotonic() < self._paused_until or not self._claimable or self._starved or self._draining:
            return
        room = self._room(len(self._running))
        if room <= 0:
            return
        claimed = await self.db.call(self.db.store.claim, self.router_id, self._claimable, room)
        self._starved = len(claimed) < room  # none left queued (or all claimed): looked for again at the next refresh
        for line in claimed:
            key = (line.batch_id, line.line)
            self._running[key] = asyncio.get_running_loop().create_task(self._run(line), name="dpserve-batch-line")

    async def _refresh(self) -> None:
        """The active batches and their counts; those done, past their window or cancelled are ended."""
        store = self.db.store
        self._stale, self._starved = False, False
        self._next_refresh = time.monotonic() + self.poll_interval_s
        active = await self.db.call(store.active)
        self.progress.counts = await self.db.call(store.counts, [batch["id"] for batch in active])
        now = wall_seconds()
        for batch in active:
            expired = batch["expires_at"] <= now
            counts = self.progress.counts.get(batch["id"], Counts())
            if expired or counts.queued + counts.running == 0 or batch["status"] == "cancelling":
                await self._finalize(batch["id"], expired)
        self._claimable = [b["id"] for b in active if b["status"] == "in_progress" and b["expires_at"] > now]

    async def _finalize(self, batch_id: str, expired: bool) -> None:
        ended = await self.db.call(self.db.store.finalize, batch_id, wall_seconds(), new_id, expired)
        if ended:
            log.info("batch %s ended", batch_id)

    async def _run(self, line: Claimed) -> None:
        key = (line.batch_id, line.line)
        try:
            answer = await call_line(self._app(), line, new_id("batch_req_"))
            if answer.replica is None and answer.status in (429, 503):
                # The router's own refusal for now (its queue full, a quota spent, no replica up): the
                # line goes back to the queue, and the runner pauses.
                self.progress.lines_requeued += 1
                pause = answer.retry_after_s if answer.retry_after_s is not None else REFUSED_PAUSE_S[0]
                self._paused_until = time.monotonic() + min(max(pause, REFUSED_PAUSE_S[0]), REFUSED_PAUSE_S[1])
                await self.db.call(self.db.store.release, self.router_id, line.batch_id, line.line)
                return
            kept = _answer(answer)
            if await self.db.call(self.db.store.finish, self.router_id, line.batch_id, line.line, kept):
                progress = self.progress
                progress.lines_done += 1
                progress.lines_failed += 0 if kept.ok else 1
                progress.prompt_tokens += kept.prompt_tokens
                progress.completion_tokens += kept.completion_tokens
        except asyncio.CancelledError:
            raise
        except Exception:
            # The store or the router failed, not the line: it runs again (here, or elsewhere once the
            # claim lapses if the store cannot be told now).
            log.exception("batch line %s#%d failed in the router", line.batch_id, line.line)
            with contextlib.suppress(Exception):
                await self.db.call(self.db.store.release, self.router_id, line.batch_id, line.line)
        finally:
            if self._running.get(key) is asyncio.current_task():
                del self._running[key]
            if self._starved:  # the batch's last lines: it may be done
                self._stale = True
            self._wake.set()


def _answer(answer: LineAnswer) -> Answer:
    """The line's entry as OpenAI's output and error files hold it, and its tokens."""
    try:
        body: Any = orjson.loads(answer.body) if answer.body else None
    except orjson.JSONDecodeError:
        body = answer.body.decode("utf-8", "replace")
    response = {"status_code": answer.status, "request_id": answer.request_id, "body": body}
    usage = body.get("usage") if isinstance(body, dict) else None
    prompt = completion = cached = 0
    if isinstance(usage, dict):
        prompt = _int(usage.get("prompt_tokens", usage.get("input_tokens")))
        completion = _int(usage.get("completion_tokens", usage.get("output_tokens")))
        details = usage.get("prompt_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
    ok = 200 <= answer.status < 300
    return Answer(ok, {"response": response, "error": None}, prompt, completion, cached)


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def progress_status(runner: BatchRunner) -> dict[str, Any]:
    """/status's `batches`: every router's active batches (as of the runner's last look), this router's work."""
    progress = runner.progress
    return {
        "active": {
            batch_id: {
                "total": counts.total,
                "queued": counts.queued,
                "running": counts.running,
                "completed": counts.completed,
                "failed": counts.failed,
            }
            for batch_id, counts in progress.counts.items()
        },
        "this_router": {
            "running": runner.running,
            "lines_done": progress.lines_done,
            "lines_failed": progress.lines_failed,
            "lines_requeued": progress.lines_requeued,
            "prompt_tokens": progress.prompt_tokens,
            "completion_tokens": progress.completion_tokens,
        },
    }


class BatchCollector(Collector):
    """dpserve_batch_* series, read at scrape time."""

    def __init__(self, runner: BatchRunner) -> None:
        self._runner = runner

    def collect(self) -> Iterator[Metric]:
        runner, progress = self._runner, self._runner.progress
        lines = GaugeMetricFamily(
            "dpserve_batch_lines",
            "Lines of the active batches (every router's) by state: queued, running, completed, failed.",
            labels=["state"],
        )
        for state in ("queued", "running", "completed", "failed"):
            lines.add_metric([state], sum(getattr(counts, state) for counts in progress.counts.values()))
        yield lines
        yield GaugeMetricFamily(
            "dpserve_batch_active", "Batches in progress or cancelling.", value=len(progress.counts)
        )
        yield GaugeMetricFamily("dpserve_batch_running", "Batch lines this router runs now.", value=runner.running)
        ended = CounterMetricFamily(
            "dpserve_batch_lines_ended", "Batch lines this router ran to their end, by outcome.", labels=["outcome"]
        )
        ended.add_metric(["completed"], progress.lines_done - progress.lines_failed)
        ended.add_metric(["failed"], progress.lines_failed)
        ended.add_metric(["requeued"], progress.lines_requeued)
        yield ended
        tokens = CounterMetricFamily(
            "dpserve_batch_tokens", "Tokens of the batch lines this router ran.", labels=["kind"]
        )
        tokens.add_metric(["prompt"], progress.prompt_tokens)
        tokens.add_metric(["completion"], progress.completion_tokens)
        yield tokens
