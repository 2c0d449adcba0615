"""The app's refusal of a parameter FastAPI cannot read: OpenAI's shape, the parameter named, no pydantic dump."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from dpserve.router.http.error_handlers import install_error_handlers


def test_a_query_parameter_of_the_wrong_type_is_named_in_a_sentence() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/v1/things")
    async def things(limit: int = 20) -> dict[str, int]:
        return {"limit": limit}

    client = TestClient(app)
    assert client.get("/v1/things?limit=3").json() == {"limit": 3}
    answer = client.get("/v1/things?limit=abc")
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "limit" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("`limit`: ") and "valid integer" in error["message"]
    assert "int_parsing" not in error["message"] and "'loc'" not in error["message"]
