"""The native CPU kernels (``cpu_lowbit.c``: low-bit weight matmuls; ``cpu_attention.c``: paged decode attention;
``cpu_norm.c``: RMS norm over a float64 residual stream; ``cpu_rope.c``: rotary embedding and KV store;
``cpu_activation.c``: SwiGLU's activation; ``cpu_sampling.c``: greedy's pick and the log-sum-exp), built into one
library.

The C files are compiled on first use with the system's C compiler for this CPU (``-march=native``) into a cache
directory keyed by the sources, the compiler and the CPU (a read-only cache, as in a pod, falls back to a private
directory under the temp dir); where that fails, ``load`` returns None and callers keep torch's forms.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
DTYPES = (torch.float32, torch.bfloat16)  # what every kernel reads and writes (a flag bit per tensor says which)
SOURCES = [HERE / name for name in ("cpu_lowbit.c", "cpu_attention.c", "cpu_norm.c", "cpu_rope.c",
                                         "cpu_activation.c", "cpu_sampling.c")]
HEADERS = [HERE / "cpu_native.h"]
ABI = 2
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


def load(cache: Path) -> ctypes.CDLL | None:
    """The compiled kernels (built into ``cache`` once per source, compiler and CPU), or None where they cannot be
    built here, with the reason logged. Callers keep the result: each call checks the compiler's version."""
    try:
        return _open(_build(cache if _private(cache) else _private_temp_dir()))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        log.warning("native CPU kernels unavailable (%s); using torch's forms", e)
        return None


def _private(directory: Path) -> bool:
    """Whether ``directory`` (made 0700 if missing) is one that only this user (or root) can have put files in:
    ours, writable by nobody else, no symlink anywhere on its path, and every folder above it owned by us or root
    and writable by nobody else unless sticky (as /tmp). A library in any other folder could be another user's."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            return False
        path = Path(os.path.abspath(directory))
        for at in [path, *path.parents]:
            st = at.lstat()
            owners = (os.getuid(),) if at == path else (os.getuid(), 0)
            if stat.S_ISLNK(st.st_mode) or st.st_uid not in owners:
                return False
            if st.st_mode & 0o022 and (at == path or not st.st_mode & stat.S_ISVTX):
                return False
        return True
    except OSError:
        return False


def _safe_to_load(path: Path) -> None:
    """Raise unless ``path`` is a plain file of ours that nobody else may write."""
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(f"{path} is not a library file of this user's alone: not loaded")


def _private_temp_dir() -> Path:
    """``$TMPDIR/decode-worker-kernels-<uid>``, mode 0700 and ours: a library another user could have planted is
    never loaded."""
    directory = Path(tempfile.gettempdir()) / f"decode-worker-kernels-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    st = directory.lstat()
    if not directory.is_dir() or directory.is_symlink() or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeError(f"{directory} is not a private directory of this user")
    return directory


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc) on PATH")
    return cc


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path(cache: Path) -> Path:
    """Where ``cache`` holds the library built from these sources by this compiler for this CPU."""
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    texts = [path.read_text() for path in SOURCES + HEADERS]
    key = hashlib.sha256("\0".join([*texts, cc, version, " ".join(_FLAGS), _cpu_flags()]).encode())
    return cache / f"cpu_native-{key.hexdigest()[:16]}.so"


def _build(cache: Path) -> Path:
    cc, target = _compiler(), library_path(cache)
    if target.exists():
        _safe_to_load(target)
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=cache, suffix=".so.partial")
    os.close(fd)
    try:
        done = subprocess.run([cc, *_FLAGS, *map(str, SOURCES), "-o", partial, "-lm"], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[:500]}")
        os.chmod(partial, 0o755)  # whatever the umask: _safe_to_load refuses a file others may write
        os.replace(partial, target)  # atomic: concurrent builders each publish a whole file
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    if lib.native_abi() != ABI:
        raise RuntimeError(f"{path} has ABI {lib.native_abi()}, expected {ABI}")
    ptr, i64, flag = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for fn in (lib.q4_1_matmul, lib.q8_0_matmul):
        fn.argtypes, fn.restype = [ptr, flag, i64, i64, ptr, ptr, i64, ptr, flag], ctypes.c_int
    lib.paged_decode_attention.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64, i64, ptr, i64, i64, i64,
                                           i64, ctypes.c_float, ptr, flag]
    lib.paged_decode_attention.restype = ctypes.c_int
    lib.rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_double, ptr, flag]
    lib.rms_norm.restype = None
    lib.rope_store.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr, flag]
    lib.rope_store.restype = ctypes.c_int
    lib.silu_mul.argtypes, lib.silu_mul.restype = [ptr, i64, i64, ptr, flag], None
    lib.row_stats.argtypes, lib.row_stats.restype = [ptr, i64, i64, i64, ptr, ptr], None
    return lib
