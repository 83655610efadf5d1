"""Model sections: CUDA-graph replay against the eager step, parity with transformers on a Llama-8B-shaped
checkpoint, decode throughput of a 1B-shaped model in a pool sized from free memory, per-step host overhead, and
the batched sampler."""
from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time

import torch

from probe.common import ROOT, SHAPES, device_of, distinct_pages, random_model, synchronize, wall

PAGE = 16
REPLAY_TOLERANCE = 1e-3  # of the largest |logit|; fp32 on both sides, so only batch-shape rounding differs


def churn_allocator(device: str) -> None:
    """Allocate and free many small tensors: the blocks a freed capture temporary would be handed to."""
    for n in range(1, 129):
        torch.full((n,), 10**6, dtype=torch.int64, device=device).add_(1)


def graph_replay(tiny: bool) -> dict:
    """Decode logits from replayed CUDA graphs equal the eager step's, at batch sizes on buckets, between buckets
    (padded rows) and past the largest (eager fallback), after allocator churn. Both sides run float32 and the same
    kernels, so a wrong page, padding row or stale buffer shows as an O(1) difference, far above the tolerance.
    Tiny: CPU stand-in graphs (``EagerGraph``) over a tiny model."""
    from decode_worker.model.cuda_graph import DecodeGraphs
    from decode_worker.model.runner import ModelRunner

    device = device_of(tiny)
    torch.backends.cuda.matmul.allow_tf32 = False
    loaded = random_model("tiny" if tiny else "smollm2", torch.float32, device)
    max_bs, sizes = (8, (1, 5, 8, 9)) if tiny else (256, (1, 5, 64, 65, 256))
    start = time.perf_counter()
    graphs = ModelRunner(loaded, max_total_tokens=32768, page_size=PAGE, cuda_graph_max_bs=max_bs)
    if tiny:
        graphs.graphs = DecodeGraphs(graphs, max_bs)
    capture_s = time.perf_counter() - start
    eager = ModelRunner(loaded, max_total_tokens=32768, page_size=PAGE)
    out: dict = {"buckets": graphs.graphs.buckets, "capture_s": round(capture_s, 2)}
    for bs in sizes:
        prompts = [[(7 * b + 3 * i) % 250 for i in range(20 + (7 * b) % 29)] for b in range(bs)]
        pages = distinct_pages([len(p) for p in prompts], PAGE, seed=bs)
        logits = []
        for runner in (graphs, eager):
            runner.forward(runner.build_batch(prompts, [0] * bs, pages))
            keys = [f"r{b}" for b in range(bs)]
            step = runner.build_decode(keys, [p[-1] for p in prompts], [len(p) for p in prompts], pages)
            churn_allocator(device)
            logits.append(runner.forward(step).float().clone())
            for key in keys:
                runner.rows.release(key)
        scale = logits[1].abs().max().item()
        diff = (logits[0] - logits[1]).abs().max().item()
        out[f"batch_{bs}"] = {"replayed": graphs.graphs.fits(step), "max_abs_diff": diff,
                              "max_abs_logit": round(scale, 3),
                              "ok": diff <= REPLAY_TOLERANCE * max(scale, 1.0)
                              and not torch.isnan(logits[0]).any().item()}
    out["ok"] = all(case["ok"] for key, case in out.items() if key.startswith("batch_"))
    return out


