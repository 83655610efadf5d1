"""Decode and prefill throughput: the server's scheduler and paged runner (through the offline ``LLM``) vs
transformers on SmolLM2, same prompts, one run, for the default CPU dtype (``--dtype auto``) and for float32.

Prints one JSON line (and writes it to ``--out``): per dtype, decode tokens/s of both and their ratio per batch size
(greedy, ``generate``), and prefill tokens/s of a ``--prefill-tokens`` prompt (ours: the extend step and the first
token; transformers: one forward). Medians of ``--repeats`` alternating runs. ``auto`` is what ``--dtype auto``
serves: on a CPU without native bf16 that is float32 with the GGUF's low-bit weights (``float32-lowbit``), while
``float32`` is the exact reference (float32 math on the file's exact weights: the native low-bit kernels at few rows
where they build, dense float32 weights at many). The CPU and the load average (start and end) go in the line too.
Usage: python benchmarks/bench_decode.py [--batches 1 8 32] [--new-tokens 64] [--dtypes auto float32] [--out F]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from decode_worker.core.sampling import SamplingParams
from decode_worker.engine.llm import LLM
from decode_worker.core.cpu_features import auto_dtype
from decode_worker.model.embedded import ensure_default_model
from decode_worker.model.matmul import ByRows, PackedLinear
from decode_worker.model.quant import Int4Linear

PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how photosynthesis works in simple terms.",
    "List five tips for staying productive while working from home.",
    "What are the main differences between Python and Rust?",
    "Describe the water cycle.",
    "Give me a recipe for a quick vegetarian dinner.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet.",
]


LLAMA_CPP_BATCH1_TOK_S = 87  # llama.cpp, same Q4_1 file, 2 threads, on the machine the targets were set on


def chat_ids(llm: LLM, n: int) -> list[list[int]]:
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]) for i in range(n)]


def time_ours(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.output_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / elapsed


def time_transformers(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding for generation
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == width + new_tokens
    return len(prompts) * new_tokens / elapsed


def long_prompt(llm: LLM, tokens: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < tokens:
        ids += llm.tokenizer.encode(" ".join(PROMPTS))
    return ids[:tokens]


def time_prefill_ours(llm: LLM, ids: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([ids], SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True))
    return len(ids) / (time.perf_counter() - start)


def time_prefill_transformers(model, ids: list[int]) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model(torch.tensor([ids]))
    return len(ids) / (time.perf_counter() - start)


def head_form(matmul) -> str:
    """The vocabulary matmul's form, as the JSON line records it."""
    if matmul is None:
        return "plain"
    if isinstance(matmul, ByRows):
        return f"{type(matmul.narrow).__name__} below {matmul.wide_from_rows} rows, else {type(matmul.wide).__name__}"
    return type(matmul).__name__


def compare(a: list[float], b: list[float]) -> dict:
    o, t = statistics.median(a), statistics.median(b)
    return {"ours_tok_s": round(o, 1), "transformers_tok_s": round(t, 1), "ratio": round(o / t, 2)}


def bench_dtype(path, dtype: torch.dtype, low_bit: bool, args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    llm = LLM(str(path), max_total_tokens=32768, page_size=16, dtype=dtype, low_bit_float32=low_bit)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=dtype).eval()
    time_ours(llm, chat_ids(llm, 2), 4)  # warm-up both
    time_transformers(hf, chat_ids(llm, 2), 4, 2)
    model = llm.loaded.model
    out = {"int4_layers": llm.loaded.int4_layers, "packed_layers": sum(isinstance(m, PackedLinear) for m in model.layers.modules()),
           "layer_matmul": next((m.form for m in model.modules() if isinstance(m, Int4Linear)), "dense"),
           "head_matmul": head_form(model.head_matmul), "decode": {}}
    for bs in args.batches:
        prompts = chat_ids(llm, bs)
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(time_ours(llm, prompts, args.new_tokens))
            theirs.append(time_transformers(hf, prompts, args.new_tokens, 2))
        out["decode"][str(bs)] = compare(ours, theirs)
    ids = long_prompt(llm, args.prefill_tokens)
    ours, theirs = [], []
    for _ in range(args.repeats):
        ours.append(time_prefill_ours(llm, ids))
        theirs.append(time_prefill_transformers(hf, ids))
    out["prefill"] = {"prompt_tokens": len(ids), **compare(ours, theirs)}
    return out


def modes(names: list[str]) -> dict[str, tuple[torch.dtype, bool]]:
    """Result key -> (dtype, low-bit float32) for each ``--dtypes`` name, duplicates dropped."""
    out = {}
    for name in names:
        low_bit = name == "auto"
        dtype = auto_dtype(torch.cuda.is_available())[0] if low_bit else name
        key = f"{dtype}-lowbit" if low_bit and dtype == "float32" else dtype
        out.setdefault(key, (getattr(torch, dtype), low_bit))
    return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5,
                    help="alternating runs per batch; medians are reported (this machine's speed drifts by a third)")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "float32"], choices=["auto", "float32", "bfloat16"],
                    help="auto: what --dtype auto serves on this machine")
    ap.add_argument("--out", help="also write the JSON line to this file")
    args = ap.parse_args()
    path = ensure_default_model()
    result = {"bench": "decode", "model": path.name, "cpu": cpu_name(), "new_tokens": args.new_tokens,
              "threads": torch.get_num_threads(), "repeats": args.repeats, "llama_cpp_batch1_tok_s": LLAMA_CPP_BATCH1_TOK_S,
              "load_average_start": os.getloadavg()[0], "dtypes": {}}
    for key, (dtype, low_bit) in modes(args.dtypes).items():
        result["dtypes"][key] = bench_dtype(path, dtype, low_bit, args)
        result.setdefault("default_dtype", key if args.dtypes[0] == "auto" else None)
    result["load_average_end"] = os.getloadavg()[0]
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
