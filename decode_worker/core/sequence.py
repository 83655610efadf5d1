"""A request's token state while generated, and the checks that finish it."""
from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from decode_worker.core.sampling import SamplingParams

TOKEN_BYTES = 4  # a packed token id: int32, little-endian (the radix tree's key format)


def pack_tokens(tokens: Iterable[int]) -> bytes:
    """Token ids as int32 little-endian bytes: the radix tree's key format."""
    packed = array("i", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


@dataclass
class Sequence:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V is in the pool
    finish_reason: dict | None = None
    generator: torch.Generator | None = None
    _packed: bytearray = field(default_factory=bytearray, repr=False, compare=False)  # token ids packed so far

    def key(self, n: int) -> bytes:
        """The first ``n`` token ids packed (the cache's key), from bytes that grow with the sequence."""
        packed, have = self._packed, len(self._packed) // TOKEN_BYTES
        if have < n:
            prompt = len(self.prompt_ids)
            if have < prompt:
                packed += pack_tokens(self.prompt_ids[have:])
                have = prompt
            packed += pack_tokens(self.output_ids[have - prompt :])
        with memoryview(packed) as view:
            return bytes(view[: n * TOKEN_BYTES])

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def pages_needed(self, page_size: int) -> int:
        """Pages for every token's K/V so far (the last sampled token is written by the next step)."""
        return -(-self.num_tokens // page_size)


class PromptTooLong(ValueError):
    """Past the context or larger than the whole KV pool: can never run here."""


def check_fits(prompt_ids: list[int], params: SamplingParams, *, max_context: int, vocab_size: int, page_size: int,
               total_pages: int) -> None:
    """Reject at once what can never run: empty, bad ids or parameters, past the context, or more KV than the
    whole pool."""
    n = len(prompt_ids)
    if n == 0:
        raise ValueError("the prompt is empty")
    if any(t < 0 or t >= vocab_size for t in prompt_ids):
        raise ValueError(f"input_ids must be in [0, {vocab_size})")
    params.validate()
    if n >= max_context:
        raise PromptTooLong(f"the prompt has {n} tokens; the model's context is {max_context} tokens")
    need = -(-min(n + params.max_new_tokens, max_context) // page_size)
    if need > total_pages:
        raise PromptTooLong(f"prompt ({n} tokens) plus max_new_tokens ({params.max_new_tokens}) needs {need} KV pages "
                            f"but the whole KV pool (--max-total-tokens) has {total_pages}")


def check_finish(seq: Sequence, eos_token_ids: tuple[int, ...], max_context: int, decode_text) -> None:
    """Set ``seq.finish_reason`` after a new token, in SGLang's shape."""
    token = seq.output_ids[-1]
    p = seq.params
    if len(seq.output_ids) < p.min_new_tokens and seq.num_tokens < max_context:
        return  # too early to stop (min_new_tokens <= max_new_tokens): stop tokens were masked, stop strings wait
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
        seq.finish_reason = {"type": "stop", "matched": token}
    elif p.stop and (matched := _stop_string(p.stop, decode_text(seq.output_ids[-(max(map(len, p.stop)) + 8):]))):
        seq.finish_reason = {"type": "stop", "matched": matched}
    elif len(seq.output_ids) >= p.max_new_tokens or seq.num_tokens >= max_context:
        seq.finish_reason = {"type": "length", "length": len(seq.output_ids)}


def _stop_string(stops: list[str], tail: str) -> str | None:
    """The first stop string in the decoded tail (longest stop + 8 tokens: a token is at least one character)."""
    return next((s for s in stops if s in tail), None)


def trim_stop_string(text: str, finish_reason: dict | None) -> str:
    """Cut the output text before a matched stop string."""
    if finish_reason and isinstance(finish_reason.get("matched"), str):
        return text[: text.find(finish_reason["matched"])] if finish_reason["matched"] in text else text
    return text
