"""Request bodies; documented, unhonoured fields refused; unknown ones logged once."""
from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Callable
from functools import cache
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from decode_worker.core.sampling import MAX_TEMPERATURE, MIN_REPETITION_PENALTY
from decode_worker.pd.handshake import MAX_HANDSHAKE_WAIT_S, PD_TOKEN_HEADER

log = logging.getLogger(__name__)

_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def _is_ip(text: str, version: int | None = None) -> bool:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return False
    return version is None or address.version == version


def _check_host(host: str) -> str:
    """A hostname, IP or bracketed IPv6, safe in a URL."""
    bracketed = host.startswith("[") and host.endswith("]") and _is_ip(host[1:-1], 6)
    if not (bracketed or _is_ip(host) or _HOSTNAME.fullmatch(host)):
        raise ValueError(f"{host!r} is not a hostname or an IP address")
    return host


# The router draws rooms as random u64; the transfer protocol carries them as such.
Room = Annotated[int, Field(ge=0, le=2**64 - 1)]
Port = Annotated[int, Field(ge=1, le=65535)]
Host = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9.:\[\]-]+$"), AfterValidator(_check_host)]
# What sampling can take; top_k 0 (neither off nor a count) is refused by the engine's own check.
Temperature = Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, Field(gt=0, le=1)]
TopK = Annotated[int, Field(ge=-1)]
MaxTokens = Annotated[int, Field(ge=1)]
ScoredTokens = Annotated[int, Field(ge=0)]  # 0 scores the prompt (its logprobs) and generates nothing
LogprobStart = Annotated[int, Field(ge=-1)]  # -1: output logprobs only, as SGLang's default
SamplesPerPrompt = Annotated[int, Field(ge=1, le=64)]  # each sample is a request of its own
Penalty = Annotated[float, Field(ge=-2, le=2)]  # frequency and presence, as OpenAI bounds them
RepetitionPenalty = Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=2)]
TopLogprobs = Annotated[int, Field(ge=0, le=20)]
GrammarText = Annotated[str, Field(min_length=1)]  # a JSON schema, regular expression or EBNF grammar
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]  # what a torch generator can be seeded with
# Stop strings are looked for after every token, on the event loop: their number and length are bounded.
MAX_STOPS, MAX_STOP_CHARS = 32, 256
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Stops = StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)]
# A prompt is never empty, nor is a batch of them.
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Texts = Annotated[list[Text], Field(min_length=1)]
TokenIdBatch = Annotated[list[TokenIds], Field(min_length=1)]


class _Lenient(BaseModel):
    # NaN and infinity (Python's JSON reader takes them) have no meaning in any field and poison sampling.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class BootstrapFields(_Lenient):
    """A PD router's prefill peer and transfer room."""

    bootstrap_host: Host | list[Host | None] | None = None
    bootstrap_port: Port | list[Port | None] | None = None
    bootstrap_room: Room | list[Room | None] | None = None


class SGLangSamplingParams(_Lenient):
    max_new_tokens: ScoredTokens = 128
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    stop: Stops | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: SamplesPerPrompt = 1
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    min_new_tokens: Annotated[int, Field(ge=0)] = 0
    skip_special_tokens: bool = True
    seed: Seed | None = Field(default=None, alias="sampling_seed")
    json_schema: GrammarText | None = None  # constrained decoding (structured.py): at most one of these three
    regex: GrammarText | None = None
    ebnf: GrammarText | None = None

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


class GenerateRequest(BootstrapFields):
    text: Text | Texts | None = None
    input_ids: TokenIds | TokenIdBatch | None = None
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    top_logprobs_num: TopLogprobs | list[TopLogprobs] = 0  # alternatives per token, with return_logprob
    logprob_start_len: LogprobStart | list[LogprobStart] = -1  # prompt logprobs from this position, with return_logprob
    return_text_in_logprobs: bool = False  # each logprob entry's third item: the token's text instead of null


class JsonSchemaFormat(_Lenient):
    """``response_format.json_schema``: always held to, as ``strict`` asks."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # absent: any JSON object
    strict: bool | None = None

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


class ResponseFormat(_Lenient):
    """Text, any JSON object, or a schema's JSON."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False  # a last chunk with the usage of the whole request


class OpenAISampling(BootstrapFields):
    """Fields of both OpenAI routes, with SGLang's extras."""

    model: str | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    n: SamplesPerPrompt = 1
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    stop: Stops | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    rid: str | None = None
    response_format: ResponseFormat | None = None
    regex: GrammarText | None = None  # SGLang's constrained-decoding extras on these routes
    ebnf: GrammarText | None = None


class CompletionRequest(OpenAISampling):
    prompt: Text | Texts | TokenIds | TokenIdBatch
    max_tokens: ScoredTokens = 16
    logprobs: TopLogprobs | None = None  # chosen-token logprobs, and this many alternatives per token
    echo: bool = False


class ContentPart(_Lenient):
    """A message content part; only ``text`` is served."""

    type: str
    text: str | None = None


class FunctionDefinition(_Lenient):
    """A callable function; a required or named call keeps to ``parameters``."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    """The one function the model must call."""

    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Lenient):
    name: str
    arguments: str  # JSON text of an object, as the API returned it


class ToolCallMessage(_Lenient):
    """A call an earlier assistant message made."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Lenient):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallMessage] | None = None  # on an assistant message: the calls it made
    tool_call_id: str | None = None  # on a tool message: which call this is the result of


