"""Request bodies of the SGLang- and OpenAI-compatible routes. Unknown fields are ignored."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class BootstrapFields(_Lenient):
    """Added by a PD router: where the prefill peer is and which transfer room this request uses."""

    bootstrap_host: str | list[str | None] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int | None] | None = None


class SGLangSamplingParams(_Lenient):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = Field(default=None, alias="sampling_seed")

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class GenerateRequest(BootstrapFields):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False


class OpenAISampling(BootstrapFields):
    """Sampling fields shared by the completions and chat routes (plus SGLang's extras top_k, ignore_eos)."""

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stream: bool = False
    rid: str | None = None


class CompletionRequest(OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(_Lenient):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False


class HandshakeRequest(_Lenient):
    """Decode -> prefill: what the decode side holds and where to push the rest."""

    room: int
    decode_prefix_len: int
    prompt_len: int
    prompt_digest: str
    ucx_address: str  # base64 UCX worker address of the decode side
    layout: dict[str, Any]
    token: str = ""
