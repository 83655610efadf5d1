"""The native CPU paged decode attention equals attention over the gathered pages (the float64 reference) up to
float32 rounding, for GQA groups, head sizes, page sizes and lengths (0, within a page, across pages, long), on a
pool whose layer pages are strided apart as the real one; bf16 rounds only its output; bad page tables are refused."""
from __future__ import annotations

import pytest
import torch
from decode_worker_kernels.cpu_attention import paged_decode_attention_cpu
from decode_worker_kernels.paged_attention import paged_decode_attention_reference


def case(dtype: torch.dtype, *, batch: int, group: int, kv_heads: int, head_dim: int, page_size: int,
         lengths: list[int], seed: int = 0) -> dict:
    """One layer of a two-layer pool (pages strided apart), each request on its own shuffled pages."""
    g = torch.Generator().manual_seed(seed)
    pages_per_req = max(-(-n // page_size) for n in lengths) + 1
    num_pages = batch * pages_per_req + 1
    pool = torch.randn(num_pages, 2, 2, page_size, kv_heads, head_dim, generator=g).to(dtype)
    table = (torch.randperm(num_pages - 1, generator=g)[: batch * pages_per_req] + 1).view(batch, pages_per_req)
    return {"q": torch.randn(batch, kv_heads * group, head_dim, generator=g).to(dtype),
            "k_pages": pool[:, 1, 0], "v_pages": pool[:, 1, 1], "page_table": table,
            "seq_lens": torch.tensor(lengths), "scale": head_dim ** -0.5}


def exact(inputs: dict) -> torch.Tensor:
    wide = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    return paged_decode_attention_reference(**wide)


SHAPES = [  # group, kv_heads, head_dim, page_size, lengths (4 requests or more: a task takes several kv heads)
    (3, 3, 64, 16, [1, 16, 17, 40]),  # SmolLM2's heads; a page exactly full, one token over
    (2, 4, 64, 16, [5, 33, 70, 2, 16, 1, 48, 9]),  # 8 requests: 4 kv heads (8 query rows) a task
    (1, 4, 16, 5, [0, 3, 11, 25]),  # plain MHA; pages that cut the 16-slot chunks; a request of length 0
    (8, 1, 128, 64, [300, 1]),  # a wide GQA group, long context over big pages
    (4, 2, 32, 1, [7, 2]),  # one slot per page
    (4, 2, 128, 16, [130, 64, 15, 3]),  # Llama-3-8B's heads (compiled with its sizes as constants)
]


@pytest.mark.parametrize("group,kv_heads,head_dim,page_size,lengths", SHAPES)
def test_float32_is_attention_over_the_gathered_pages_up_to_float32_rounding(native_lib, group, kv_heads, head_dim,
                                                                             page_size, lengths):
    inputs = case(torch.float32, batch=len(lengths), group=group, kv_heads=kv_heads, head_dim=head_dim,
                  page_size=page_size, lengths=lengths)
    ours = paged_decode_attention_cpu(native_lib, **inputs)
    reference = paged_decode_attention_reference(**inputs)
    truth = exact(inputs)
    assert ours.dtype == torch.float32 and ours.shape == inputs["q"].shape
    assert (ours.double() - truth).abs().max() <= max(2e-6, 2 * (reference.double() - truth).abs().max())
    if 0 in lengths:
        assert torch.equal(ours[lengths.index(0)], torch.zeros_like(ours[0]))  # zeros, not NaN


@pytest.mark.parametrize("group,kv_heads,head_dim,page_size,lengths", SHAPES)
def test_bf16_rounds_only_its_output(native_lib, group, kv_heads, head_dim, page_size, lengths):
    """bf16 K/V and queries are widened exactly (or multiplied exactly by the bf16 dot-product instruction) and the
    math runs in float32: the result is the exact attention of the bf16 values, rounded once to bf16."""
    inputs = case(torch.bfloat16, batch=len(lengths), group=group, kv_heads=kv_heads, head_dim=head_dim,
                  page_size=page_size, lengths=lengths, seed=1)
    ours = paged_decode_attention_cpu(native_lib, **inputs)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.double(), exact(inputs), rtol=2 ** -8, atol=1e-5)


def test_the_model_step_gives_the_gathered_sdpa_logits(native_lib, tiny_models, monkeypatch):
    """A whole decode step through the runner: native attention and the gathered SDPA give the same logits."""
    from decode_worker.model import attention
    from decode_worker.model.loader import load_model
    from decode_worker.model.runner import ModelRunner

    runner = ModelRunner(load_model(tiny_models["llama"], tokenizer=False), max_total_tokens=256, page_size=4)
    runner.forward(runner.build_batch([list(range(1, 10)), list(range(20, 33))], [0, 0], [[1, 2, 3], [4, 5, 6, 7]]))
    decode = runner.build_batch([[5], [6]], [9, 13], [[1, 2, 3], [4, 5, 6, 7]])
    native = runner.forward(decode)
    monkeypatch.setattr(attention, "native_kernels", lambda: None)
    torch.testing.assert_close(native, runner.forward(decode), rtol=1e-5, atol=1e-5)


def test_a_short_extend_over_a_cached_prefix_gives_the_sdpa_logits(native_lib, tiny_models, monkeypatch):
    """Extends of requests up to ``NATIVE_EXTEND_MAX_TOKENS`` long run the native kernel, one query per new token over
    its request's slots up to itself: every position's logits equal the per-request SDPA's (prefix cached or not)."""
    from decode_worker.model import attention
    from decode_worker.model.loader import load_model
    from decode_worker.model.runner import ModelRunner

    runner = ModelRunner(load_model(tiny_models["llama"], tokenizer=False), max_total_tokens=256, page_size=4)
    pages = [[1, 2, 3, 4], [5, 6, 7]]
    runner.forward(runner.build_batch([list(range(1, 9)), list(range(20, 24))], [0, 0], pages))  # cached prefixes
    extend = runner.build_batch([[9, 10, 11, 12, 13], [24, 25, 26]], [8, 4], pages, all_logits=True)
    plan = attention.plan_step(runner.pool, extend, runner.config.num_heads)
    assert plan.token_table is not None and plan.context_rows is None
    native = runner.forward(extend)
    monkeypatch.setattr(attention, "NATIVE_EXTEND_MAX_TOKENS", 0)
    torch.testing.assert_close(native, runner.forward(extend), rtol=1e-5, atol=1e-5)


def test_bad_tables_and_shapes_are_refused(native_lib):
    inputs = case(torch.float32, batch=2, group=3, kv_heads=3, head_dim=64, page_size=16, lengths=[20, 5])
    bad_page = dict(inputs, page_table=inputs["page_table"].clone())
    bad_page["page_table"][1, 0] = inputs["k_pages"].shape[0]  # one past the pool
    with pytest.raises(ValueError, match="page index outside"):
        paged_decode_attention_cpu(native_lib, **bad_page)
    too_long = dict(inputs, seq_lens=torch.tensor([20, 16 * inputs["page_table"].shape[1] + 1]))
    with pytest.raises(ValueError, match="length outside the page table"):
        paged_decode_attention_cpu(native_lib, **too_long)
    with pytest.raises(ValueError, match="does not take"):
        paged_decode_attention_cpu(native_lib, **dict(inputs, q=inputs["q"][:, :8]))  # 8 query heads over 3 kv heads
    with pytest.raises(ValueError, match="float32 or bf16"):
        paged_decode_attention_cpu(native_lib, **dict(inputs, q=inputs["q"].half()))
    with pytest.raises(ValueError, match="each page contiguous"):
        padded = torch.randn(*inputs["k_pages"].shape[:3], 128)[..., :64]  # rows 128 apart within a page
        paged_decode_attention_cpu(native_lib, **dict(inputs, k_pages=padded, v_pages=padded))
