"""Where a request's prompt logprobs start, from SGLang's and OpenAI's fields."""
from __future__ import annotations

from decode_worker.core.request import RequestError


def prompt_logprob_start(start: int | None, prompt_len: int, name: str) -> int | None:
    """``start`` (-1/None: none) checked against the prompt: past its last token is refused."""
    if start is None or start == -1:
        return None
    if not 0 <= start < prompt_len:
        raise RequestError(f"{name} must be -1 (output logprobs only) or a prompt position in [0, {prompt_len}), "
                           f"got {start}")
    return start
