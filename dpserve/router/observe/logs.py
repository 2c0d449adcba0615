"""The router's logs: text for a terminal, or JSON lines (`--log-format json`) for a log pipeline, uvicorn's
own lines included. A line about a request carries its id, and what else is known of it (tenant, replica,
policy, status, duration, the trace and span when traced), as fields of its own in JSON.

With `--access-log`, each request the router relays is one line at its end (`dpserve.access`): method,
path, status, and those fields; uvicorn's own access line is kept for the router's other paths."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import orjson

from dpserve.router.observe.life import RequestLife, Watch

REQUEST_FIELDS = (
    "request_id",
    "endpoint",
    "tenant",
    "replica",
    "policy",
    "status",
    "duration_ms",
    "trace_id",
    "span_id",
)
"""What a line about a request may carry, each passed as `extra=` to the logging call."""
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_FORMATS = ("text", "json")
access_log = logging.getLogger("dpserve.access")


class JsonLines(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, the request's fields when
    given, and the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = record.__dict__
        for name in REQUEST_FIELDS:
            value = fields.get(name)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


def formatter(log_format: str) -> logging.Formatter:
    if log_format == "json":
        return JsonLines()
    return logging.Formatter(TEXT_FORMAT)


def configure(log_format: str, level: str) -> dict[str, Any]:
    """The root logger's one handler, in `log_format`; the config that gives uvicorn's loggers the same."""
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(log_format))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn configures its loggers from this dict: here, to hand their lines to the root's handler.
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "loggers": {
            name: {"handlers": [], "level": level.upper(), "propagate": True}
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
        },
    }


class RequestLog(Watch):
    """`--access-log`: one line for the request, at its end."""

    __slots__ = ("_method", "_path", "_policy")

    def __init__(self, method: str, path: str, policy: str) -> None:
        self._method = method
        self._path = path
        self._policy = policy

    def finished(self, life: RequestLife) -> None:
        access_log.info("%s %s %d", self._method, self._path, life.status, extra=request_fields(life, self._policy))


def request_fields(life: RequestLife, policy: str | None = None) -> dict[str, Any]:
    """The `extra=` of a log line about this request."""
    fields: dict[str, Any] = {"request_id": life.request_id, "endpoint": life.endpoint}
    if life.tenant:
        fields["tenant"] = life.tenant
    if life.replica_id is not None:
        fields["replica"] = life.replica_id
    if policy:
        fields["policy"] = policy
    if life.is_finished:
        fields["status"] = life.status
        fields["duration_ms"] = round((life.ended_at - life.started) * 1000, 3)
    if life.trace_ids is not None:
        fields["trace_id"], fields["span_id"] = life.trace_ids
    return fields
