"""Page-table rows kept on the device. Contract: a running request's page list grows in place; a new
list object rewrites its row.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, repeat

import torch

from decode_worker.model.forward_batch import ForwardBatch, int_tensor, pack_to_device


@dataclass(eq=False)
class _Row:
    index: int
    pages: list[int] | None = None  # the list object synced from (identity, not equality, is checked)
    synced: int = 0  # leading entries of ``pages`` already in the device row


class PageTableRows:
    """One row of page ids per running request; rows double when full."""

    def __init__(self, max_pages: int, device: torch.device, capacity: int = 64):
        self.max_pages = max_pages
        self.device = device
        self.table = torch.zeros(capacity, max_pages, dtype=torch.int64, device=device)
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest row first
        self._rows: dict[str, _Row] = {}

    @property
    def capacity(self) -> int:
        return self.table.shape[0]

    def __contains__(self, key: str) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def row_of(self, key: str) -> int:
        return self._rows[key].index

    def release(self, key: str) -> None:
        """Zero and free the key's row; no row: no-op."""
        row = self._rows.pop(key, None)
        if row is not None:
            self.table[row.index].zero_()
            self._free.append(row.index)

    def decode_batch(self, keys: list[str], last_tokens: list[int], prefix_lens: list[int],
                     pages: list[list[int]], page_size: int) -> ForwardBatch:
        """A decode step; ValueError on a repeated key or too few pages."""
        if len(set(keys)) != len(keys):
            raise ValueError("a request appears twice in one decode step")
        seq_lens = [p + 1 for p in prefix_lens]
        needs = [-(-n // page_size) for n in seq_lens]
        for n, need, plist in zip(seq_lens, needs, pages):
            if len(plist) < need:
                raise ValueError(f"{n} tokens need {need} pages, request has {len(plist)}")
            if need > self.max_pages:
                raise ValueError(f"{n} tokens need {need} pages, a page-table row holds {self.max_pages}")
        taken = [key for key in keys if key not in self._rows]
        try:
            rows = [self._row(key) for key in keys]
            delta = self._delta(rows, pages, needs)
            fb = self._lay_out(rows, delta, last_tokens, prefix_lens, seq_lens, pages, needs, page_size)
        except BaseException:
            for key in taken:
                self.release(key)
            raise
        for row, plist, need in zip(rows, pages, needs):
            row.pages, row.synced = plist, need
        return fb

    def _row(self, key: str) -> _Row:
        row = self._rows.get(key)
        if row is None:
            if not self._free:
                self._grow()
            row = self._rows[key] = _Row(self._free.pop())
        return row

    def _grow(self) -> None:
        old = self.capacity
        table = torch.zeros(2 * old, self.max_pages, dtype=torch.int64, device=self.device)
        table[:old].copy_(self.table)
        self.table = table
        self._free = list(range(2 * old - 1, old - 1, -1)) + self._free

    @staticmethod
    def _delta(rows: list[_Row], pages: list[list[int]], needs: list[int]) -> tuple[list[int], list[int], list[int]]:
        """(row, column, page) triples to write."""
        d_rows: list[int] = []
        d_cols: list[int] = []
        d_vals: list[int] = []
        for row, plist, need in zip(rows, pages, needs):
            start = row.synced if row.pages is plist and row.synced <= need else 0
            end = need if start else max(need, row.synced)
            if start == end:
                continue
            d_rows += repeat(row.index, end - start)
            d_cols += range(start, end)
            d_vals += plist[start:need] if end == need else chain(plist[:need], repeat(0, end - need))
        return d_rows, d_cols, d_vals

    def _lay_out(self, rows: list[_Row], delta: tuple[list[int], list[int], list[int]], last_tokens: list[int],
                 prefix_lens: list[int], seq_lens: list[int], pages: list[list[int]], needs: list[int],
                 page_size: int) -> ForwardBatch:
        batch = len(rows)
        out_slots = [plist[p // page_size] * page_size + p % page_size for plist, p in zip(pages, prefix_lens)]
        host = {
            "input_ids": last_tokens, "positions": prefix_lens, "out_slots": out_slots, "seq_lens": seq_lens,
            "logits_indices": range(batch), "rows": [r.index for r in rows],
            "d_rows": delta[0], "d_cols": delta[1], "d_vals": delta[2],
        }
        moved = pack_to_device({name: int_tensor(values) for name, values in host.items()}, self.device)
        if delta[0]:
            self.table[moved["d_rows"], moved["d_cols"]] = moved["d_vals"]
        page_table = self.table[:, : max(needs)].index_select(0, moved["rows"])
        return ForwardBatch(
            is_decode=True, input_ids=moved["input_ids"], positions=moved["positions"],
            out_slots=moved["out_slots"], page_table=page_table, seq_lens=moved["seq_lens"],
            prefix_lens=list(prefix_lens), logits_indices=moved["logits_indices"],
        )
