"""Page copies between the L1 (device) and L2 (host) KV buffers, off the event loop.

One worker thread runs the copies strictly in submission order. That order is what the cache relies on: a
load-back queued after a backup of the same host pages reads the finished backup, and host pages that the
event loop frees can only be rewritten by copies queued later. On CUDA the worker issues each copy on a side
stream through a pinned staging buffer and waits for its event, so neither the event loop nor the compute
stream ever waits on a copy. Every copy returns a ``concurrent.futures.Future``; ``asyncio.wrap_future`` makes
it awaitable.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from decode_worker_kernels.page_copy import copy_pages


class CopyEngine:
    def __init__(self, device_buffer: torch.Tensor, host_buffer: torch.Tensor):
        self.device_buffer = device_buffer
        self.host_buffer = host_buffer
        self._stream = torch.cuda.Stream(device_buffer.device) if device_buffer.is_cuda else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-copy")

    def load(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> Future:
        """L2 -> L1."""
        return self._executor.submit(self._copy, self.host_buffer, self.device_buffer, host_pages, device_pages,
                                     self._caller_event())

    def backup(self, device_pages: torch.Tensor, host_pages: torch.Tensor) -> Future:
        """L1 -> L2."""
        return self._executor.submit(self._copy, self.device_buffer, self.host_buffer, device_pages, host_pages,
                                     self._caller_event())

    def _caller_event(self) -> "torch.cuda.Event | None":
        """Marks the work already queued on the caller's stream (a KV scatter, a forward writing pages): the copy
        must not read or overwrite those pages before it is done."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor,
              after: "torch.cuda.Event | None" = None) -> None:
        if self._stream is None:
            copy_pages(src, dst, src_pages, dst_pages)
            return
        if after is not None:
            self._stream.wait_event(after)
        with torch.cuda.stream(self._stream):
            staged = torch.empty(
                (*src.shape[:2], src_pages.numel(), *src.shape[3:]), dtype=src.dtype, pin_memory=True
            )
            if src.is_cuda:  # backup: gather on the GPU, one D2H copy, scatter on the host
                staged.copy_(src.index_select(2, src_pages.to(src.device)), non_blocking=True)
                self._sync()
                dst.index_copy_(2, dst_pages, staged)
            else:  # load-back: gather on the host, one H2D copy, scatter on the GPU
                torch.index_select(src, 2, src_pages, out=staged)
                dst.index_copy_(2, dst_pages.to(dst.device), staged.to(dst.device, non_blocking=True))
                self._sync()

    def _sync(self) -> None:
        event = torch.cuda.Event()
        event.record(self._stream)
        event.synchronize()
