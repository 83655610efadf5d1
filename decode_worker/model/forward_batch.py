"""The tensors one forward pass needs, built from per-request page lists."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """One step over B requests and T new tokens (T == B for decode).

    ``page_table[b]`` lists request b's pages (padded with page 0); ``seq_lens[b]`` counts its tokens
    including the new ones; ``out_slots`` are the pool slots the new tokens' K/V go to.
    """

    is_decode: bool
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T]
    page_table: torch.Tensor  # [B, max_pages]
    seq_lens: torch.Tensor  # [B]
    prefix_lens: list[int]  # tokens already in KV before this step, per request
    logits_indices: torch.Tensor  # [B] row of each request's last new token; all rows when all_logits
    all_logits: bool = False

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
        """Lay out a step. A step where every request adds exactly one token is a decode step."""
        if not new_tokens or any(len(t) == 0 for t in new_tokens):
            raise ValueError("every request in a step needs at least one new token")
        seq_lens = [p + len(t) for p, t in zip(prefix_lens, new_tokens)]
        for n, plist in zip(seq_lens, pages):
            if len(plist) * page_size < n:
                raise ValueError(f"{n} tokens need {-(-n // page_size)} pages, request has {len(plist)}")
        max_pages = max(-(-n // page_size) for n in seq_lens)
        table = torch.zeros(len(pages), max_pages, dtype=torch.int64)
        for b, plist in enumerate(pages):
            used = plist[: -(-seq_lens[b] // page_size)]
            table[b, : len(used)] = torch.as_tensor(used, dtype=torch.int64)
        positions = torch.cat([torch.arange(p, n) for p, n in zip(prefix_lens, seq_lens)])
        rows = torch.repeat_interleave(torch.arange(len(pages)), torch.tensor([len(t) for t in new_tokens]))
        out_slots = table[rows, positions // page_size] * page_size + positions % page_size
        ends = torch.tensor(seq_lens) - torch.tensor(prefix_lens)
        last = torch.cumsum(ends, 0) - 1
        ids = torch.tensor([t for seq in new_tokens for t in seq], dtype=torch.int64)
        return cls(
            is_decode=all(len(t) == 1 for t in new_tokens) and not all_logits,
            input_ids=ids.to(device),
            positions=positions.to(device),
            out_slots=out_slots.to(device),
            page_table=table.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            prefix_lens=list(prefix_lens),
            logits_indices=(torch.arange(ids.numel()) if all_logits else last).to(device),
            all_logits=all_logits,
        )
