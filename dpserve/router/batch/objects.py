"""The OpenAI objects the batch routes answer with, from the store's records."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dpserve.router.batch.store import Counts

TIMES = (
    "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
    "cancelling_at", "cancelled_at",
)  # fmt: skip


def file_object(record: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": record["id"],
        "object": "file",
        "bytes": record["bytes"],
        "created_at": record["created_at"],
        "filename": record["filename"],
        "purpose": record["purpose"],
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def batch_object(record: dict[str, Any], counts: Counts) -> dict[str, Any]:
    batch: dict[str, Any] = {
        "id": record["id"],
        "object": "batch",
        "endpoint": record["endpoint"],
        "errors": record.get("errors"),
        "input_file_id": record["input_file_id"],
        "completion_window": record["completion_window"],
        "status": record["status"],
        "output_file_id": record.get("output_file_id"),
        "error_file_id": record.get("error_file_id"),
    }
    batch.update({name: record.get(name) for name in TIMES})
    batch["request_counts"] = {"total": counts.total, "completed": counts.completed, "failed": counts.failed}
    batch["usage"] = {
        "input_tokens": counts.prompt_tokens,
        "input_tokens_details": {"cached_tokens": counts.cached_tokens},
        "output_tokens": counts.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": counts.prompt_tokens + counts.completion_tokens,
    }
    batch["metadata"] = record.get("metadata")
    return batch


def list_object(data: Sequence[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": list(data),
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
