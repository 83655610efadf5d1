"""Owns the model and its L1 KV pool; runs extend and decode steps."""
from __future__ import annotations

import torch

from decode_worker.cache.pool import KVLayout, KVPool
from decode_worker.core.sampling import SamplingParams
from decode_worker.model.cuda_graph import DecodeGraphs
from decode_worker.model.forward_batch import ForwardBatch
from decode_worker.model.loader import LoadedModel
from decode_worker.model.page_table import PageTableRows
from decode_worker.model.sampler import SampleResult, Shaping, TokenMask, sample


class ModelRunner:
    def __init__(self, loaded: LoadedModel, max_total_tokens: int, page_size: int, cuda_graph_max_bs: int = 0,
                 shared_pool: bool = False):
        """``shared_pool``: a host pool peers on this host may map."""
        self.loaded = loaded
        self.config = loaded.config
        self.model = loaded.model
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.page_size = page_size
        self.layout = KVLayout(
            model_id=f"{self.config.name}@{loaded.weights_digest}",
            num_layers=self.config.num_layers,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            page_size=page_size,
            dtype=self.dtype,
        )
        # One extra page: page 0 is the scratch page that padded decode rows write to.
        self.num_pages = max_total_tokens // page_size + 1
        self.pool = KVPool(self.layout, self.num_pages, self.device, shared=shared_pool)
        max_pages = min(self.config.max_context // page_size + 1, self.num_pages)
        self.rows = PageTableRows(max_pages, self.device)  # running requests' pages, kept on the device
        self.graphs = None
        if cuda_graph_max_bs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(self, cuda_graph_max_bs)

    def build_batch(self, new_tokens: list[list[int]], prefix_lens: list[int], pages: list[list[int]], all_logits: bool = False) -> ForwardBatch:
        return ForwardBatch.build(new_tokens, prefix_lens, pages, self.page_size, self.device, all_logits)

    def build_decode(self, keys: list[str], last_tokens: list[int], prefix_lens: list[int],
                     pages: list[list[int]]) -> ForwardBatch:
        """A decode step through the page-table rows of ``keys``."""
        return self.rows.decode_batch(keys, last_tokens, prefix_lens, pages, self.page_size)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """float32 logits [B, vocab]; a graph's stay valid until its next replay."""
        if self.graphs is not None and fb.is_decode and self.graphs.fits(fb):
            return self.graphs.replay(fb)
        return self.model(fb, self.pool)

    def hidden(self, fb: ForwardBatch) -> torch.Tensor:
        """An extend's final hidden rows, for ``logits`` to turn into logits a slice at a time."""
        return self.model.hidden(fb, self.pool)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    def forward_sample(self, fb: ForwardBatch, params: list[SamplingParams], generators: list[torch.Generator | None],
                       shaping: list[Shaping | None] | None = None, mask: TokenMask | None = None) -> SampleResult:
        """Forward and sample; Python lists out."""
        return sample(self.forward(fb), params, generators, shaping, mask)
