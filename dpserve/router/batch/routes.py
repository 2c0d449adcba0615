"""`/v1/files` and `/v1/batches` as OpenAI serves them: a tenant sees, reads and cancels only its own."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile

from dpserve.router.batch.lines import BATCH_ENDPOINTS, FileError, check_lines, read_file
from dpserve.router.batch.objects import batch_object, file_object, list_object
from dpserve.router.batch.runner import BatchRunner, new_id
from dpserve.router.batch.store import BatchDb, wall_seconds
from dpserve.router.flow.gate import Flow
from dpserve.router.flow.tenants import CALLER_SCOPE_KEY
from dpserve.router.http.errors import OpenAIError, bad_request

WINDOW = re.compile(r"^(\d{1,6})([smh])$")
MAX_WINDOW_S = 7 * 24 * 3600
LIST_LIMIT = (1, 100, 20)
"""A list's smallest, largest and default `limit`, as OpenAI's."""
UPLOAD_OVERHEAD_BYTES = 64 * 1024
"""Room in a multipart body for its boundaries and the other fields beside the file."""


def window_seconds(window: object) -> int:
    """`24h` (OpenAI's only window), or another as `N[smh]` up to a week; OpenAIError otherwise."""
    match = WINDOW.match(window) if isinstance(window, str) else None
    if match is None:
        raise bad_request("`completion_window` must be like 24h (or N followed by s, m or h).", "completion_window")
    seconds = int(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[match.group(2)]
    if not 0 < seconds <= MAX_WINDOW_S:
        raise bad_request("`completion_window` must be more than 0 and at most a week.", "completion_window")
    return seconds


def not_found(kind: str, object_id: str) -> OpenAIError:
    return OpenAIError(404, f"No {kind} with id `{object_id}`.", type="not_found_error", code=f"{kind}_not_found")


def too_large(max_bytes: int) -> OpenAIError:
    return OpenAIError(413, f"The file is over this router's limit of {max_bytes} bytes.", code="file_too_large")


def list_limit(limit: int) -> int:
    least, most, _ = LIST_LIMIT
    if not least <= limit <= most:
        raise bad_request(f"`limit` must be from {least} to {most}.", "limit")
    return limit


def add_batch_routes(
    app: FastAPI, db: BatchDb, runner: BatchRunner, flow: Flow, max_file_bytes: int, max_file_lines: int
) -> None:
    def tenant_of(request: Request) -> str:
        return flow.identify(request.scope.get(CALLER_SCOPE_KEY), request.headers).name

    _file_routes(app, db, tenant_of, max_file_bytes, max_file_lines)
    _batch_routes(app, db, runner, tenant_of)


def _file_routes(
    app: FastAPI, db: BatchDb, tenant_of: Callable[[Request], str], max_file_bytes: int, max_file_lines: int
) -> None:
    store = db.store

    @app.post("/v1/files")
    async def upload(request: Request) -> JSONResponse:
        tenant = tenant_of(request)
        declared = request.headers.get("content-length")
        if declared is None or not declared.isdigit():
            # A body of unknown length would be spooled whole before its size is known.
            raise OpenAIError(411, "Send the upload with a Content-Length.", code="length_required")
        if int(declared) > max_file_bytes + UPLOAD_OVERHEAD_BYTES:
            raise OpenAIError(
                413, f"The file is over this router's limit of {max_file_bytes} bytes.", code="file_too_large"
            )
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise bad_request("Upload the file as multipart/form-data with the fields `file` and `purpose`.")
        form = await request.form(max_files=1, max_fields=8)
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise bad_request("This router keeps files for batches only: `purpose` must be `batch`.", "purpose")
        if not isinstance(upload, UploadFile):
            raise bad_request("Missing the `file` field (a JSONL file).", "file")
        data = await upload.read(max_file_bytes + 1)
        if len(data) > max_file_bytes:
            raise OpenAIError(
                413, f"The file is over this router's limit of {max_file_bytes} bytes.", code="file_too_large"
            )
        try:
            lines = read_file(data, max_file_lines)
        except FileError as exc:
            raise bad_request(f"Not a batch file: {exc}.", "file") from None
        record = {
            "id": new_id("file-"),
            "tenant": tenant,
            "purpose": "batch",
            "filename": (upload.filename or "batch.jsonl")[:255],
            "bytes": len(data),
            "created_at": wall_seconds(),
        }
        await db.call(store.add_file, record, lines)
        return JSONResponse(file_object(record))

    @app.get("/v1/files")
    async def list_files(
        request: Request, purpose: str | None = None, limit: int = 10_000, after: str | None = None, order: str = "desc"
    ) -> JSONResponse:
        if order not in ("asc", "desc"):
            raise bad_request("`order` must be asc or desc.", "order")
        if not 1 <= limit <= 10_000:
            raise bad_request("`limit` must be from 1 to 10000.", "limit")
        found = await db.call(store.files, tenant_of(request), purpose, after, limit + 1, order == "desc")
        return JSONResponse(list_object([file_object(record) for record in found[:limit]], len(found) > limit))

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(request: Request, file_id: str) -> JSONResponse:
        record = await db.call(store.file, file_id, tenant_of(request))
        if record is None:
            raise not_found("file", file_id)
        return JSONResponse(file_object(record))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> Response:
        if await db.call(store.file, file_id, tenant_of(request)) is None:
            raise not_found("file", file_id)
        lines = await db.call(store.file_lines, file_id)
        body = "".join(line + "\n" for line in lines).encode()
        return Response(body, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str) -> JSONResponse:
        if not await db.call(store.delete_file, file_id, tenant_of(request)):
            raise not_found("file", file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})


def _batch_routes(app: FastAPI, db: BatchDb, runner: BatchRunner, tenant_of: Callable[[Request], str]) -> None:
    store = db.store

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> JSONResponse:
        tenant = tenant_of(request)
        asked = _json_object(await request.body())
        endpoint = asked.get("endpoint")
        if endpoint not in BATCH_ENDPOINTS:
            raise bad_request(f"`endpoint` must be one of {', '.join(BATCH_ENDPOINTS)}.", "endpoint")
        window = asked.get("completion_window", "24h")
        seconds = window_seconds(window)
        metadata = asked.get("metadata")
        if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= 16 and all(isinstance(v, str) for v in metadata.values())
        ):
            raise bad_request("`metadata` must be an object of at most 16 string values.", "metadata")
        file_id = asked.get("input_file_id")
        if not isinstance(file_id, str):
            raise bad_request("`input_file_id` must name an uploaded batch file.", "input_file_id")
        record = await db.call(store.file, file_id, tenant)
        if record is None or record["purpose"] != "batch":
            raise not_found("file", file_id)
        checked = check_lines(await db.call(store.file_lines, file_id), endpoint)
        now = wall_seconds()
        batch = {
            "id": new_id("batch_"),
            "tenant": tenant,
            "endpoint": endpoint,
            "input_file_id": file_id,
            "completion_window": window,
            "status": "in_progress",
            "created_at": now,
            "in_progress_at": now,
            "expires_at": now + seconds,
            "metadata": metadata,
            "total": len(checked),
        }
        await db.call(store.add_batch, batch, checked)
        runner.notify()
        counts = await db.call(store.counts, [batch["id"]])
        return JSONResponse(batch_object(batch, counts[batch["id"]]))

    @app.get("/v1/batches")
    async def list_batches(request: Request, limit: int = LIST_LIMIT[2], after: str | None = None) -> JSONResponse:
        found = await db.call(store.batches, tenant_of(request), after, list_limit(limit) + 1)
        counts = await db.call(store.counts, [batch["id"] for batch in found[:limit]])
        data = [batch_object(batch, counts[batch["id"]]) for batch in found[:limit]]
        return JSONResponse(list_object(data, len(found) > limit))

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(request: Request, batch_id: str) -> JSONResponse:
        batch = await db.call(store.batch, batch_id, tenant_of(request))
        if batch is None:
            raise not_found("batch", batch_id)
        counts = await db.call(store.counts, [batch_id])
        return JSONResponse(batch_object(batch, counts[batch_id]))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> JSONResponse:
        batch = await db.call(store.cancel, batch_id, tenant_of(request), wall_seconds())
        if batch is None:
            raise not_found("batch", batch_id)
        runner.notify()
        counts = await db.call(store.counts, [batch_id])
        return JSONResponse(batch_object(batch, counts[batch_id]))


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The body is not JSON: {exc}.") from None
    if not isinstance(value, dict):
        raise bad_request("The body must be a JSON object.")
    return value
