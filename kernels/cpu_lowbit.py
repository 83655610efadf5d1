"""Low-bit weight matmuls for CPU (``cpu_lowbit.c``): Q4_1 and Q8_0 blocks stay low-bit in memory and are
dequantized exactly, in float32, inside the matmul. torch's own int4 kernel rounds activations and scales to bf16
on x86 and has no 8-bit block form; this one keeps float32's numbers, so even the float32 reference path can read
a quarter of its weight bytes.

The C file is compiled on first use with the system's C compiler for this CPU (``-march=native``) into a cache
directory keyed by the source, the compiler and the CPU (a read-only cache, as in a pod, falls back to a private
directory under the temp dir); where that fails, ``load`` returns None and callers keep torch's forms.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_lowbit.c")
LANES = 16  # outputs per weight tile
BLOCK = 32  # values per Q4_1 / Q8_0 block
ABI = 1
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


def load(cache: Path) -> ctypes.CDLL | None:
    """The compiled kernels (built into ``cache`` once per source, compiler and CPU), or None where they cannot be
    built here, with the reason logged. Callers keep the result: each call checks the compiler's version."""
    try:
        return _open(_build(cache if _writable(cache) else _private_temp_dir()))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        log.warning("low-bit CPU kernels unavailable (%s); using torch's matmul forms", e)
        return None


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK | os.X_OK)


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


def _build(cache: Path) -> Path:
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, version, " ".join(_FLAGS), _cpu_flags()]).encode())
    target = cache / f"cpu_lowbit-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=cache, suffix=".so.partial")
    os.close(fd)
    try:
        done = subprocess.run([cc, *_FLAGS, str(SOURCE), "-o", partial], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[:500]}")
        os.replace(partial, target)  # atomic: concurrent builders each publish a whole file
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    if lib.lowbit_abi() != ABI:
        raise RuntimeError(f"{path} has ABI {lib.lowbit_abi()}, expected {ABI}")
    args = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    for fn in (lib.q4_1_matmul, lib.q8_0_matmul):
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def tileable(rows: int, cols: int) -> bool:
    """Whether a ``[rows, cols]`` weight fits the kernels' tiles."""
    return rows % LANES == 0 and cols % BLOCK == 0


def _tiles(per_row: torch.Tensor) -> torch.Tensor:
    """``[N, ...]`` into ``[N / 16, ..., 16]``: the tile's 16 outputs innermost."""
    n = per_row.shape[0]
    return per_row.reshape(n // LANES, LANES, *per_row.shape[1:]).movedim(1, -1).contiguous()


class LowBitMatmul:
    """``x @ W.T`` over a Q4_1 or Q8_0 ``W``; ``x`` float32 or bf16 with rows contiguous; the output in ``out_dtype``
    (default: ``x``'s)."""

    def __init__(self, lib: ctypes.CDLL, kind: str, codes: torch.Tensor, tables: torch.Tensor, shape: tuple[int, int],
                 out_dtype: torch.dtype | None):
        self.kind = kind
        self.kernel = lib.q4_1_matmul if kind == "q4_1" else lib.q8_0_matmul
        self.codes, self.tables = codes, tables
        self.out_features, self.in_features = shape
        self.out_dtype = out_dtype

    @classmethod
    def q4_1(cls, lib: ctypes.CDLL, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
             out_dtype: torch.dtype | None = None) -> "LowBitMatmul":
        """``codes``: uint8 ``[N, K]`` of 0..15; ``scale``, ``minimum``: ``[N, K / 32]``; ``W = scale * codes + minimum``."""
        n, k = codes.shape
        if not tileable(n, k):
            raise ValueError(f"a Q4_1 weight of shape {(n, k)} does not tile")
        pairs = codes.reshape(n, k // 2, 2)
        packed = _tiles((pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8))
        tables = _tiles(torch.stack((scale, minimum), dim=2).float())  # [N/16, K/32, 2, 16]
        return cls(lib, "q4_1", packed, tables, (n, k), out_dtype)

    @classmethod
    def q8_0(cls, lib: ctypes.CDLL, codes: torch.Tensor, scale: torch.Tensor,
             out_dtype: torch.dtype | None = None) -> "LowBitMatmul":
        """``codes``: int8 ``[N, K]``; ``scale``: ``[N, K / 32]``; ``W = scale * codes``."""
        n, k = codes.shape
        if not tileable(n, k):
            raise ValueError(f"a Q8_0 weight of shape {(n, k)} does not tile")
        return cls(lib, "q8_0", _tiles(codes.to(torch.int8)), _tiles(scale.float()), (n, k), out_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16) or x.shape[-1] != self.in_features:
            raise ValueError(f"low-bit matmul takes float32 or bf16 [..., {self.in_features}], got {x.dtype} "
                             f"{tuple(x.shape)}")
        flat = x.reshape(-1, self.in_features)
        flat = flat if flat.is_contiguous() else flat.contiguous()
        out_dtype = self.out_dtype or x.dtype
        out = torch.empty(flat.shape[0], self.out_features, dtype=out_dtype)
        if flat.shape[0]:
            status = self.kernel(flat.data_ptr(), flat.dtype == torch.bfloat16, flat.shape[0], self.in_features,
                                 self.codes.data_ptr(), self.tables.data_ptr(), self.out_features, out.data_ptr(),
                                 out_dtype == torch.bfloat16)
            if status != 0:
                raise MemoryError("low-bit matmul could not convert its bf16 input")
        return out.view(*x.shape[:-1], self.out_features)
