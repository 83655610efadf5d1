"""Constrained-decoding overhead per output token: decode tokens/s of a batch with a JSON schema against the same
batch without one, same prompts, same model (the embedded SmolLM2 through the offline ``LLM``'s scheduler, which is
the server's scheduler and sampler), one run.

The schema asks for far more output than ``--new-tokens`` allows, so no constrained row finishes early and the batch
stays full; the free rows ignore end-of-sequence for the same reason. Each scheduler step past the first (which
runs the prompts) is one decode step of the whole batch, timed whole: the mask fill, the forward, the masked
sampling and the matchers' advance. Tokens/s is the batch over the median step, so a step slowed by another
process on the machine moves it little. Modes alternate for ``--reps`` runs after one warm-up each (which also
compiles the schema). Prints one JSON line.
Usage: python benchmarks/bench_grammar.py [--batch 8] [--new-tokens 64] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from decode_worker.core.request import GenerateInput
from decode_worker.core.sampling import SamplingParams
from decode_worker.engine.llm import LLM
from decode_worker.model.embedded import ensure_default_model

PROMPTS = [
    "List the planets of the solar system with one fact about each.",
    "Give me notes on the history of Rome.",
    "Write down ideas for a birthday party.",
    "What should I pack for a week of hiking?",
    "Name things you can cook with eggs.",
    "Describe the rules of chess.",
    "Give tips for learning a new language.",
    "List famous paintings and their painters.",
]
# A notes list far longer than any run here: every constrained row decodes to its token limit.
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 60},
    "notes": {"type": "array", "minItems": 200, "items": {"type": "object", "properties": {
        "text": {"type": "string", "maxLength": 80}, "score": {"type": "integer"}}, "required": ["text", "score"]}}},
    "required": ["title", "notes"]}


def decode_steps(llm: LLM, prompts: list[list[int]], grammar: dict, new_tokens: int) -> list[float]:
    """Seconds of each decode step of one batch (every step after the one that runs the prompts)."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True, **grammar)
    compiled = llm.grammars.compile_now(params) if grammar else None
    streams = [llm.scheduler.submit(GenerateInput(f"{i}-{time.monotonic_ns()}", p, params), compiled)
               for i, p in enumerate(prompts)]
    steps = []
    while not llm.scheduler.idle():
        start = time.perf_counter()
        llm.scheduler.step_sync()
        steps.append(time.perf_counter() - start)
    llm.cache.flush()
    for stream in streams:
        tokens = 0
        while (event := stream.queue.get_nowait()) is not None:
            tokens += len(event.token_ids)
        assert tokens == new_tokens, f"a row stopped after {tokens} tokens"
    return steps[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    dtype = torch.float32  # the CPU default (--dtype auto)
    llm = LLM(str(ensure_default_model()), max_total_tokens=16384, dtype=dtype)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
               for i in range(args.batch)]
    modes = {"free": {}, "json_schema": {"json_schema": json.dumps(SCHEMA)}}
    for grammar in modes.values():  # warm-up: first-use costs (and the schema's compile) stay out of the figures
        decode_steps(llm, prompts, grammar, 4)
    steps: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.reps):
        for name, grammar in modes.items():
            steps[name] += decode_steps(llm, prompts, grammar, args.new_tokens)
    free, constrained = (args.batch / statistics.median(steps[name]) for name in modes)
    print(json.dumps({
        "bench": "grammar", "model": "SmolLM2-135M-Instruct", "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "batch": args.batch, "new_tokens": args.new_tokens, "reps": args.reps,
        "free_tok_s": round(free, 1), "json_schema_tok_s": round(constrained, 1),
        "ratio": round(constrained / free, 3), "overhead_pct": round(100 * (1 - constrained / free), 1),
        "median_step_ms": {name: round(1000 * statistics.median(v), 2) for name, v in steps.items()},
        "steps": {name: len(v) for name, v in steps.items()},
    }))


if __name__ == "__main__":
    main()
