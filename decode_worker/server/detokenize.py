"""Incremental detokenization (vLLM's offsets); an incomplete trailing character is held back."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class IncrementalText:
    decode: Callable[[list[int]], str]
    ids: list[int] = field(default_factory=list)
    text: str = ""  # complete text so far
    prefix_offset: int = 0  # window start: tokens before it are final
    read_offset: int = 0  # tokens up to here are in ``text``

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; returns the text they completed (possibly empty)."""
        self.ids += new_ids
        head = self.decode(self.ids[self.prefix_offset : self.read_offset])
        window = self.decode(self.ids[self.prefix_offset :])
        if len(window) <= len(head) or window.endswith("\ufffd"):
            return ""
        delta = window[len(head) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
