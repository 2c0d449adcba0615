"""Files, batches and their lines, in SQLite (one router, or the workers of one) or PostgreSQL (a tier of
routers sharing one batch queue): the same SQL on both, through their DB-API drivers.

A line is queued, claimed by one router, then done, its answer kept. A claim holds while its router's
heartbeat does (`routers.alive_until`); a router that dies (kill -9) leaves claims that lapse, and its
unfinished lines are queued again. A line's answer is written only by the router that holds its claim, and
only once: a finished line never runs again, and each appears in the output once. Calls are blocking: the
async side (`BatchDb`) runs them on one thread of its own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import orjson

from dpserve.router.batch.lines import Refused, Request

QUEUED, CLAIMED, DONE = 0, 1, 2
ACTIVE = ("in_progress", "cancelling")
FINAL = ("completed", "failed", "expired", "cancelled")
BATCH_COLUMNS = (
    "id", "tenant", "endpoint", "input_file_id", "completion_window", "status", "created_at", "expires_at",
    "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
    "cancelled_at", "output_file_id", "error_file_id", "metadata", "errors", "total",
)  # fmt: skip
FILE_COLUMNS = ("id", "tenant", "purpose", "filename", "bytes", "created_at")
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, "
    "filename TEXT NOT NULL, bytes BIGINT NOT NULL, created_at BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS file_lines (file_id TEXT NOT NULL, line_no INTEGER NOT NULL, text TEXT NOT NULL, "
    "PRIMARY KEY (file_id, line_no))",
    "CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, endpoint TEXT NOT NULL, "
    "input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL, "
    "created_at BIGINT NOT NULL, expires_at BIGINT NOT NULL, in_progress_at BIGINT, finalizing_at BIGINT, "
    "completed_at BIGINT, failed_at BIGINT, expired_at BIGINT, cancelling_at BIGINT, cancelled_at BIGINT, "
    "output_file_id TEXT, error_file_id TEXT, metadata TEXT, errors TEXT, total INTEGER NOT NULL)",
    "CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status, created_at)",
    "CREATE TABLE IF NOT EXISTS lines (batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT NOT NULL, "
    "url TEXT NOT NULL, body TEXT NOT NULL, grp TEXT NOT NULL, state INTEGER NOT NULL, claimed_by TEXT, "
    "ok INTEGER, result TEXT, prompt_tokens INTEGER NOT NULL DEFAULT 0, "
    "completion_tokens INTEGER NOT NULL DEFAULT 0, cached_tokens INTEGER NOT NULL DEFAULT 0, "
    "PRIMARY KEY (batch_id, line_no))",
    "CREATE INDEX IF NOT EXISTS lines_queued ON lines (batch_id, state, grp, line_no)",
    "CREATE TABLE IF NOT EXISTS routers (id TEXT PRIMARY KEY, alive_until DOUBLE PRECISION NOT NULL)",
)

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class Claimed:
    """A line this router now runs."""

    batch_id: str
    line: int
    custom_id: str
    url: str
    body: bytes
    tenant: str


@dataclass(frozen=True)
class Answer:
    """How a line ended: the replica's answer (`response`) or the router's reason (`error`)."""

    ok: bool
    result: dict[str, Any]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class Counts:
    total: int = 0
    queued: int = 0
    running: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class BatchStore:
    """The blocking store; `url` a SQLite file's path or `postgresql://...`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.shared = url.startswith(("postgresql://", "postgres://"))
        self._connect()
        with self._transaction() as cursor:
            for statement in SCHEMA:
                cursor.execute(statement)

    def _connect(self) -> None:
        if self.shared:
            try:
                import psycopg
            except ImportError:
                raise ValueError(
                    "--batch-store postgresql://...: the PostgreSQL driver is missing "
                    "(pip install 'dpserve[postgresql]')"
                ) from None
            try:
                self._pg = psycopg.connect(self.url, autocommit=True)
            except psycopg.Error as exc:
                raise ValueError(f"--batch-store: cannot connect to PostgreSQL: {exc}") from None
        else:
            path = Path(self.url)
            path.parent.mkdir(parents=True, exist_ok=True)
            # Autocommit, with explicit transactions; WAL so readers never wait for the one writer.
            self._sqlite = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self._sqlite.execute("PRAGMA journal_mode=WAL")
            self._sqlite.execute("PRAGMA busy_timeout=10000")
            self._sqlite.execute("PRAGMA synchronous=NORMAL")

    def close(self) -> None:
        if self.shared:
            self._pg.close()
        else:
            self._sqlite.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[Any]:
        """A cursor in one transaction; SQLite's takes the write lock at once, so two claims never interleave."""
        if self.shared:
            with self._pg.transaction(), self._pg.cursor() as cursor:
                yield _Cursor(cursor, "%s")
            return
        plain = self._sqlite.cursor()
        plain.execute("BEGIN IMMEDIATE")
        try:
            yield _Cursor(plain, "?")
        except BaseException:
            plain.execute("ROLLBACK")
            raise
        plain.execute("COMMIT")

    # Files.

    def add_file(self, record: dict[str, Any], lines: Sequence[str]) -> None:
        with self._transaction() as cursor:
            cursor.execute(_insert("files", FILE_COLUMNS), [record[name] for name in FILE_COLUMNS])
            cursor.executemany(
                "INSERT INTO file_lines (file_id, line_no, text) VALUES (?, ?, ?)",
                [(record["id"], number, text) for number, text in enumerate(lines, start=1)],
            )

    def file(self, file_id: str, tenant: str | None) -> dict[str, Any] | None:
        with self._transaction() as cursor:
            cursor.execute(f"SELECT {', '.join(FILE_COLUMNS)} FROM files WHERE id = ?", [file_id])
            row = cursor.fetchone()
        record = dict(zip(FILE_COLUMNS, row, strict=True)) if row is not None else None
        return record if record is not None and (tenant is None or record["tenant"] == tenant) else None

    def files(
        self, tenant: str, purpose: str | None, after: str | None, limit: int, newest_first: bool
    ) -> list[dict[str, Any]]:
        """A tenant's files in order of creation (ties by id), after the one named, `limit` of them."""
        order = "DESC" if newest_first else "ASC"
        where, args = ["tenant = ?"], [tenant]
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        with self._transaction() as cursor:
            if after is not None:
                cursor.execute("SELECT created_at FROM files WHERE id = ?", [after])
                row = cursor.fetchone()
                if row is not None:
                    op = "<" if newest_first else ">"
                    where.append(f"(created_at {op} ? OR (created_at = ? AND id {op} ?))")
                    args += [row[0], row[0], after]
            cursor.execute(
                f"SELECT {', '.join(FILE_COLUMNS)} FROM files WHERE {' AND '.join(where)} "
                f"ORDER BY created_at {order}, id {order} LIMIT ?",
                [*args, limit],
            )
            rows = cursor.fetchall()
        return [dict(zip(FILE_COLUMNS, row, strict=True)) for row in rows]

    def file_lines(self, file_id: str) -> list[str]:
        with self._transaction() as cursor:
            cursor.execute("SELECT text FROM file_lines WHERE file_id = ? ORDER BY line_no", [file_id])
            return [row[0] for row in cursor.fetchall()]

    def delete_file(self, file_id: str, tenant: str) -> bool:
        with self._transaction() as cursor:
            cursor.execute("DELETE FROM files WHERE id = ? AND tenant = ?", [file_id, tenant])
            if cursor.rowcount == 0:
                return False
            cursor.execute("DELETE FROM file_lines WHERE file_id = ?", [file_id])
            return True

    # Batches.

    def add_batch(self, record: dict[str, Any], checked: Sequence[Request | Refused]) -> None:
        """The batch, in progress, and its lines: those that can run queued, the others done as failed."""
        rows: list[tuple[Any, ...]] = []
        for item in checked:
            if isinstance(item, Request):
                rows.append(
                    (
                        record["id"],
                        item.line,
                        item.custom_id,
                        item.url,
                        item.body.decode(),
                        item.group,
                        QUEUED,
                        None,
                        None,
                    )
                )
            else:
                error = {"code": item.code, "message": item.message, "line": item.line}
                result = orjson.dumps({"error": error}).decode()
                rows.append((record["id"], item.line, item.custom_id, "", "", "", DONE, 0, result))
        with self._transaction() as cursor:
            cursor.execute(_insert("batches", BATCH_COLUMNS), [_column(record, name) for name in BATCH_COLUMNS])
            cursor.executemany(
                "INSERT INTO lines (batch_id, line_no, custom_id, url, body, grp, state, ok, result) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )

    def batch(self, batch_id: str, tenant: str | None) -> dict[str, Any] | None:
        with self._transaction() as cursor:
            cursor.execute(f"SELECT {', '.join(BATCH_COLUMNS)} FROM batches WHERE id = ?", [batch_id])
            row = cursor.fetchone()
        record = _batch_record(row) if row is not None else None
        return record if record is not None and (tenant is None or record["tenant"] == tenant) else None

    def batches(self, tenant: str | None, after: str | None, limit: int) -> list[dict[str, Any]]:
        """Newest first, as OpenAI lists them; all tenants' for None."""
        where: list[str] = []
        args: list[Any] = []
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        with self._transaction() as cursor:
            if after is not None:
                cursor.execute("SELECT created_at FROM batches WHERE id = ?", [after])
                row = cursor.fetchone()
                if row is not None:
                    where.append("(created_at < ? OR (created_at = ? AND id < ?))")
                    args += [row[0], row[0], after]
            clause = f"WHERE {' AND '.join(where)} " if where else ""
            cursor.execute(
                f"SELECT {', '.join(BATCH_COLUMNS)} FROM batches {clause}ORDER BY created_at DESC, id DESC LIMIT ?",
                [*args, limit],
            )
            rows = cursor.fetchall()
        return [_batch_record(row) for row in rows]

    def cancel(self, batch_id: str, tenant: str, now: int) -> dict[str, Any] | None:
        """`cancelling` while lines still run (the runner ends it), None for a batch that is not the tenant's."""
        with self._transaction() as cursor:
            cursor.execute(
                "UPDATE batches SET status = 'cancelling', cancelling_at = ? "
                "WHERE id = ? AND tenant = ? AND status IN ('validating', 'in_progress')",
                [now, batch_id, tenant],
            )
        return self.batch(batch_id, tenant)

    def counts(self, batch_ids: Sequence[str]) -> dict[str, Counts]:
        if not batch_ids:
            return {}
        marks = ", ".join("?" for _ in batch_ids)
        with self._transaction() as cursor:
            cursor.execute(
                "SELECT batch_id, state, ok, count(*), sum(prompt_tokens), sum(completion_tokens), sum(cached_tokens) "
                f"FROM lines WHERE batch_id IN ({marks}) GROUP BY batch_id, state, ok",
                list(batch_ids),
            )
            rows = cursor.fetchall()
        found: dict[str, dict[str, int]] = {batch_id: {} for batch_id in batch_ids}
        for batch_id, state, ok, count, prompt, completion, cached in rows:
            tally = found[batch_id]
            key = "queued" if state == QUEUED else "running" if state == CLAIMED else "completed" if ok else "failed"
            for name, value in (("total", count), (key, count)):
                tally[name] = tally.get(name, 0) + int(value)
            for name, value in (
                ("prompt_tokens", prompt),
                ("completion_tokens", completion),
                ("cached_tokens", cached),
            ):
                tally[name] = tally.get(name, 0) + int(value or 0)
        return {batch_id: Counts(**tally) for batch_id, tally in found.items()}

    def active(self) -> list[dict[str, Any]]:
        """Batches in progress or being cancelled, every tenant's."""
        with self._transaction() as cursor:
            cursor.execute(
                f"SELECT {', '.join(BATCH_COLUMNS)} FROM batches WHERE status IN ('in_progress', 'cancelling') "
                "ORDER BY created_at"
            )
            return [_batch_record(row) for row in cursor.fetchall()]

    # Running lines.

    def heartbeat(self, router: str, alive_until: float, now: float) -> int:
        """This router lives on; lines claimed by routers whose heartbeat lapsed are queued again (how many)."""
        with self._transaction() as cursor:
            cursor.execute(
                "INSERT INTO routers (id, alive_until) VALUES (?, ?) "
                "ON CONFLICT (id) DO UPDATE SET alive_until = excluded.alive_until",
                [router, alive_until],
            )
            cursor.execute(
                "UPDATE lines SET state = ?, claimed_by = NULL WHERE state = ? AND claimed_by IN "
                "(SELECT id FROM routers WHERE alive_until < ?)",
                [QUEUED, CLAIMED, now],
            )
            requeued = max(0, int(cursor.rowcount))
            cursor.execute("DELETE FROM routers WHERE alive_until < ?", [now])
            return requeued

    def leave(self, router: str, running: Sequence[tuple[str, int]]) -> None:
        """A router that stops: its unfinished lines queued again at once, its heartbeat gone."""
        with self._transaction() as cursor:
            cursor.executemany(
                "UPDATE lines SET state = ?, claimed_by = NULL WHERE batch_id = ? AND line_no = ? AND claimed_by = ? "
                "AND state = ?",
                [(QUEUED, batch_id, line, router, CLAIMED) for batch_id, line in running],
            )
            cursor.execute("DELETE FROM routers WHERE id = ?", [router])

    def claim(self, router: str, batch_ids: Sequence[str], limit: int) -> list[Claimed]:
        """Up to `limit` queued lines of these batches (oldest batch first, a group's lines together), now
        this router's. PostgreSQL skips lines another router is claiming; SQLite claims one at a time."""
        if not batch_ids or limit <= 0:
            return []
        marks = ", ".join("?" for _ in batch_ids)
        lock = " FOR UPDATE OF lines SKIP LOCKED" if self.shared else ""
        with self._transaction() as cursor:
            cursor.execute(
                "SELECT lines.batch_id, line_no, custom_id, url, body, batches.tenant FROM lines "
                "JOIN batches ON batches.id = lines.batch_id "
                f"WHERE lines.batch_id IN ({marks}) AND state = ? AND batches.status = 'in_progress' "
                f"ORDER BY batches.created_at, lines.batch_id, grp, line_no LIMIT ?{lock}",
                [*batch_ids, QUEUED, limit],
            )
            rows = cursor.fetchall()
            cursor.executemany(
                "UPDATE lines SET state = ?, claimed_by = ? WHERE batch_id = ? AND line_no = ? AND state = ?",
                [(CLAIMED, router, row[0], row[1], QUEUED) for row in rows],
            )
        return [Claimed(row[0], row[1], row[2], row[3], row[4].encode(), row[5]) for row in rows]

    def release(self, router: str, batch_id: str, line: int) -> None:
        """A line this router could not start after all (the router refused it for now): queued again."""
        with self._transaction() as cursor:
            cursor.execute(
                "UPDATE lines SET state = ?, claimed_by = NULL WHERE batch_id = ? AND line_no = ? AND claimed_by = ? "
                "AND state = ?",
                [QUEUED, batch_id, line, router, CLAIMED],
            )

    def finish(self, router: str, batch_id: str, line: int, answer: Answer) -> bool:
        """The line's answer, kept if this router still holds its claim (False: it lapsed, and the line is
        another's now or was ended with its batch)."""
        with self._transaction() as cursor:
            cursor.execute(
                "UPDATE lines SET state = ?, claimed_by = NULL, ok = ?, result = ?, prompt_tokens = ?, "
                "completion_tokens = ?, cached_tokens = ? WHERE batch_id = ? AND line_no = ? AND claimed_by = ? "
                "AND state = ?",
                [
                    DONE, 1 if answer.ok else 0, orjson.dumps(answer.result).decode(), answer.prompt_tokens,
                    answer.completion_tokens, answer.cached_tokens, batch_id, line, router, CLAIMED,
                ],
            )  # fmt: skip
            return bool(cursor.rowcount == 1)

    def finalize(self, batch_id: str, now: int, new_id: Callable[[str], str], expired: bool) -> bool:
        """Ends an active batch whose lines are all done (or, cancelling, none running; or past its window:
        `expired`): lines not run are failed with the reason, and the output and error files written. False
        when it is not ready, or another router ended it first."""
        with self._transaction() as cursor:
            cursor.execute(
                "SELECT status, tenant FROM batches WHERE id = ? AND status IN ('in_progress', 'cancelling')",
                [batch_id],
            )
            row = cursor.fetchone()
            if row is None:
                return False
            status, tenant = row
            cursor.execute(
                "SELECT state, count(*) FROM lines WHERE batch_id = ? AND state < ? GROUP BY state", [batch_id, DONE]
            )
            left = dict(cursor.fetchall())
            if status == "in_progress" and left and not expired:
                return False
            if status == "cancelling" and left.get(CLAIMED) and not expired:
                return False  # answers still coming; those are kept
            final = "cancelled" if status == "cancelling" else "expired" if expired and left else "completed"
            code, message = _unrun_reason(final)
            cursor.execute(
                "UPDATE lines SET state = ?, claimed_by = NULL, ok = 0, result = ? WHERE batch_id = ? AND state < ?",
                [DONE, orjson.dumps({"error": {"code": code, "message": message}}).decode(), batch_id, DONE],
            )
            cursor.execute(
                "SELECT line_no, custom_id, ok, result FROM lines WHERE batch_id = ? ORDER BY line_no", [batch_id]
            )
            output, errors = _result_files(cursor.fetchall(), new_id)
            ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
            for column, lines in (("output_file_id", output), ("error_file_id", errors)):
                if not lines:
                    continue
                file_id = ids[column] = new_id("file-")
                size = sum(len(line.encode()) + 1 for line in lines)
                name = f"{batch_id}_{'output' if column == 'output_file_id' else 'error'}.jsonl"
                record = (file_id, tenant, "batch_output", name, size, now)
                cursor.execute(_insert("files", FILE_COLUMNS), list(record))
                cursor.executemany(
                    "INSERT INTO file_lines (file_id, line_no, text) VALUES (?, ?, ?)",
                    [(file_id, number, text) for number, text in enumerate(lines, start=1)],
                )
            cursor.execute(
                f"UPDATE batches SET status = ?, finalizing_at = ?, {final}_at = ?, output_file_id = ?, "
                "error_file_id = ? WHERE id = ?",
                [final, now, now, ids["output_file_id"], ids["error_file_id"], batch_id],
            )
            return True


def _unrun_reason(final: str) -> tuple[str, str]:
    if final == "cancelled":
        return "batch_cancelled", "The batch was cancelled before this request ran."
    return "batch_expired", "This request could not be executed before the completion window expired."


def _result_files(rows: Sequence[tuple[Any, ...]], new_id: Callable[[str], str]) -> tuple[list[str], list[str]]:
    """The output file's lines (2xx answers) and the error file's (every other answer, and lines that did not
    run), in the input's order."""
    output: list[str] = []
    errors: list[str] = []
    for _line, custom_id, ok, result in rows:
        kept = orjson.loads(result)
        entry = {
            "id": new_id("batch_req_"),
            "custom_id": custom_id,
            "response": kept.get("response"),
            "error": kept.get("error"),
        }
        (output if ok else errors).append(orjson.dumps(entry).decode())
    return output, errors


class _Cursor:
    """A DB-API cursor whose SQL is written with `?` whatever the driver's placeholder."""

    def __init__(self, cursor: Any, mark: str) -> None:
        self._cursor = cursor
        self._mark = mark

    def execute(self, sql: str, args: Sequence[Any] = ()) -> None:
        self._cursor.execute(sql if self._mark == "?" else sql.replace("?", self._mark), args)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        if rows:
            self._cursor.executemany(sql if self._mark == "?" else sql.replace("?", self._mark), rows)

    def fetchone(self) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self._cursor.fetchone()
        return row

    def fetchall(self) -> list[tuple[Any, ...]]:
        return list(self._cursor.fetchall())

    @property
    def rowcount(self) -> int:
        count: int = self._cursor.rowcount
        return count


def _insert(table: str, columns: Sequence[str]) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' for _ in columns)})"


def _column(record: dict[str, Any], name: str) -> Any:
    value = record.get(name)
    return orjson.dumps(value).decode() if name in ("metadata", "errors") and value is not None else value


def _batch_record(row: Sequence[Any]) -> dict[str, Any]:
    record = dict(zip(BATCH_COLUMNS, row, strict=True))
    for name in ("metadata", "errors"):
        if record[name] is not None:
            record[name] = orjson.loads(record[name])
    return record


class BatchDb:
    """The store, called from the loop: each call runs on the store's one thread, in order."""

    def __init__(self, store: BatchStore) -> None:
        self.store = store
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dpserve-batch-store")

    async def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, functools.partial(fn, *args, **kwargs))

    async def close(self) -> None:
        await self.call(self.store.close)
        self._thread.shutdown(wait=True)


def wall_seconds() -> int:
    return int(time.time())
