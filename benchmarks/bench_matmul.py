"""The CPU matmul choices for SmolLM2's 30 layers of distinct weights (cache-cold, as in the model) and its
vocabulary matrix, float32 in and out, per number of rows.

Variants: ``dense`` (float32 GEMM, what transformers runs), ``packed`` (float32, the weight reordered once for
oneDNN), ``int4`` (torch's int4 kernel, activations in bf16: its only vectorized x86 path), ``fp16`` (fbgemm's
fp16-packed GEMM), ``int8`` (torch's int8 weight-only kernel, bf16 activations), ``bf16`` and ``bf16_packed`` (a bf16
weight, plain or reordered once; activations cast to bf16), ``native`` and ``native_bf16`` (``kernels/decode_worker_kernels/cpu_lowbit.c``
as the model uses it: Q4_1 layers and a Q8_0 vocabulary matrix, float32 math; activations float32 or bf16). Prints
one JSON line: median ms per pass and the ratio to
dense in the same run.
Usage: python benchmarks/bench_matmul.py [--rows 1 4 8 16 32] [--variants dense packed int4 fp16 int8 native] [--repeats 7]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD_SHAPE = (49152, 576)
NUM_LAYERS = 30
Matmul = Callable[[torch.Tensor], torch.Tensor]


def make(variant: str, rows: int, cols: int, g: torch.Generator) -> Matmul:
    w = torch.randn(rows, cols, generator=g) * 0.05
    if variant == "dense":
        return lambda x: torch.nn.functional.linear(x, w)
    if variant in ("packed", "bf16", "bf16_packed"):
        weight = w if variant == "packed" else w.bfloat16()
        packed = weight if variant == "bf16" else torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        if variant == "bf16":
            return lambda x: torch.nn.functional.linear(x.to(weight.dtype), weight).float()
        return lambda x: torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), packed, None, "none", [], "").float()
    if variant == "fp16":
        packed = torch.ops.quantized.linear_prepack_fp16(w, None)
        return lambda x: torch.ops.quantized.linear_dynamic_fp16(x, packed)
    if variant == "int4":
        codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        table = (torch.rand(cols // 32, rows, 2, generator=g) * 0.01).bfloat16()
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, 32, table).float()
    if variant == "int8":
        w8 = torch.randint(-127, 128, (rows, cols), generator=g, dtype=torch.int8)
        scales = torch.rand(rows, generator=g).bfloat16()
        return lambda x: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), w8, scales).float()
    if variant in ("native", "native_bf16"):
        from decode_worker_kernels.cpu_lowbit import LowBitMatmul

        from decode_worker.model.native import native_kernels

        lib = native_kernels()
        if lib is None:
            raise SystemExit("the native low-bit kernels did not build here (see the warning)")
        scale = torch.rand(rows, cols // 32, generator=g) * 0.01
        if (rows, cols) == HEAD_SHAPE:
            codes = torch.randint(-127, 128, (rows, cols), generator=g, dtype=torch.int8)
            matmul = LowBitMatmul.q8_0(lib, codes, scale, out_dtype=torch.float32)
        else:
            codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
            matmul = LowBitMatmul.q4_1(lib, codes, scale, -8 * scale, out_dtype=torch.float32)
        return matmul if variant == "native" else lambda x: matmul(x.bfloat16())
    raise ValueError(variant)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench_variant(variant: str, rows_list: list[int], repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    layers = [{name: make(variant, *shape, g) for name, shape in LAYER_SHAPES.items()} for _ in range(NUM_LAYERS)]
    head = make(variant, *HEAD_SHAPE, g)
    out = {}
    for rows in rows_list:
        xs = {name: torch.randn(rows, shape[1], generator=g) for name, shape in LAYER_SHAPES.items()}
        x_head = torch.randn(rows, HEAD_SHAPE[1], generator=g)
        out[str(rows)] = {
            "layers_ms": median_ms(lambda: [f(xs[n]) for layer in layers for n, f in layer.items()], repeats),
            "head_ms": median_ms(lambda: head(x_head), repeats),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--variants", nargs="+", default=["dense", "packed", "int4", "fp16", "int8", "native"])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    results = {v: bench_variant(v, args.rows, args.repeats) for v in dict.fromkeys(["dense", *args.variants])}
    for variant, per_rows in results.items():
        for rows, parts in per_rows.items():
            for part in list(parts):
                parts[part] = round(parts[part], 2)
                parts[f"{part.removesuffix('_ms')}_vs_dense"] = round(parts[part] / results["dense"][rows][part], 2)
    print(json.dumps({"bench": "matmul", "threads": torch.get_num_threads(), "results": results}))


if __name__ == "__main__":
    main()
