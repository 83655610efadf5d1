"""Logprobs in OpenAI's two shapes: completions' parallel lists and chat's token entries."""
from __future__ import annotations

from collections.abc import Callable

from decode_worker.core.request import PromptLogprobs

TokenText = Callable[[int], str]


def completion_logprobs(text_of: TokenText, ids: list[int], logprobs: list[float],
                        top: list[list[tuple[int, float]]], k: int, offset: int = 0) -> dict:
    """``tokens``, ``token_logprobs``, ``top_logprobs`` and ``text_offset`` (from ``offset``)."""
    tokens = [text_of(t) for t in ids]
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    alternatives = [{text_of(t): lp for t, lp in row} for row in top] if k else None
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": alternatives, "text_offset": offsets}


def prompt_completion_logprobs(text_of: TokenText, prompt_ids: list[int], scored: PromptLogprobs, k: int) -> dict:
    """The echoed prompt's logprobs, offsets from 0; its first token's logprob and alternatives are null."""
    out = completion_logprobs(text_of, prompt_ids[scored.start:], scored.logprobs, scored.top, k)
    if k:
        out["top_logprobs"] = [row if lp is not None else None for row, lp in zip(out["top_logprobs"], scored.logprobs)]
    return out


def chat_logprobs(text_of: TokenText, ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]]) -> dict:
    """``content``: per token its text, logprob, UTF-8 bytes and best alternatives."""
    rows = top if top else [[] for _ in ids]
    return {"content": [{**_entry(text_of(t), lp), "top_logprobs": [_entry(text_of(a), alp) for a, alp in row]}
                        for t, lp, row in zip(ids, logprobs, rows)]}


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