class ChatCompletionRequest(OpenAISampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None  # alternatives per token, with logprobs
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto (none without tools)
    parallel_tool_calls: bool = True  # False: at most one call per answer


class AbortRequest(_Lenient):
    """One request by id, or all."""

    rid: str = ""
    abort_all: bool = False


class HandshakeRequest(_Lenient):
    """Decode -> prefill; the PD token goes in a header, never the body."""

    room: Room
    prompt_len: int = Field(ge=1)
    prompt_digest: str
    layout: dict[str, Any]
    nixl_agent: str = Field(min_length=1, max_length=256)
    known_agent: str = Field(default="", max_length=256)
    wait_s: float | None = Field(default=None, gt=0, le=MAX_HANDSHAKE_WAIT_S)

    @model_validator(mode="before")
    @classmethod
    def _no_token_in_body(cls, data: Any) -> Any:
        """A body ``token`` is refused, naming the header."""
        if isinstance(data, dict) and "token" in data:
            raise ValueError(f"field 'token' is not accepted in the handshake body: send the PD token in the "
                             f"{PD_TOKEN_HEADER} header")
        return data


Neutral = Callable[[Any], bool]


def _among(*values: Any) -> Neutral:
    return lambda v: v in values


ABSENT = _among(None)
FALSE = _among(None, False)
ZERO = _among(None, 0)
ONE = _among(None, 1)
TRUE = _among(None, True)
EMPTY = _among(None, {}, [], "")


# Documented by SGLang (GenerateReqInput, SamplingParams) and not honoured here: field -> its neutral values.
GENERATE: dict[str, tuple[Neutral, str]] = {
    "input_embeds": (ABSENT, "input embeddings"), "image_data": (ABSENT, "image inputs (a text-only model)"),
    "audio_data": (ABSENT, "audio inputs (a text-only model)"), "video_data": (ABSENT, "video inputs"),
    "token_ids_logprob": (ABSENT, "logprobs of chosen token ids"), "lora_path": (ABSENT, "LoRA adapters"),
    "custom_logit_processor": (ABSENT, "custom logit processors"), "return_hidden_states": (FALSE, "hidden states"),
    "return_entropy": (FALSE, "per-token entropy"), "return_bytes": (FALSE, "image bytes"),
    "return_prompt_token_ids": (FALSE, "prompt token ids without logprobs"),
    "background": (FALSE, "background requests"),
}
SAMPLING: dict[str, tuple[Neutral, str]] = {
    "min_p": (ZERO, "min-p sampling"), "structural_tag": (ABSENT, "structural tags"),
    "spaces_between_special_tokens": (TRUE, "detokenizer options"), "no_stop_trim": (FALSE, "untrimmed stop strings"),
    "custom_params": (ABSENT, "custom logit processors"), "logit_bias": (EMPTY, "logit bias"),
}
# Documented by OpenAI and not honoured here.
OPENAI: dict[str, tuple[Neutral, str]] = {
    "best_of": (ONE, "best_of"),
    "logit_bias": (EMPTY, "logit bias"), "suffix": (EMPTY, "suffixes"),
    "functions": (EMPTY, "legacy function calls: send tools instead"),
    "function_call": (_among(None, "none", "auto"), "legacy function calls: send tool_choice instead"),
    "audio": (ABSENT, "audio output"), "modalities": (_among(None, ["text"]), "non-text output"),
    "prediction": (ABSENT, "predicted outputs"), "reasoning_effort": (ABSENT, "reasoning effort"),
    "store": (FALSE, "stored completions"), "web_search_options": (ABSENT, "web search"),
}
# Documented fields that ask nothing of the output (metadata, logging and routing hints, which smg adds
# to what it forwards): accepted as they are, without a warning.
NOTES = frozenset({"user", "metadata", "service_tier", "safety_identifier",
                   "prompt_cache_key", "verbosity", "max_completion_tokens", "model", "log_metrics", "no_logs",
                   "custom_labels", "data_parallel_rank", "bootstrap_pair_key", "extra_key", "priority"})

ROUTES = {"/generate": GENERATE, "/v1/completions": OPENAI, "/v1/chat/completions": OPENAI}
MAX_WARNED = 256  # unknown field names remembered (each is logged once); clients choose them, so they are bounded
_warned: set[tuple[str, str]] = set()


def check_fields(model: type[BaseModel], data: Any, where: str) -> None:
    """ValueError naming a set, documented, unhonoured field; unknown ones warn once."""
    if not isinstance(data, dict):
        return  # the schema's own validation says what is wrong
    _check(model, data, ROUTES.get(where, {}), where, "")
    params = data.get("sampling_params") if where == "/generate" else None
    for i, p in enumerate(params if isinstance(params, list) else [params]):
        if isinstance(p, dict):
            prefix = f"sampling_params.{i}." if isinstance(params, list) else "sampling_params."
            _check(SGLangSamplingParams, p, SAMPLING, where, prefix)


@cache
def _known(model: type[BaseModel]) -> frozenset[str]:
    """Field names and aliases."""
    return frozenset(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


def _check(model: type[BaseModel], data: dict, table: dict, where: str, prefix: str) -> None:
    known = _known(model)
    for name, value in data.items():
        if name in table:
            neutral, feature = table[name]
            if not neutral(value):
                raise ValueError(f"field '{prefix}{name}' is not supported by this worker ({feature}): leave it out")
        elif name not in known and name not in NOTES:
            _warn_unknown(where, prefix + name)


def _warn_unknown(where: str, name: str) -> None:
    """Log an unknown field once; past ``MAX_WARNED`` names, one last line and no more."""
    key = (where, name[:100])
    if key not in _warned and len(_warned) < MAX_WARNED:
        _warned.add(key)
        log.warning("%s: ignoring field '%s', which no API this worker speaks documents", where, key[1])
        if len(_warned) == MAX_WARNED:
            log.warning("%d unknown field names logged; further ones are ignored without a line", MAX_WARNED)
