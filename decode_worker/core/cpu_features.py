"""What ``--dtype auto`` picks: bfloat16 where the hardware computes it natively, float32 elsewhere on CPU."""
from __future__ import annotations

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo names of the x86 bf16 dot-product instructions


def native_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The bf16 instruction sets this CPU reports (none where the file is missing, e.g. not Linux)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in NATIVE_BF16_FLAGS if flag in flags]


def auto_dtype(cuda: bool, cpuinfo: str = "/proc/cpuinfo") -> tuple[str, str]:
    """(dtype, why): bfloat16 on CUDA, float32 on CPU. A CPU with native bf16 decodes faster in bfloat16 (int4
    layers included), but the embedded 135M model's answers move with bf16 rounding: "What is the capital of
    France?" starts at a float32 near-tie ("The" over "L" by 0.08 logits, against bf16 errors of about 1) and our
    bf16 takes the other branch, so bf16 is opt-in (``--dtype bfloat16``) there."""
    if cuda:
        return "bfloat16", "CUDA"
    flags = native_bf16_flags(cpuinfo)
    if flags:
        return "float32", f"CPU; its native bf16 ({', '.join(flags)}) is opt-in with --dtype bfloat16"
    return "float32", "CPU without native bf16 (no avx512_bf16 or amx_bf16)"
