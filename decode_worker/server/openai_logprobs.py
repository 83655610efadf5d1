"""Logprobs in the two shapes OpenAI's routes return them: the completions route's parallel lists, and the chat
route's list of token entries. Token strings keep special tokens, so every token has one."""
from __future__ import annotations

from collections.abc import Callable

from decode_worker.core.request import PromptLogprobs

TokenText = Callable[[int], str]


def completion_logprobs(text_of: TokenText, ids: list[int], logprobs: list[float],
                        top: list[list[tuple[int, float]]], k: int, offset: int = 0) -> dict:
    """``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict per token of its ``k`` best, or null with k 0) and
    ``text_offset`` (where each token starts in the choice's text, from ``offset``)."""
    tokens = [text_of(t) for t in ids]
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    alternatives = [{text_of(t): lp for t, lp in row} for row in top] if k else None
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": alternatives, "text_offset": offsets}


def prompt_completion_logprobs(text_of: TokenText, prompt_ids: list[int], scored: PromptLogprobs, k: int) -> dict:
    """The echoed prompt's part of a completion's logprobs, from its first scored token, offsets from 0; the
    prompt's first token has null for its logprob and alternatives (nothing precedes it), as OpenAI's had."""
    out = completion_logprobs(text_of, prompt_ids[scored.start:], scored.logprobs, scored.top, k)
    if k:
        out["top_logprobs"] = [row if lp is not None else None for row, lp in zip(out["top_logprobs"], scored.logprobs)]
    return out


def chat_logprobs(text_of: TokenText, ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]]) -> dict:
    """``content``: one entry per token with its text, logprob, UTF-8 bytes and its best alternatives."""
    rows = top if top else [[] for _ in ids]
    return {"content": [{**_entry(text_of(t), lp), "top_logprobs": [_entry(text_of(a), alp) for a, alp in row]}
                        for t, lp, row in zip(ids, logprobs, rows)]}


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
