"""A batch file's lines: read at upload (JSONL, each line a JSON object, or the line number and why not),
and checked as requests when a batch is created from the file (a bad line fails alone, in the error file)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from dpserve.router.http.endpoints import PROXIED_ENDPOINTS, BodyKind

BATCH_ENDPOINTS = tuple(
    endpoint.path
    for endpoint in PROXIED_ENDPOINTS
    if endpoint.method == "POST" and endpoint.body is BodyKind.JSON and not endpoint.path.endswith("/batch")
)
"""Every endpoint a batch may run: vLLM's that take a JSON body (not its own `/v1/chat/completions/batch`)."""
GROUP_PREFIX_CHARS = 512
"""How much of a prompt's start puts lines in one group: those sharing it run together, so the replica
that cached it serves the rest."""


class FileError(ValueError):
    """An upload that is not a batch file: the line, and why."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message if line is None else f"line {line}: {message}")
        self.line = line


@dataclass(frozen=True)
class Request:
    """A line that can run."""

    line: int
    custom_id: str
    url: str
    body: bytes
    group: str
    """Lines of one group start with the same prompt (`group_of`): they are run one after another."""


@dataclass(frozen=True)
class Refused:
    """A line that cannot run, reported in the error file."""

    line: int
    custom_id: str
    code: str
    message: str


def read_file(data: bytes, max_lines: int) -> list[str]:
    """The file's lines (blank ones dropped); FileError for the first line that is not a JSON object."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise FileError("not UTF-8 text", line) from None
    lines: list[str] = []
    for number, text_line in enumerate(text.splitlines(), start=1):
        if not text_line.strip():
            continue
        try:
            value = orjson.loads(text_line)
        except orjson.JSONDecodeError as exc:
            raise FileError(f"not JSON ({exc})", number) from None
        if not isinstance(value, dict):
            raise FileError(f"a JSON object is expected, got {type(value).__name__}", number)
        lines.append(text_line)
        if len(lines) > max_lines:
            raise FileError(f"more than {max_lines} requests: split the file", number)
    if not lines:
        raise FileError("the file has no requests")
    return lines


def check_lines(lines: Iterable[str], endpoint: str) -> list[Request | Refused]:
    """Each line as a request to `endpoint`, or why it cannot be one; numbered from 1 as in the file."""
    seen: set[str] = set()
    checked: list[Request | Refused] = []
    for number, line in enumerate(lines, start=1):
        checked.append(check_line(number, orjson.loads(line), endpoint, seen))
    return checked


def check_line(number: int, value: dict[str, Any], endpoint: str, seen: set[str]) -> Request | Refused:
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return Refused(number, "", "missing_custom_id", f"line {number}: `custom_id` must be a non-empty string")
    if custom_id in seen:
        return Refused(number, custom_id, "duplicate_custom_id", f"line {number}: `custom_id` {custom_id!r} repeats")
    seen.add(custom_id)

    def refused(code: str, why: str) -> Refused:
        return Refused(number, custom_id, code, f"line {number}: {why}")

    method = value.get("method", "POST")
    if method != "POST":
        return refused("invalid_method", f"`method` must be POST, not {str(method)[:16]!r}")
    url = value.get("url")
    if url != endpoint:
        return refused("mismatched_url", f"`url` {str(url)[:64]!r} is not the batch's endpoint {endpoint}")
    body = value.get("body")
    if not isinstance(body, dict):
        return refused("invalid_body", "`body` must be a JSON object")
    if body.get("stream"):
        return refused("invalid_body", "`stream` is not allowed in a batch: each answer is stored whole")
    return Request(number, custom_id, endpoint, orjson.dumps(body), group_of(body))


def group_of(body: dict[str, Any]) -> str:
    """A key shared by requests for one model whose prompts start alike (chat: the first message; else the
    prompt or input), to run them one after another."""
    start: object = body.get("messages")
    if isinstance(start, list) and start:
        start = start[0]
    else:
        start = body.get("prompt", body.get("input", ""))
    text = start if isinstance(start, str) else orjson.dumps(start, option=orjson.OPT_SORT_KEYS).decode()
    key = f"{body.get('model', '')}\x00{text[:GROUP_PREFIX_CHARS]}"
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
