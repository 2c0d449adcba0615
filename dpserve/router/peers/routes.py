"""The paths other routers read this one's routing state from: a stream of updates, and a snapshot for a
router that starts (or restarts) among its peers."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.responses import Response, StreamingResponse

from dpserve.router.http.errors import OpenAIError, bad_request
from dpserve.router.peers.links import SNAPSHOT_PATH, STREAM_PATH, PeerLinks


def add_peer_routes(app: FastAPI, peers: PeerLinks) -> None:
    @app.get(STREAM_PATH)
    async def peer_stream(origin: str = "", relay: str = "0") -> Response:
        if not peers.enabled:
            raise OpenAIError(404, "This router has no peers (--peer, --discover-peers): it shares nothing.")
        if not origin:
            raise bad_request("Say who follows: ?origin=ID.")
        follower = peers.follow(origin, relay == "1")
        if follower is None:
            raise OpenAIError(409, "That origin is this router itself.", type="invalid_request_error")
        return StreamingResponse(peers.frames(follower), media_type="application/x-dpserve-peer")

    @app.get(SNAPSHOT_PATH)
    async def peer_snapshot(origin: str = "") -> Response:
        if origin == peers.board.origin:
            raise OpenAIError(409, "That origin is this router itself.", type="invalid_request_error")
        return Response(await peers.snapshot(), media_type="application/x-msgpack")
