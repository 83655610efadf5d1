"""Each role's OpenAPI schema declares what its routes really take and answer (the schema fuzz test relies on it)."""
from __future__ import annotations

import pytest

from decode_worker.server import app as api
from decode_worker.server import openapi
from decode_worker.server.guard import OPEN_PATHS
from decode_worker.server.schemas import ChatCompletionRequest, CompletionRequest, GenerateRequest, HandshakeRequest
from decode_worker.config import ServerConfig
from decode_worker.engine.engine import Engine

GENERATION = ("/generate", "/v1/completions", "/v1/chat/completions")


def schema(role: str, api_key: str = "k") -> dict:
    return api.create_app(Engine(ServerConfig(role=role, api_key=api_key))).openapi()


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode"])
def test_routes_declare_their_answers(role):
    paths = schema(role)["paths"]
    assert ("/v1/pd/handshake" in paths) == (role == "prefill")
    for path, ops in paths.items():
        for method, op in ops.items():
            statuses = set(op["responses"])
            assert "200" in statuses and "422" not in statuses, (path, method)
            assert ("401" in statuses) == (path not in OPEN_PATHS), (path, method)
            if method == "post" and path != "/flush_cache":
                assert op["requestBody"]["content"]["application/json"]["examples"], path
    for path in GENERATION:
        responses = paths[path]["post"]["responses"]
        assert {"400", "409", "413", "503"} <= set(responses)
        assert responses["503"]["headers"]["Retry-After"]["required"]
        assert {"502", "504"} <= set(responses) if role == "decode" else not {"502", "504"} & set(responses)
        assert "text/event-stream" in responses["200"]["content"]


def test_no_key_no_401():
    paths = schema("colocated", api_key="")["paths"]
    assert all("401" not in op["responses"] for ops in paths.values() for op in ops.values())


@pytest.mark.parametrize("model,examples", [
    (GenerateRequest, openapi.GENERATE_EXAMPLES), (CompletionRequest, openapi.COMPLETION_EXAMPLES),
    (ChatCompletionRequest, openapi.CHAT_EXAMPLES), (HandshakeRequest, openapi.HANDSHAKE_EXAMPLES),
])
def test_examples_are_valid_bodies(model, examples):
    for example in examples.values():
        model.model_validate(example)