def hf_parity(tiny: bool) -> dict:
    """A random-weight Llama-8B-shaped model cut to 2 layers (Llama-3 RoPE scaling, untied head), saved as a Hugging
    Face checkpoint with transformers, loaded by this project: prefill logits at every position and four greedy
    decode steps against transformers' forward, both in float32 from the same bf16 weights."""
    try:
        import safetensors  # noqa: F401 - the loader reads the checkpoint with it
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        return {"skipped": f"transformers or safetensors is not importable ({exc}): nothing to compare with"}

    from decode_worker.model.loader import load_model
    from decode_worker.model.runner import ModelRunner

    device = device_of(tiny)
    torch.backends.cuda.matmul.allow_tf32 = False
    vocab, hidden, inter, _, heads, kv_heads, head_dim, theta, tied = SHAPES["tiny" if tiny else "llama8b"]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         rope_theta=theta, tie_word_embeddings=tied, max_position_embeddings=8192,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
                         rms_norm_eps=1e-5, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        reference = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        reference.save_pretrained(folder, safe_serialization=True)
        reference = reference.float()  # the very values saved, in float32
        loaded = load_model(folder, dtype=torch.float32, device=device, tokenizer=False)
        io_s = time.perf_counter() - start
    runner = ModelRunner(loaded, max_total_tokens=1024, page_size=PAGE)
    tokens = torch.randint(0, vocab, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    pages = distinct_pages([len(tokens) + 8], PAGE)
    worst, scale, agree = 0.0, 0.0, True
    with torch.inference_mode():
        ours = runner.forward(runner.build_batch([tokens], [0], pages, all_logits=True)).float()
        for step in range(5):
            theirs = reference(torch.tensor([tokens], device=device)).logits[0].float()
            want = theirs if step == 0 else theirs[-1:]
            worst = max(worst, (ours - want).abs().max().item())
            scale = max(scale, want.abs().max().item())
            agree &= bool(torch.equal(ours.argmax(-1), want.argmax(-1)))
            tokens.append(int(theirs[-1].argmax()))
            ours = runner.forward(runner.build_batch([[tokens[-1]]], [len(tokens) - 1], pages)).float()
    return {"layers": 2, "hidden": hidden, "checkpoint_io_s": round(io_s, 1), "max_abs_diff": worst,
            "max_abs_logit": round(scale, 3), "argmax_agree": agree, "ok": worst <= 2e-3 * max(scale, 1.0) and agree}


def decode_throughput(tiny: bool) -> dict:
    """Decode tokens/s at batch 1/64/256 for a 1B-shaped random bf16 model with CUDA graphs, each step built,
    replayed and sampled (greedy) as the scheduler does, over 1K-token contexts. The KV pool is sized from the
    free memory left after the weights (``device_pool_tokens``), as the server does on CUDA."""
    from decode_worker.cache.sizing import MEM_FRACTION_STATIC, device_pool_tokens
    from decode_worker.core.sampling import SamplingParams
    from decode_worker.model.runner import ModelRunner
    from decode_worker.model.sampler import sample

    device = device_of(tiny)
    loaded = random_model("tiny" if tiny else "llama1b", torch.float32 if tiny else torch.bfloat16, device)
    config, dtype = loaded.config, next(loaded.model.parameters()).dtype
    out: dict = {}
    if tiny:
        tokens, batches, ctx, steps, max_bs = 4096, (1, 4), 32, 4, 0
    else:
        tokens = device_pool_tokens(config, PAGE, dtype)  # with the default --mem-fraction-static
        free, total = torch.cuda.mem_get_info()
        batches, ctx, steps, max_bs = (1, 64, 256), 1024, 32, 256
        out.update(total_gb=round(total / 1e9, 1), free_after_weights_gb=round(free / 1e9, 1),
                   mem_fraction_static=MEM_FRACTION_STATIC)
    start = time.perf_counter()
    runner = ModelRunner(loaded, max_total_tokens=tokens, page_size=PAGE, cuda_graph_max_bs=max_bs)
    out.update(pool_tokens=tokens, pool_gb=round(runner.pool.buffer.numel() * runner.pool.buffer.element_size() / 1e9,
                                                  2), setup_s=round(time.perf_counter() - start, 1))
    if not tiny:
        out["free_after_pool_and_graphs_gb"] = round(torch.cuda.mem_get_info()[0] / 1e9, 1)
    for bs in batches:
        keys, last = [f"t{b}" for b in range(bs)], [1] * bs
        pages = distinct_pages([ctx + steps + 3] * bs, PAGE, seed=bs)
        params, gens = [SamplingParams(temperature=0)] * bs, [None] * bs
        times = []
        for i in range(steps + 3):
            t0 = time.perf_counter()
            logits = runner.forward(runner.build_decode(keys, last, [ctx + i] * bs, pages))
            last = sample(logits, params, gens).token_ids
            times.append(time.perf_counter() - t0)
        for key in keys:
            runner.rows.release(key)
        step = statistics.median(times[3:])
        out[f"batch_{bs}"] = {"step_ms": round(step * 1e3, 3), "tokens_per_s": round(bs / step, 1)}
    return out


def step_overhead(tiny: bool) -> dict:
    """Host time of a decode step (build the batch through the persistent page-table rows, launch the graph)
    against the whole step with sampling; and the full rebuild of every page the rows replaced, for comparison."""
    from decode_worker.core.sampling import SamplingParams
    from decode_worker.model.runner import ModelRunner
    from decode_worker.model.sampler import sample

    device = device_of(tiny)
    batch, steps, context = (4, 6, 20) if tiny else (64, 30, 500)
    loaded = random_model("tiny" if tiny else "smollm2", torch.float32 if tiny else torch.bfloat16, device)
    runner = ModelRunner(loaded, max_total_tokens=64 * 1024, page_size=PAGE, cuda_graph_max_bs=0 if tiny else batch)
    prompts = [[(3 * b + i) % 250 for i in range(context)] for b in range(batch)]
    pages = distinct_pages([context + steps + 1] * batch, PAGE)
    runner.forward(runner.build_batch(prompts, [0] * batch, pages))
    keys, tokens, gens = [f"probe{b}" for b in range(batch)], [1] * batch, [None] * batch
    out: dict = {"batch": batch, "context": context,
                 "full_build_ms": median_ms([wall(lambda i=i: runner.build_batch(
                     [[1]] * batch, [context + i] * batch, pages)) for i in range(steps)])}
    for name, p in (("greedy", SamplingParams(temperature=0)), ("top_p", SamplingParams(temperature=0.8, top_p=0.9))):
        build, launch, whole = [], [], []
        for i in range(steps):  # the same positions again for the second mode: its KV is rewritten alike
            t0 = time.perf_counter()
            fb = runner.build_decode(keys, tokens, [context + i] * batch, pages)
            t1 = time.perf_counter()
            logits = runner.forward(fb)
            t2 = time.perf_counter()
            sample(logits, [p] * batch, gens)
            t3 = time.perf_counter()
            build.append(t1 - t0), launch.append(t2 - t1), whole.append(t3 - t0)
        out[name] = {"build_ms": median_ms(build), "launch_ms": median_ms(launch), "step_ms": median_ms(whole)}
    synchronize(device)
    return out


def median_ms(seconds: list[float]) -> float:
    """Median in ms, leaving out the first three (warm-up) steps."""
    return round(statistics.median(seconds[3:]) * 1e3, 3)


def sampling(tiny: bool) -> dict:
    """The batched sampler against the per-row one it replaced (``benchmarks/bench_sampling.py``): wall ms per call,
    read-back included (it is where the host waits)."""
    from decode_worker.model.sampler import sample

    device = device_of(tiny)
    batches, vocab, repeat = ((4,), 500, 2) if tiny else ((64, 256), 49152, 10)
    spec = importlib.util.spec_from_file_location("bench_sampling", ROOT / "benchmarks" / "bench_sampling.py")
    baseline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baseline)
    out = {}
    for bs in batches:
        logits = torch.randn(bs, vocab, device=device) * 4
        for mode in ("greedy", "temperature", "top_k_top_p"):
            params, gens = [baseline.MODES[mode]] * bs, [None] * bs
            new, old = (min(wall(lambda f=f: f(logits, params, gens)) for _ in range(repeat))
                        for f in (sample, baseline.per_row_sample))
            out[f"b{bs}_{mode}"] = {"new_ms": round(new * 1e3, 2), "old_ms": round(old * 1e3, 2),
                                    "ratio": round(new / old, 3)}
    return out
