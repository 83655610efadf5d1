"""What an SGLang prefill of our model would hold for a prompt, made with our own model code (run in the main venv):
the prompt's KV per layer as SGLang lays it out (``[token, head, dim]`` for K and V), the first token, and the
greedy answer a colocated worker gives, with each token's logprob. The interop sender serves that KV, so a decode
fed by it must answer the same tokens with the same logprobs.

Run: python tests/interop/reference_kv.py MODEL OUT.pt PAGE_SIZE MAX_NEW_TOKENS ID [ID ...]  ->  a JSON line."""
from __future__ import annotations

import json
import sys

import torch

from decode_worker.cache.pool import PageAllocator
from decode_worker.core.request import GenerateInput
from decode_worker.core.sampling import SamplingParams
from decode_worker.engine.llm import LLM


def main(model: str, out: str, page_size: int, max_new_tokens: int, ids: list[int]) -> dict:
    llm = LLM(model, max_total_tokens=1024, page_size=page_size, load_tokenizer=False)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    stream = llm.scheduler.submit(GenerateInput("reference", ids, params))
    while not llm.scheduler.idle():
        llm.scheduler.step_sync()
    answer, logprobs = [], []  # each token's logprob depends on every byte of the prompt's KV
    while (event := stream.queue.get_nowait()) is not None:
        answer += event.token_ids
        logprobs += event.logprobs
    runner = llm.runner
    pages = PageAllocator(runner.num_pages, reserved=1).alloc(-(-len(ids) // page_size)).tolist()
    logits = runner.forward(runner.build_batch([ids], [0], [pages]))
    kv = runner.pool.page_data(pages)  # [page, layer, K|V, token, head, dim]
    per_layer = kv.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)  # [layer, K|V, token, head, dim]
    torch.save({"k": list(per_layer[:, 0].clone()), "v": list(per_layer[:, 1].clone()),
                "hidden_size": llm.loaded.config.hidden_size, "page_size": page_size}, out)
    first = int(logits[-1].argmax())
    return {"first_token": first, "output_ids": answer, "logprobs": logprobs, "pages": len(pages)}


if __name__ == "__main__":
    model, out, page_size, max_new = sys.argv[1:5]
    print(json.dumps(main(model, out, int(page_size), int(max_new), [int(t) for t in sys.argv[5:]])))
