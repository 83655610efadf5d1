"""Decode throughput: the server's scheduler and paged runner (through the offline ``LLM``) vs transformers
`generate` on SmolLM2, same prompts, one run.

Prints one JSON line: tokens/s of both and their ratio per batch size.
Usage: python bench/bench_decode.py [--batches 1 8 32] [--new-tokens 64] [--dtype float32]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from decode_worker.core.sampling import SamplingParams
from decode_worker.engine.llm import LLM
from decode_worker.model.embedded import ensure_default_model

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per batch; medians are reported")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    path = ensure_default_model()
    llm = LLM(str(path), max_total_tokens=32768, page_size=16, dtype=dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=dtype).eval()
    time_ours(llm, chat_ids(llm, 2), 4)  # warm-up both
    time_transformers(hf, chat_ids(llm, 2), 4, 2)
    result = {"bench": "decode", "model": path.name, "dtype": args.dtype, "new_tokens": args.new_tokens,
              "threads": torch.get_num_threads(), "batches": {}}
    for bs in args.batches:
        prompts = chat_ids(llm, bs)
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(time_ours(llm, prompts, args.new_tokens))
            theirs.append(time_transformers(hf, prompts, args.new_tokens, 2))
        o, t = statistics.median(ours), statistics.median(theirs)
        result["batches"][str(bs)] = {"ours_tok_s": round(o, 1), "transformers_tok_s": round(t, 1), "ratio": round(o / t, 2)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
