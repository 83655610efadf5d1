"""Where a request's prompt logprobs start, from the fields SGLang and OpenAI clients send them in."""
from __future__ import annotations

from decode_worker.core.request import RequestError


def prompt_logprob_start(start: int | None, prompt_len: int, name: str) -> int | None:
    """``start`` (SGLang's ``logprob_start_len``; -1 or None: no prompt logprobs) checked against the prompt: a
    position past its last token scores nothing, and is refused rather than answered empty."""
    if start is None or start == -1:
        return None
    if not 0 <= start < prompt_len:
        raise RequestError(f"{name} must be -1 (output logprobs only) or a prompt position in [0, {prompt_len}), "
                           f"got {start}")
    return start
