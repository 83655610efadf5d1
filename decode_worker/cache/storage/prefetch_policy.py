"""How long a request waits for its L3 prefetch: ``best_effort`` never, ``timeout`` for ``min(cap, base +
per_1k * tokens / 1000)``, ``wait_complete`` up to a hard cap.
"""
from __future__ import annotations

from dataclasses import dataclass

from decode_worker.core.policies import PrefetchMode


@dataclass(frozen=True)
class PrefetchPolicy:
    name: PrefetchMode = PrefetchMode.BEST_EFFORT  # a plain string is converted
    base_s: float = 1.0
    per_1k_tokens_s: float = 0.25
    cap_s: float = 5.0
    hard_cap_s: float = 30.0  # wait_complete's bound

    def __post_init__(self):
        try:
            mode = PrefetchMode(self.name)
        except ValueError:
            modes = tuple(m.value for m in PrefetchMode)
            raise ValueError(f"prefetch policy {self.name!r} not in {modes}") from None
        if min(self.base_s, self.per_1k_tokens_s, self.cap_s, self.hard_cap_s) < 0:
            raise ValueError(f"prefetch timeouts must not be negative: {self}")
        object.__setattr__(self, "name", mode)

    def deadline_s(self, tokens: int) -> float:
        """Seconds to wait for a prefetch of ``tokens`` tokens."""
        if self.name is PrefetchMode.BEST_EFFORT:
            return 0.0
        if self.name is PrefetchMode.WAIT_COMPLETE:
            return self.hard_cap_s
        return min(self.cap_s, self.base_s + self.per_1k_tokens_s * tokens / 1000)
