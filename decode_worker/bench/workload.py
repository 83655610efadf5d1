"""The replayed traces as token ids: shared prefix and multi-turn chat."""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SharedPrefixSpec:
    groups: int
    prompts_per_group: int
    prefix_len: int
    suffix_len: int
    output_len: int
    seed: int = 0

    @property
    def name(self) -> str:
        return f"{self.groups}x{self.prompts_per_group}"

    @property
    def reusable_tokens(self) -> int:
        """Prompt tokens a later prompt can reuse: every group's prefix."""
        return self.groups * self.prefix_len


@dataclass(frozen=True)
class Prompt:
    group: int
    ids: list[int]


def _tokens(rng: random.Random, n: int, vocab: int | Sequence[int]) -> list[int]:
    """``n`` ids from ``range(vocab)`` or the given ids (the same draws for a range)."""
    pool = range(vocab) if isinstance(vocab, int) else vocab
    return [rng.choice(pool) for _ in range(n)]


def shared_prefix_trace(spec: SharedPrefixSpec, vocab: int | Sequence[int], round_: int = 0) -> list[Prompt]:
    """Prompts in send order over ``vocab`` (size or ids); seed and shape fix prefixes and order, suffixes vary by
    round."""
    rng = random.Random(f"prefix-{spec.seed}-{spec.name}")
    prefixes = [_tokens(rng, spec.prefix_len, vocab) for _ in range(spec.groups)]
    order = [g for _ in range(spec.prompts_per_group) for g in range(spec.groups)]
    rng.shuffle(order)
    suffix_rng = random.Random(f"suffix-{spec.seed}-{spec.name}-{round_}")
    return [Prompt(g, prefixes[g] + _tokens(suffix_rng, spec.suffix_len, vocab)) for g in order]


@dataclass(frozen=True)
class ChatSpec:
    clients: int
    rounds: int
    first_len: int  # tokens of a conversation's first message
    turn_len: int  # tokens of each later question
    output_len: int
    seed: int = 0

    @property
    def name(self) -> str:
        return f"chat {self.clients}x{self.rounds}"

    @property
    def reusable_tokens(self) -> int:
        """Prompt tokens a later round can reuse: each chat's history before its last round."""
        return self.clients * (self.first_len + (self.rounds - 1) * (self.turn_len + self.output_len))


@dataclass
class Conversation:
    """One client's history; ``next_prompt`` and ``answered`` alternate."""

    client: int
    spec: ChatSpec
    vocab_size: int
    history: list[int] = field(default_factory=list)
    turns: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(f"chat-{self.spec.seed}-{self.client}")

    def next_prompt(self) -> list[int]:
        n = self.spec.first_len if self.turns == 0 else self.spec.turn_len
        return self.history + _tokens(self.rng, n, self.vocab_size)

    def answered(self, prompt: list[int], output: list[int]) -> None:
        self.history = prompt + output
        self.turns += 1


def conversations(spec: ChatSpec, vocab_size: int) -> list[Conversation]:
    return [Conversation(c, spec, vocab_size) for c in range(spec.clients)]
