"""The OpenAPI document's models and declarations: routes read their own bodies and answer dicts."""
from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

from fastapi import FastAPI
from pydantic import BaseModel, Json, RootModel
from pydantic.json_schema import models_json_schema

from decode_worker.config import ServerConfig
from decode_worker.server.errors import RETRY_AFTER_S
from decode_worker.server.schemas import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    HandshakeRequest,
)

_REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail


class CachedTokens(BaseModel):
    device: int
    host: int
    storage: int


class GenerateMeta(BaseModel):
    id: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_details: CachedTokens
    e2e_latency: float  # seconds from submission to the answer's last token
    output_token_logprobs: list[list[Any]] | None = None
    output_top_logprobs: list[list[list[Any]]] | None = None  # per token: its top_logprobs_num [logprob, id, null]
    input_token_logprobs: list[list[Any]] | None = None  # from logprob_start_len; the first token's logprob null
    input_top_logprobs: list[list[list[Any]] | None] | None = None  # null for the prompt's first token


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: GenerateMeta


class GenerateOutput(RootModel[GenerateResponse | list[GenerateResponse]]):
    """A list when the body was batched."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class OpenAIEnvelope(BaseModel):
    id: str
    object: str
    created: int
    model: str


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # null for an echoed prompt's first token: nothing precedes it
    top_logprobs: list[dict[str, float] | None] | None  # null unless logprobs > 0; an entry null where the logprob is
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None  # with logprobs (0 for the chosen tokens only)


class CompletionResponse(OpenAIEnvelope):
    choices: list[CompletionChoice]
    usage: ChatUsage


class CalledFunctionOut(BaseModel):
    name: str
    arguments: str  # the arguments object as JSON text


class ToolCallOut(BaseModel):
    id: str  # call_...
    type: str  # function
    function: CalledFunctionOut


class ChatMessageOut(BaseModel):
    role: str
    content: str | None  # null when the answer is only tool calls
    tool_calls: list[ToolCallOut] | None = None  # with tools, the calls the model made


class FunctionDelta(BaseModel):
    name: str | None = None  # in a call's first delta
    arguments: str | None = None  # its arguments, in the deltas that follow


class ToolCallDelta(BaseModel):
    """First delta: index, id, type, name; later ones: arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChatLogprobs | None  # with logprobs: true


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class ChatUsage(Usage):
    prompt_tokens_details: PromptTokensDetails


class ChatCompletionResponse(OpenAIEnvelope):
    choices: list[ChatChoice]
    usage: ChatUsage


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class ServerInfo(RootModel[dict[str, Any]]):
    pass


class ModelInfo(BaseModel):
    model_path: str
    served_model_name: str
    tokenizer_path: str
    is_generation: bool
    max_context: int


class Load(BaseModel):
    num_reqs: int
    num_waiting_reqs: int
    num_tokens: int
    num_running_reqs: int | None = None
    max_total_tokens: int | None = None


class AbortResult(BaseModel):
    aborted: int  # live requests that will end as aborted (499)


class Version(BaseModel):
    version: str


class FlushResult(BaseModel):
    success: bool
    message: str
    dropped_tokens: int
    kept_tokens: int  # still cached: held by running requests or by copies that outlasted the wait


class HandshakeAccepted(BaseModel):
    status: str
    room: int
    tokens: int
    nbytes: int


class HandshakePending(BaseModel):
    status: str  # "pending": the room's KV is not here yet; ask again
    room: int


class GenerateChunk(GenerateResponse):
    index: int | None = None  # which prompt of a batched body


class CompletionChunk(OpenAIEnvelope):
    choices: list[CompletionChoice]  # empty in the last chunk of a stream with include_usage
    usage: ChatUsage | None = None


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: ChatLogprobs | None


class ChatCompletionChunk(OpenAIEnvelope):
    choices: list[ChatChunkChoice]  # empty in the last chunk of a stream with include_usage
    usage: ChatUsage | None = None


Chunk = TypeVar("Chunk", bound=BaseModel)


class StreamEvent(BaseModel, Generic[Chunk]):
    """A JSON chunk or mid-stream error; then ``[DONE]``."""

    data: Literal["[DONE]"] | Json[Chunk | ErrorResponse]


class GenerateEvent(StreamEvent[GenerateChunk]):
    pass


