"""`dpserve batch`: a router's batches as a table, or one batch's progress, followed to its end."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from dpserve.text_table import format_table

FINAL = ("completed", "failed", "expired", "cancelled")


class BatchClientError(RuntimeError):
    pass


def get_json(url: str, api_key: str | None, timeout_s: float = 10.0) -> Any:
    request = urllib.request.Request(url, headers={"authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.load(response)
    except json.JSONDecodeError:
        raise BatchClientError(f"{url}: the answer is not JSON") from None
    except ValueError:  # http.client's, for a header it cannot send; its message would show the key
        raise BatchClientError(f"{url}: the key cannot be sent (a line break or control character in it)") from None
    except urllib.error.HTTPError as exc:
        try:
            message = json.load(exc)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise BatchClientError(f"{url}: {exc.code} {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise BatchClientError(f"{url}: {getattr(exc, 'reason', exc)}") from None


def progress_line(batch: dict[str, Any]) -> str:
    counts = batch.get("request_counts") or {}
    total, completed, failed = counts.get("total", 0), counts.get("completed", 0), counts.get("failed", 0)
    share = (completed + failed) / total if total else 0.0
    return f"{batch['id']}  {batch['status']:<11} {completed + failed}/{total} ({share:.0%}), {failed} failed"


def batches_table(batches: list[dict[str, Any]]) -> str:
    rows = []
    for batch in batches:
        counts = batch.get("request_counts") or {}
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(batch["created_at"]))
        rows.append(
            [
                batch["id"], batch["status"], batch["endpoint"], counts.get("total", 0), counts.get("completed", 0),
                counts.get("failed", 0), created, batch.get("output_file_id") or "-", batch.get("error_file_id") or "-",
            ]
        )  # fmt: skip
    headers = ["id", "status", "endpoint", "total", "completed", "failed", "created", "output file", "error file"]
    return format_table(headers, rows)


def run_batch_command(
    router: str,
    api_key: str | None,
    batch_id: str | None,
    follow: bool,
    interval_s: float = 1.0,
    write: Callable[[str], object] = print,
) -> int:
    base = router.rstrip("/")
    batch_id = None if batch_id is None else urllib.parse.quote(batch_id, safe="")  # an id is one path segment
    try:
        if batch_id is None:
            listed = get_json(f"{base}/v1/batches?limit=100", api_key)
            write(batches_table(listed["data"]) if listed["data"] else "no batches")
            return 0
        batch = get_json(f"{base}/v1/batches/{batch_id}", api_key)
        write(progress_line(batch))
        while follow and batch["status"] not in FINAL:
            time.sleep(interval_s)
            batch = get_json(f"{base}/v1/batches/{batch_id}", api_key)
            write(progress_line(batch))
        if batch["status"] in FINAL:
            write(f"output file: {batch.get('output_file_id') or '-'}; error file: {batch.get('error_file_id') or '-'}")
    except BatchClientError as exc:
        print(f"dpserve batch: {exc}", file=sys.stderr)
        return 1
    except (KeyError, TypeError, AttributeError) as exc:  # a server that is no OpenAI batches API
        missing = f"no {exc} field" if isinstance(exc, KeyError) else "not the shape of one"
        print(f"dpserve batch: {base}: not an OpenAI batch answer ({missing})", file=sys.stderr)
        return 1
    return 0
