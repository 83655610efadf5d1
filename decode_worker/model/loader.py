"""Load a HF directory or GGUF file into a LlamaModel and its tokenizer."""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from decode_worker.model.config import ModelConfig, ModelLoadError
from decode_worker.model.gguf_reader import gguf_config, gguf_tensors, open_gguf
from decode_worker.model.llama import LlamaModel
from decode_worker.model.matmul import head_matmul, pack_linears
from decode_worker.model.native import native_kernels
from decode_worker.model.quant import Int4Linear
from decode_worker.model.tokenizer import Tokenizer
from decode_worker.model.weights import load_weights, weights_digest

# Inputs of at least this many rows (tokens in a step) use an int4 layer's wide matmul instead of the int4 kernel:
# the measured crossovers (benchmarks/bench_matmul.py) for bf16 on AVX512-BF16, and for float32 with the native
# kernel (float32 math: it beats packed float32 weights through 32 rows) and with torch's (bf16 math, on AVX2).
INT4_WIDE_FROM_ROWS = {torch.bfloat16: 12, torch.float16: 12, torch.float32: 6}
NATIVE_FLOAT32_WIDE_FROM_ROWS = 48


def int4_wide_from_rows(dtype: torch.dtype) -> int | None:
    if dtype == torch.float32 and native_kernels() is not None:
        return NATIVE_FLOAT32_WIDE_FROM_ROWS
    return INT4_WIDE_FROM_ROWS.get(dtype)


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer | None
    weights_digest: str  # see weights_digest(): part of the KV layout, so checkpoints never share KV
    int4_layers: int = 0  # linear layers kept 4-bit (Int4Linear)


def _safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no *.safetensors weights")
    for f in files:
        try:
            yield from load_file(str(f)).items()
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{f} is not a readable safetensors file: {e}") from e


def read_config(path: Path) -> ModelConfig:
    if path.is_file():
        return gguf_config(open_gguf(path), path.stem)
    try:
        raw = json.loads((path / "config.json").read_text())
    except FileNotFoundError as e:
        raise ModelLoadError(f"{path} has no config.json") from e
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path / 'config.json'} is not valid JSON: {e}") from e
    return ModelConfig.from_hf(raw, path.name)


@contextmanager
def without_random_init() -> Iterator[None]:
    """Build linear and embedding layers without their random init: ``load_weights`` fills every parameter or
    refuses the checkpoint, so the init's cost (a noticeable share of start-up) buys nothing."""
    saved = {cls: cls.reset_parameters for cls in (torch.nn.Linear, torch.nn.Embedding)}
    for cls in saved:
        cls.reset_parameters = lambda self: None
    try:
        yield
    finally:
        for cls, method in saved.items():
            cls.reset_parameters = method


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build parameters in ``dtype`` (casting after would triple the peak)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def keeps_int4(path: Path, dtype: torch.dtype, device: str, low_bit_float32: bool = False) -> bool:
    """Whether Q4_1 weights stay 4-bit: on CPU in 16-bit; in float32 with ``low_bit_float32``, or where the native
    kernels build (their float32 math on the exact weights keeps float32 the reference: wide inputs still use the
    dense float32 weights)."""
    if not path.is_file() or torch.device(device).type != "cpu":
        return False
    return dtype in (torch.bfloat16, torch.float16) or (
        dtype == torch.float32 and (low_bit_float32 or native_kernels() is not None))


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", tokenizer: bool = True,
               int4: bool | None = None, low_bit_float32: bool = False) -> LoadedModel:
    """``int4`` None: ``keeps_int4`` decides; low-bit float32 also reads the vocabulary as fp16. On CPU the dense
    linears and the vocabulary matmul take ``matmul``'s packed forms (a Q8_0 vocabulary its native one)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path not found: {path}")
    int4 = keeps_int4(path, dtype, device, low_bit_float32) if int4 is None else int4
    if path.is_file():
        reader = open_gguf(path)
        config = gguf_config(reader, path.stem)
        tensors = gguf_tensors(reader, config, keep_low_bit=int4)
    else:
        config = read_config(path)
        tensors = _safetensors(path)
    with torch.device(device), default_dtype(dtype), without_random_init():
        model = LlamaModel(config)
    exact = not (dtype == torch.float32 and low_bit_float32)
    # copies cast each tensor into the parameter's dtype
    head_blocks = load_weights(model, tensors, int4_wide_from_rows(dtype) if int4 else None, exact)
    int4_layers = sum(isinstance(m, Int4Linear) for m in model.modules())
    digest = weights_digest(model)  # before packing: packed weights are opaque, and the digest stays what it was
    model.head_matmul = head_matmul(model.head_weight(), low_bit=not exact and int4_layers > 0, q8_blocks=head_blocks)
    pack_linears(model, skip=("lm_head",))
    model.eval()
    tok = Tokenizer.load(path, config.eos_token_ids) if tokenizer else None
    _return_freed_memory()
    return LoadedModel(config, model, tok, digest, int4_layers)


def _return_freed_memory() -> None:
    """Return freed loader memory to the OS."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):  # glibc only
        libc.malloc_trim(0)
