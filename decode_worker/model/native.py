"""The native CPU kernels (``decode_worker_kernels.cpu_native``: low-bit matmuls, attention, norm, rotary, activation
and sampling), built once per machine into the cache directory; None where no C compiler builds them (logged), and
then torch's forms serve."""
from __future__ import annotations

import ctypes
import functools

from decode_worker.model.embedded import cache_dir


@functools.cache
def native_kernels() -> ctypes.CDLL | None:
    from decode_worker_kernels import cpu_native

    return cpu_native.load(cache_dir() / "kernels")
