"""The hit rate of an unbounded page cache on a trace."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field


def page_keys(tokens: Sequence[int], page_size: int) -> Iterator[int]:
    """One chained key per full page: it names every token before it too."""
    key = 0
    for start in range(0, len(tokens) - page_size + 1, page_size):
        key = hash((key, tuple(tokens[start : start + page_size])))
        yield key


@dataclass
class UnboundedCache:
    page_size: int
    keys: set[int] = field(default_factory=set)

    def hit_tokens(self, prompt: Sequence[int]) -> int:
        hits = 0
        for key in page_keys(prompt, self.page_size):
            if key not in self.keys:
                break
            hits += 1
        return hits * self.page_size

    def insert(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        self.keys.update(page_keys(list(prompt) + list(output[:-1]), self.page_size))


def unbounded_hit_rate(requests: Iterable[tuple[Sequence[int], Sequence[int]]], page_size: int,
                       warm: Iterable[tuple[Sequence[int], Sequence[int]]] = ()) -> float:
    """Cached share of ``requests``' prompt tokens, after caching ``warm`` (a restarted pod's L3)."""
    cache = UnboundedCache(page_size)
    for prompt, output in warm:
        cache.insert(prompt, output)
    hit = total = 0
    for prompt, output in requests:
        hit += cache.hit_tokens(prompt)
        total += len(prompt)
        cache.insert(prompt, output)
    return hit / total if total else 0.0
