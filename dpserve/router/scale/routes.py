"""GET /admin/scale: the desired-replicas signal per model, its inputs, the reason for its last change and
the measured start-up. `?after=VERSION&wait=SECONDS` answers once the signal changed past VERSION (or after
SECONDS, at most 60): how `dpserve up` follows it without polling."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.responses import JSONResponse

from dpserve.router.http.errors import bad_request
from dpserve.router.scale.advisor import ScaleAdvisor

MAX_WAIT_S = 60.0


def add_scale_routes(app: FastAPI, advisor: ScaleAdvisor) -> None:
    @app.get("/admin/scale")
    async def scale(after: str | None = None, wait: str = "0") -> JSONResponse:
        try:
            wait_s = float(wait)
            version = int(after) if after is not None else None
        except ValueError:
            raise bad_request("`after` must be an integer and `wait` a number of seconds.") from None
        if not 0 <= wait_s <= MAX_WAIT_S:
            raise bad_request(f"`wait` must be from 0 to {MAX_WAIT_S:g} seconds.", param="wait")
        if version is not None and wait_s > 0:
            await advisor.wait_change(version, wait_s)
        return JSONResponse(advisor.status())
