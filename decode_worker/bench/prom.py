"""Prometheus /metrics scrapes, and their differences: a run's own counts."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import httpx

_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Series = tuple[str, frozenset[tuple[str, str]]]


@dataclass(frozen=True)
class Scrape:
    samples: dict[Series, float] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Scrape:
        samples = {}
        for line in text.splitlines():
            match = _SAMPLE.match(line)
            if match and not line.startswith("#"):
                name, labels, value = match.groups()
                samples[(name, frozenset(_LABEL.findall(labels or "")))] = float(value)
        return cls(samples)

    def get(self, name: str, **labels: str) -> float:
        """Sum of ``name``'s series whose labels include ``labels``; 0 when none."""
        wanted = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and wanted <= ls)

    def mean(self, histogram: str) -> float | None:
        """Mean of a histogram's observations, None without any."""
        count = self.get(histogram + "_count")
        return self.get(histogram + "_sum") / count if count else None

    def quantile(self, histogram: str, q: float) -> float | None:
        """The ``q`` quantile, as ``histogram_quantile`` estimates it; None without observations."""
        cumulative: dict[float, float] = {}
        for (name, labels), value in self.samples.items():
            if name == histogram + "_bucket":
                le = float(dict(labels)["le"])
                cumulative[le] = cumulative.get(le, 0.0) + value
        buckets = sorted(cumulative.items())
        if not buckets or not buckets[-1][1]:
            return None
        rank, low, below = q * buckets[-1][1], 0.0, 0.0
        for high, count in buckets:
            if count >= rank:
                if high == float("inf"):
                    return low
                return high if count == below else low + (high - low) * (rank - below) / (count - below)
            low, below = high, count
        return low

    def __sub__(self, before: Scrape) -> Scrape:
        return Scrape({k: v - before.samples.get(k, 0.0) for k, v in self.samples.items()})

    def __add__(self, other: Scrape) -> Scrape:
        """Series summed over two workers (a fleet as one)."""
        keys = self.samples.keys() | other.samples.keys()
        return Scrape({k: self.samples.get(k, 0.0) + other.samples.get(k, 0.0) for k in keys})


async def scrape(http: httpx.AsyncClient, url: str) -> Scrape:
    resp = await http.get(url + "/metrics", timeout=30)
    resp.raise_for_status()
    return Scrape.parse(resp.text)
