"""A prefill's KV pool in a sealed memfd that same-host peers map read-only once checked (docs/security.md)."""
from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import select
import stat
import warnings
import weakref
from dataclasses import dataclass
from functools import cache

import torch

MADV_POPULATE_WRITE = 23  # Linux 5.14; Python 3.11's mmap module does not name it
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""The seals a shared pool carries: its size is fixed for good, so no mapping of it can ever run past its end."""
MEMORY_FILESYSTEMS = {0x01021994: "tmpfs", 0x958458F6: "hugetlbfs"}  # statfs f_type of a memfd's filesystem


@cache
def boot_id() -> str:
    """Two processes with the same boot id share a kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@cache
def mappable_bytes() -> int:
    """The most a peer's pool may claim: this host's physical memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class SharedFile:
    """The owner's side: the memory file, closed once the buffer's owner goes."""

    fd: int
    nbytes: int


def shared_zeros(shape: tuple[int, ...], dtype: torch.dtype, owner: object) -> tuple[torch.Tensor, SharedFile]:
    """A zeroed host tensor in a sealed memfd peers can map, faulted in now; closed with ``owner``."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        raise ValueError("a shared buffer needs at least one byte")
    fd = os.memfd_create("decode-worker-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)  # a memfd is created 0777: anyone who may reach it through /proc could reopen it
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        memory = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        flat = torch.frombuffer(memory, dtype=torch.uint8)  # keeps the mapping alive
        if _madvise(flat.data_ptr(), nbytes, MADV_POPULATE_WRITE) != 0:
            flat.zero_()  # an older kernel: fault the pages in by touching them
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(owner, os.close, fd)
    return flat.view(dtype).view(shape), SharedFile(fd, nbytes)


def check_memory_file(fd: int, nbytes: int, uid: int) -> str:
    """Why ``fd`` must not be mapped as a peer's pool of ``nbytes`` (``""``: it may); looks at ``fd`` only, never
    opens a path or blocks."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return f"it sent a file of type {stat.filemode(st.st_mode)[0]!r}, not a regular file"
    target = os.readlink(f"/proc/self/fd/{fd}")
    if not target.startswith("/memfd:"):
        return f"it sent a file that is not a memory file ({target[:80]!r})"
    filesystem = _filesystem(fd)
    if filesystem not in MEMORY_FILESYSTEMS:
        return f"its memory file lies on filesystem {filesystem:#x}, not tmpfs or hugetlbfs"
    if st.st_uid != uid:
        return f"its memory file belongs to uid {st.st_uid}, not {uid}"
    if stat.S_IMODE(st.st_mode) & 0o077:
        return f"its memory file is open to other users (mode {stat.S_IMODE(st.st_mode):o})"
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & SEALS != SEALS:
        return f"its memory file is not sealed against resizing (seals {seals:#x}, {SEALS:#x} needed)"
    if st.st_size != nbytes:
        return f"its memory file holds {st.st_size} bytes, its pool {nbytes}"
    if st.st_blocks * 512 < nbytes:
        return f"its memory file is sparse: {st.st_blocks * 512} of its {nbytes} bytes are allocated"
    return ""


@dataclass(eq=False)
class MappedRegion:
    """A peer's buffer mapped read-only, and a pidfd that tells when the peer exits."""

    pages: torch.Tensor  # uint8 ``[num_pages, page_bytes]``; writing through it faults: it is read-only
    pidfd: int

    def owner_exited(self) -> bool:
        return exited(self.pidfd)

    def close(self) -> None:
        """Forget the mapping: unmapped once no copy still holds ``pages``."""
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def map_read_only(fd: int, nbytes: int, page_bytes: int, pidfd: int) -> MappedRegion:
    """Map the checked ``fd`` read-only as pages of ``page_bytes``, taking over ``pidfd``; faults in nothing."""
    memory = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    with warnings.catch_warnings():  # torch warns that the buffer is read-only: that is the point
        warnings.simplefilter("ignore", UserWarning)
        pages = torch.frombuffer(memory, dtype=torch.uint8).view(-1, page_bytes)
    return MappedRegion(pages, pidfd)


def exited(pidfd: int) -> bool:
    return bool(select.select([pidfd], [], [], 0)[0])



def _filesystem(fd: int) -> int:
    """``fstatfs``'s ``f_type`` for ``fd`` (``os`` lacks ``fstatfs``)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    if _libc().fstatfs(fd, buf) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return ctypes.c_long.from_buffer(buf).value


def _madvise(address: int, nbytes: int, advice: int) -> int:
    """``madvise`` through ctypes, which releases the GIL (mmap's method does not)."""
    return _libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), advice)


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
