async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"choices":[{"text":" tok tok tok tok tok tok tok tok tok tok tok tok tok tok tok tok"}]}'})
