"""Per-row logit statistics for CPU sampling (``cpu_sampling.c``, built by ``cpu_native``): greedy's pick and the
log-sum-exp that turns a logit into its log-probability, in one pass each, where torch takes an argmax and a whole
log-softmax written out."""
from __future__ import annotations

import ctypes

import torch


def row_stats_cpu(lib: ctypes.CDLL, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logsumexp float64 [B], argmax int64 [B])`` of float32 CPU ``logits`` ``[B, vocab]`` (rows contiguous); the
    argmax is the first of equal maxima, as torch's."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"CPU row statistics take float32 [B, vocab] with contiguous rows, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    rows, vocab = logits.shape
    lse = torch.empty(rows, dtype=torch.float64)
    argmax = torch.empty(rows, dtype=torch.int64)
    lib.row_stats(logits.data_ptr(), rows, vocab, logits.stride(0), lse.data_ptr(), argmax.data_ptr())
    return lse, argmax
