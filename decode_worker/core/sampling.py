"""Sampling parameters of a request."""
from __future__ import annotations

from dataclasses import dataclass, field

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")  # constrained decoding: at most one per request
GREEDY_BELOW = 1e-5  # a temperature this close to 0 is greedy: dividing logits by it would overflow them into NaN
MAX_TEMPERATURE = 1e4  # far past uniform; logits are divided in float32, where 1.3e308 is inf and -inf / inf is NaN
MAX_TOP_LOGPROBS = 20  # alternatives reported per token, as OpenAI caps them
# The repetition penalty divides logits: past this floor (a denormal passed `> 0`) a logit overflows to inf and the
# step every live request shares raises. No sampler means anything by a penalty this strong.
MIN_REPETITION_PENALTY = 0.01


@dataclass
class SamplingParams:
    max_new_tokens: int = 128  # 0 scores the prompt and generates nothing
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    frequency_penalty: float = 0.0  # subtracted per earlier occurrence of a token in the output
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    repetition_penalty: float = 1.0  # divides (positive) or multiplies (negative) logits of tokens seen so far
    min_new_tokens: int = 0  # end-of-sequence and stop tokens are masked, and stop strings ignored, until then
    top_logprobs: int = 0  # the most likely alternatives reported with each token
    skip_special_tokens: bool = True  # special tokens are left out of the text
    # Constrained decoding (``scheduler/grammar.py``), at most one: the output is JSON valid under this schema, a
    # match of this regular expression, or a sentence of this EBNF grammar (GBNF, root rule ``root``).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    grammar_field: str = ""  # the request field the grammar came from, named in errors; "" names the kind itself

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the request's grammar, or None."""
        return next(((kind, text) for kind in GRAMMAR_KINDS if (text := getattr(self, kind)) is not None), None)

    @property
    def grammar_name(self) -> str:
        """The request field that errors about its grammar name."""
        return self.grammar_field or (self.grammar or ("grammar",))[0]

    @property
    def shapes_logits(self) -> bool:
        """Whether sampling adjusts this request's logits before it picks."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1
                    or self.min_new_tokens)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # NaN fails both comparisons
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2:  # NaN fails both comparisons
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 2], got "
                             f"{self.repetition_penalty}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        self._validate_grammar()

    def _validate_grammar(self) -> None:
        given = [kind for kind in GRAMMAR_KINDS if getattr(self, kind) is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} are exclusive: give at most one grammar")
        if given and not getattr(self, given[0]).strip():
            raise ValueError(f"{self.grammar_name} is empty")
        if given and self.min_new_tokens:  # its mask could leave no token the grammar allows
            raise ValueError(f"min_new_tokens cannot be combined with {self.grammar_name}: the grammar decides "
                             "where the output ends")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1
