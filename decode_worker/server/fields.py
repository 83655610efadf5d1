"""Every request field is honoured, refused (400 naming it) or, when no API documents it, ignored and logged
once (README)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache
from typing import Any

from pydantic import BaseModel

from decode_worker.server.schemas import SGLangSamplingParams

log = logging.getLogger(__name__)

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
# Documented fields that ask nothing of the output (metadata, logging and routing hints, which sglang-router adds
# to what it forwards): accepted as they are, without a warning.
NOTES = frozenset({"user", "metadata", "service_tier", "safety_identifier",
                   "prompt_cache_key", "verbosity", "max_completion_tokens", "model", "log_metrics", "no_logs",
                   "custom_labels", "data_parallel_rank", "bootstrap_pair_key", "extra_key", "priority"})

ROUTES = {"/generate": GENERATE, "/v1/completions": OPENAI, "/v1/chat/completions": OPENAI}
_warned: set[tuple[str, str]] = set()


def check_fields(model: type[BaseModel], data: Any, where: str) -> None:
    """ValueError naming a set, documented, unhonoured field of ``data`` (raw body of ``model``); warns on unknown."""
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
    """The fields ``model`` declares, by name and alias."""
    return frozenset(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


def _check(model: type[BaseModel], data: dict, table: dict, where: str, prefix: str) -> None:
    known = _known(model)
    for name, value in data.items():
        if name in table:
            neutral, feature = table[name]
            if not neutral(value):
                raise ValueError(f"field '{prefix}{name}' is not supported by this worker ({feature}): leave it out")
        elif name not in known and name not in NOTES and (where, prefix + name) not in _warned:
            _warned.add((where, prefix + name))
            log.warning("%s: ignoring field '%s', which no API this worker speaks documents", where, prefix + name)

