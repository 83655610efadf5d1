"""One forward pass's tensors, built with whole-batch ops."""
from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import accumulate

import torch


@dataclass
class ForwardBatch:
    """One step over B requests and T new tokens (tables padded with page 0)."""

    is_decode: bool
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T]
    page_table: torch.Tensor  # [B, max_pages]
    seq_lens: torch.Tensor  # [B]
    prefix_lens: list[int]  # tokens already in KV before this step, per request
    logits_indices: torch.Tensor  # [B] row of each request's last new token; all rows when all_logits
    all_logits: bool = False
    host_seq_lens: list[int] | None = None  # seq_lens as Python ints (extend batches)
    context_slots: torch.Tensor | None = None  # extend: every request's slots, prefix then new, back to back

    @property
    def batch_size(self) -> int:
        return self.seq_lens.numel()

    @classmethod
    def build(
        cls,
        new_tokens: list[list[int]],
        prefix_lens: list[int],
        pages: list[list[int]],
        page_size: int,
        device: torch.device,
        all_logits: bool = False,
    ) -> "ForwardBatch":
        """Lay out a step; ValueError on an empty request or too few pages."""
        new_lens = [len(t) for t in new_tokens]
        if not new_tokens or 0 in new_lens:
            raise ValueError("every request in a step needs at least one new token")
        seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
        page_counts = [-(-n // page_size) for n in seq_lens]
        for n, need, plist in zip(seq_lens, page_counts, pages):
            if len(plist) < need:
                raise ValueError(f"{n} tokens need {need} pages, request has {len(plist)}")
        is_decode = all(n == 1 for n in new_lens) and not all_logits
        flat_ids = [t[0] for t in new_tokens] if is_decode else [t for seq in new_tokens for t in seq]
        host = _layout(int_tensor(flat_ids), int_tensor(prefix_lens), int_tensor(new_lens), int_tensor(page_counts),
                       int_tensor(_used_pages(pages, page_counts)), max(page_counts), page_size, is_decode,
                       all_logits)
        on_device = pack_to_device(host, device)
        return cls(
            is_decode=is_decode,
            prefix_lens=list(prefix_lens),
            all_logits=all_logits,
            host_seq_lens=None if is_decode else seq_lens,
            **on_device,
        )


def int_tensor(values: Iterable[int]) -> torch.Tensor:
    """Python ints as int64 over an ``array`` (faster than ``torch.tensor``)."""
    packed = array("q", values)
    return torch.frombuffer(packed, dtype=torch.int64) if packed else torch.zeros(0, dtype=torch.int64)


def _used_pages(pages: list[list[int]], counts: list[int]) -> list[int]:
    flat: list[int] = []
    for plist, n in zip(pages, counts):
        flat += plist if len(plist) == n else plist[:n]
    return flat


def _layout(ids: torch.Tensor, prefix: torch.Tensor, new: torch.Tensor, page_counts: torch.Tensor,
            used_pages: torch.Tensor, max_pages: int, page_size: int, is_decode: bool,
            all_logits: bool) -> dict[str, torch.Tensor]:
    batch = prefix.numel()
    seq_lens = prefix + new
    table = torch.zeros(batch, max_pages, dtype=torch.int64)
    table[torch.arange(table.shape[1]) < page_counts[:, None]] = used_pages
    if is_decode:
        rows, positions = torch.arange(batch), prefix
    else:
        rows, within = _runs(new)
        positions = within + prefix[rows]
    out = {
        "input_ids": ids,
        "positions": positions,
        "out_slots": _slots(table, rows, positions, page_size),
        "page_table": table,
        "seq_lens": seq_lens,
        "logits_indices": torch.arange(ids.numel()) if all_logits else torch.cumsum(new, 0) - 1,
    }
    if not is_decode:
        out["context_slots"] = _slots(table, *_runs(seq_lens), page_size)
    return out


def _runs(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each element's run and index in it."""
    rows = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return rows, torch.arange(rows.numel()) - (torch.cumsum(lengths, 0) - lengths)[rows]


def _slots(table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    return table[rows, positions // page_size] * page_size + positions % page_size


def pack_to_device(host: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The step's tensors on ``device`` in one copy (on CPU, as they are)."""
    if device.type == "cpu":
        return host
    flat = torch.empty(sum(t.numel() for t in host.values()), dtype=torch.int64, pin_memory=device.type == "cuda")
    torch.cat([t.reshape(-1) for t in host.values()], out=flat)
    moved = flat.to(device, non_blocking=True)
    ends = list(accumulate(t.numel() for t in host.values()))
    return {name: moved[end - t.numel(): end].view(t.shape) for (name, t), end in zip(host.items(), ends)}
