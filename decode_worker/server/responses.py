"""What each route answers, declared for the OpenAPI schema; routes build plain dicts."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, RootModel

from decode_worker.config import ServerConfig
from decode_worker.server.errors import RETRY_AFTER_S


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
    """One answer per prompt: a list when the body was batched."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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


class CompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
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
    """A streamed call: its first delta carries index, id, type and name; later ones the arguments."""

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


class ChatCompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
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


class GenerateChunk(GenerateResponse):
    index: int | None = None  # which prompt of a batched body


class CompletionChunk(BaseModel):
    id: str
    object: str
    created: int
    model: str
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


class ChatCompletionChunk(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]  # empty in the last chunk of a stream with include_usage
    usage: ChatUsage | None = None


STREAM_CHUNKS = [GenerateChunk, CompletionChunk, ChatCompletionChunk]


def sse_content(chunk: type[BaseModel]) -> dict[str, Any]:
    """``stream: true``: each event is a JSON ``chunk`` or a mid-stream error; then ``[DONE]``."""
    payload = {"anyOf": [{"$ref": f"#/components/schemas/{chunk.__name__}"},
                         {"$ref": "#/components/schemas/ErrorResponse"}]}
    data = {"anyOf": [{"const": "[DONE]"},
                      {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {"text/event-stream": {"schema": event}}


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
    """OpenAPI responses for these statuses, in the one error shape (503 with Retry-After)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {"model": ErrorResponse, "description": _WHY[status]}
        if status == 503:
            out[status]["headers"] = _RETRY_AFTER
    return out


def auth_statuses(cfg: ServerConfig) -> tuple[int, ...]:
    """401 when this worker has an API key."""
    return (401,) if cfg.api_key else ()


def generation_errors(cfg: ServerConfig) -> dict[int | str, dict[str, Any]]:
    """The generate routes' errors; 502/504 on a decode worker, whose prefill peer can fail."""
    transfer = (502, 504) if cfg.role == "decode" else ()
    return errors(400, *auth_statuses(cfg), 409, 413, 503, *transfer)
