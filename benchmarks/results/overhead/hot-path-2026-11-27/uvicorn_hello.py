"""uvicorn's floor: an ASGI app that answers every request with a fixed completion, no proxying.
`taskset -c 1 uvicorn uvicorn_hello:app --http httptools --loop uvloop --no-access-log`, wrk on CPU 0."""

from starlette.types import Receive, Scope, Send

ANSWER = b'{"choices":[{"text":"' + b" tok" * 16 + b'"}]}'


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": ANSWER})
