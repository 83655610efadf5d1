"""Host memory another process on this host can map: a prefill worker's KV pool, read by its decode peers.

The pool lives in an anonymous memory file (``memfd``) that the owner keeps open; a peer on the same host opens it
through ``/proc/<pid>/fd/<fd>`` and maps it read-only, so it copies pages with a plain memcpy. That is what UCX does
between processes with xpmem; without xpmem it falls back to CMA (``process_vm_readv``), which pins every 4 KB page
it copies and here moves 1 MB in ~0.3 ms against ~0.09 ms for a memcpy (``bench/bench_transfer.py``).

Opening needs the same rights as CMA (the owner's uid, the same PID namespace); where they are missing, or the
peer runs on another host, ``map_region`` says why and the caller reads over the network instead. A region is
named by its host's boot id, the owner's pid and fd, and the file's inode and size, all checked on opening, so a
reused pid or fd never maps someone else's memory.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import select
import threading
import warnings
import weakref
from dataclasses import asdict, dataclass
from functools import cache

import torch

MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux 5.14; Python 3.11's mmap module names neither


@cache
def boot_id() -> str:
    """This host's identity for as long as it runs: two processes with the same boot id share a kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class SharedRegion:
    """Where a peer on this host finds a shared buffer (plain values, JSON-safe: it travels in the PD handshake)."""

    host: str  # boot id
    pid: int
    fd: int
    inode: int
    nbytes: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SharedRegion:
        return cls(str(d["host"]), int(d["pid"]), int(d["fd"]), int(d["inode"]), int(d["nbytes"]))


def shared_zeros(shape: tuple[int, ...], dtype: torch.dtype, owner: object) -> tuple[torch.Tensor, SharedRegion]:
    """A zeroed host tensor in a memory file peers can map, with its pages faulted in now (as ``torch.zeros``
    would) so no copy pays for them later. The file is closed once ``owner`` is collected."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        raise ValueError("a shared buffer needs at least one byte")
    fd = os.memfd_create("decode-worker-kv", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        memory = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        flat = torch.frombuffer(memory, dtype=torch.uint8)  # keeps the mapping alive
        if _madvise(flat.data_ptr(), nbytes, MADV_POPULATE_WRITE) != 0:
            flat.zero_()  # an older kernel: fault the pages in by touching them
        region = SharedRegion(boot_id(), os.getpid(), fd, os.fstat(fd).st_ino, nbytes)
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(owner, os.close, fd)
    return flat.view(dtype).view(shape), region


@dataclass(eq=False)
class MappedRegion:
    """A peer's shared buffer mapped read-only here, with a handle that tells when the peer exits."""

    pages: torch.Tensor  # uint8 ``[num_pages, page_bytes]``; writing through it faults: it is read-only
    pidfd: int

    def owner_exited(self) -> bool:
        return _exited(self.pidfd)

    def close(self) -> None:
        """Forget the mapping: it is unmapped once no copy still holds ``pages``."""
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def map_region(region: SharedRegion, page_bytes: int) -> tuple[MappedRegion | None, str]:
    """Map a peer's region read-only, as pages of ``page_bytes``: ``(mapping, "")``, or ``(None, why not)``."""
    if not region.host or region.host != boot_id():
        return None, "it runs on another host"
    if region.nbytes % page_bytes:
        return None, f"its region of {region.nbytes} bytes is not a whole number of {page_bytes}-byte pages"
    try:
        pidfd = os.pidfd_open(region.pid)  # first: if this is still the owner once the file checks out, it was
    except OSError as e:                  # the owner all along, so a reused pid cannot slip in between
        return None, f"its process {region.pid} cannot be watched ({e.strerror})"
    try:
        fd = os.open(f"/proc/{region.pid}/fd/{region.fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        os.close(pidfd)
        return None, f"its memory file cannot be opened here ({e.strerror})"
    try:
        st = os.fstat(fd)
        if (st.st_ino, st.st_size) != (region.inode, region.nbytes) or _exited(pidfd):
            os.close(pidfd)
            return None, "its memory file is not the one it named (the process or file was replaced)"
        memory = mmap.mmap(fd, region.nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    except BaseException:
        os.close(pidfd)
        raise
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # torch warns that the buffer is read-only: that is the point
        warnings.simplefilter("ignore", UserWarning)
        pages = torch.frombuffer(memory, dtype=torch.uint8).view(-1, page_bytes)
    threading.Thread(target=_populate, args=(pages,), name="kv-map-populate", daemon=True).start()
    return MappedRegion(pages, pidfd), ""


def _exited(pidfd: int) -> bool:
    """Whether the process ``pidfd`` refers to has exited (its pidfd reads ready then)."""
    return bool(select.select([pidfd], [], [], 0)[0])


POPULATE_CHUNK = 8 << 20
"""Bytes of a mapping's page-table entries filled per call: each call holds our address space's lock, and a whole
GB-sized pool in one call held it long enough to delay the first read by ~0.17 s (UCX takes the lock too)."""


def _populate(pages: torch.Tensor) -> None:
    """Fill a new mapping's page-table entries ahead of the reads (which would otherwise fault on every 4 KB page
    they touch first), a chunk at a time, off the caller's path. Holding ``pages`` keeps the mapping alive."""
    base, nbytes = pages.data_ptr(), pages.numel()
    for offset in range(0, nbytes, POPULATE_CHUNK):
        if _madvise(base + offset, min(POPULATE_CHUNK, nbytes - offset), MADV_POPULATE_READ) != 0:
            return  # an older kernel: reads fault the pages in instead


def _madvise(address: int, nbytes: int, advice: int) -> int:
    """``madvise`` through ctypes, which lets go of the GIL for the call (the mmap module's method does not)."""
    return _libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), advice)


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