class CompletionEvent(StreamEvent[CompletionChunk]):
    pass


class ChatCompletionEvent(StreamEvent[ChatCompletionChunk]):
    pass


# In the components though no route signature names them.
DECLARED = [GenerateRequest, CompletionRequest, ChatCompletionRequest, HandshakeRequest, AbortRequest,
            GenerateEvent, CompletionEvent, ChatCompletionEvent]


def sse_content(event: type[StreamEvent]) -> dict[str, Any]:
    return {"text/event-stream": {"schema": {"$ref": _REF.format(model=event.__name__)}}}


_RETRY_AFTER = {"Retry-After": {"description": f"seconds to wait before retrying ({RETRY_AFTER_S})", "required": True,
                                "schema": {"type": "string"}}}
_WHY = {
    400: "bad request: the message names the field",
    401: "missing or wrong credentials",
    404: "unknown transfer room",
    409: "conflict: a request id already running, or a KV layout or prompt that differs between the PD peers",
    413: "request body larger than --max-request-body-bytes",
    502: "the prefill peer failed or refused the KV transfer",
    503: "not ready or shutting down, or (generation routes) past --max-concurrent-requests",
    504: "the prefill peer missed a deadline",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """These statuses in the error shape; 503 with Retry-After."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {"model": ErrorResponse, "description": _WHY[status]}
        if status == 503:
            out[status]["headers"] = _RETRY_AFTER
    return out


def auth_statuses(cfg: ServerConfig) -> tuple[int, ...]:
    """401 with an API key."""
    return (401,) if cfg.api_key else ()


def generation_errors(cfg: ServerConfig) -> dict[int | str, dict[str, Any]]:
    """502/504 only on decode, whose prefill can fail."""
    transfer = (502, 504) if cfg.role == "decode" else ()
    return errors(400, *auth_statuses(cfg), 409, 413, 503, *transfer)


_PD = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 30001, "bootstrap_room": 8123456789}
_GEN = {"max_new_tokens": 8, "temperature": 0}
GENERATE_EXAMPLES = {
    "text": {"text": "The capital of France is", "sampling_params": _GEN},
    "stream": {"text": "The capital of France is", "sampling_params": _GEN, "stream": True},
    "batch": {"input_ids": [[1, 504, 3575], [1, 504]], "sampling_params": {"max_new_tokens": 4},
              "return_logprob": True},
    "pd": {"text": "The capital of France is", "sampling_params": _GEN, **_PD},  # what a PD router sends
}
COMPLETION_EXAMPLES = {
    "prompt": {"model": "default", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
    "stream": {"model": "default", "prompt": "The capital of France is", "max_tokens": 8, "stream": True},
    "pd": {"model": "default", "prompt": ["The capital of France is", "Hello"], "max_tokens": 8,
           "bootstrap_host": ["127.0.0.1"] * 2, "bootstrap_port": [30001, None],  # null: the --bootstrap-port
           "bootstrap_room": [8123456789, 8123456790]},
}
CHAT_EXAMPLES = {
    "chat": {"model": "default",
             "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
             "max_tokens": 16},
    "stream": {"model": "default", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8,
               "stream": True},
    "pd": {"model": "default", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8, **_PD},
}
HANDSHAKE_EXAMPLES = {  # what a decode worker sends; the layout is that of the decode side's KV pool
    "handshake": {"room": 8123456789, "prompt_len": 40, "prompt_digest": "0" * 32,
                  "nixl_agent": "decode-0123456789ab", "known_agent": "",
                  "layout": {"model_id": "SmolLM2-135M-Instruct.Q4_1@0123456789ab", "num_layers": 30,
                             "num_kv_heads": 3, "head_dim": 64, "page_size": 16, "dtype": "float32"}},
}


def json_body(model: type[BaseModel], examples: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """``openapi_extra`` for a JSON body of ``model``."""
    media: dict[str, Any] = {"schema": {"$ref": _REF.format(model=model.__name__)}}
    if examples:
        media["examples"] = {name: {"value": value} for name, value in examples.items()}
    return {"requestBody": {"required": True, "content": {"application/json": media}}}


def declare_models(app: FastAPI) -> None:
    """``DECLARED`` and what they use, in the components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            _, defs = models_json_schema([(m, "validation") for m in DECLARED], ref_template=_REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        return app.openapi_schema

    app.openapi = openapi
