"""What ``--dtype auto`` picks on this hardware."""
from __future__ import annotations

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo names of the x86 bf16 dot-product instructions


def native_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The bf16 instruction sets this CPU reports (none without /proc/cpuinfo)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in NATIVE_BF16_FLAGS if flag in flags]


def auto_dtype(cuda: bool, cpuinfo: str = "/proc/cpuinfo") -> tuple[str, str]:
    """(dtype, why): bfloat16 on CUDA or a CPU with native bf16, else float32 (emulated bf16 is slower)."""
    if cuda:
        return "bfloat16", "CUDA"
    flags = native_bf16_flags(cpuinfo)
    if flags:
        return "bfloat16", f"CPU with native bf16 ({', '.join(flags)}); --dtype float32 for the float32 reference"
    return "float32", "CPU without native bf16 (no avx512_bf16 or amx_bf16)"
