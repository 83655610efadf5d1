"""``ForwardBatch.build`` lays a step out exactly as a request-by-request build would, and extend attention slices
it without reading the device."""
from __future__ import annotations

import random

import pytest
import torch

from decode_worker.cache.pool import KVLayout, KVPool
from decode_worker.model.attention import attend, plan_step
from decode_worker.model.forward_batch import ForwardBatch

PAGE = 4
CPU = torch.device("cpu")


def row_by_row(new_tokens, prefix_lens, pages, all_logits=False) -> dict[str, list]:
    """The layout spelled out one request and one token at a time."""
    seq_lens = [p + len(t) for p, t in zip(prefix_lens, new_tokens)]
    width = max(-(-n // PAGE) for n in seq_lens)
    table = [plist[: -(-n // PAGE)] + [0] * (width - -(-n // PAGE)) for plist, n in zip(pages, seq_lens)]
    positions, slots, last, context = [], [], [], []
    for b, (prefix, n) in enumerate(zip(prefix_lens, seq_lens)):
        positions += list(range(prefix, n))
        slots += [table[b][t // PAGE] * PAGE + t % PAGE for t in range(prefix, n)]
        context += [table[b][t // PAGE] * PAGE + t % PAGE for t in range(n)]
        last.append(len(positions) - 1)
    return {"input_ids": [t for seq in new_tokens for t in seq], "positions": positions, "out_slots": slots,
            "page_table": table, "seq_lens": seq_lens, "context_slots": context,
            "logits_indices": list(range(len(positions))) if all_logits else last}


def random_step(rng: random.Random, decode: bool):
    batch = rng.randrange(1, 9)
    prefix = [rng.randrange(0, 40) for _ in range(batch)]
    new = [[rng.randrange(1000) for _ in range(1 if decode else rng.randrange(1, 12))] for _ in range(batch)]
    free = rng.sample(range(1, 200), 200 - 1)
    # Some requests hold a page more than the step needs (the scheduler allocates ahead).
    pages = [[free.pop() for _ in range(-(-(p + len(t)) // PAGE) + rng.randrange(2))] for p, t in zip(prefix, new)]
    return new, prefix, pages


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("all_logits", [False, True])
def test_build_matches_a_row_by_row_layout(decode: bool, all_logits: bool):
    rng = random.Random(5)
    for _ in range(30):
        new, prefix, pages = random_step(rng, decode)
        fb = ForwardBatch.build(new, prefix, pages, PAGE, CPU, all_logits=all_logits)
        want = row_by_row(new, prefix, pages, all_logits)
        assert fb.is_decode == (decode and not all_logits)
        for name, value in want.items():
            got = getattr(fb, name)
            if name == "context_slots" and fb.is_decode:
                assert got is None
                continue
            assert got.dtype == torch.int64 and got.tolist() == value, name
        assert fb.prefix_lens == prefix and (fb.is_decode or fb.host_seq_lens == want["seq_lens"])


def test_build_refuses_what_it_cannot_lay_out():
    with pytest.raises(ValueError, match="at least one new token"):
        ForwardBatch.build([[1], []], [0, 0], [[1], [2]], PAGE, CPU)
    with pytest.raises(ValueError, match="9 tokens need 3 pages, request has 2"):
        ForwardBatch.build([[1]], [8], [[1, 2]], PAGE, CPU)


def test_extend_attention_reads_nothing_back(monkeypatch: pytest.MonkeyPatch):
    """Lengths come from the host: no ``int()``/``.item()``/``.tolist()`` of a tensor per request per layer."""
    layout = KVLayout("t", 1, 2, 8, PAGE, torch.float32)
    pool = KVPool(layout, 16)
    pool.buffer.normal_()
    fb = ForwardBatch.build([[1, 2, 3], [4, 5]], [0, 6], [[1, 2], [3, 4]], PAGE, CPU)
    q = torch.randn(5, 4, 8)
    plan = plan_step(pool, fb, q_heads=4)
    expected = attend(pool, 0, fb, plan, q, 0.3)
    reads = []
    for name in ("tolist", "item", "__int__", "__index__", "__bool__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name: reads.append(_n) or _o(self, *a))
    out = attend(pool, 0, fb, plan, q, 0.3)
    assert reads == [] and torch.equal(out, expected)


@pytest.mark.parametrize("native", [True, False], ids=["native-attention", "gathered-sdpa"])
def test_a_decode_step_reads_the_device_once_not_once_per_layer(tiny_models, monkeypatch: pytest.MonkeyPatch,
                                                                  native: bool):
    """The step's indices (KV rows, pages, mask) are planned once for every layer: the CPU decode step's only read
    of a tensor (its longest request, which sizes the gather) happens once per step, not once per layer; the native
    kernel reads the page table in place and needs no read at all."""
    from decode_worker.model import attention
    from decode_worker.model.loader import load_model
    from decode_worker.model.runner import ModelRunner

    if native and attention.native_kernels() is None:
        pytest.skip("the native CPU kernels did not build here (no C compiler)")
    if not native:
        monkeypatch.setattr(attention, "native_kernels", lambda: None)
    runner = ModelRunner(load_model(tiny_models["llama"], tokenizer=False), max_total_tokens=256, page_size=PAGE)
    assert runner.config.num_layers > 1
    fb = runner.build_batch([[1], [2]], [5, 9], [[1, 2], [3, 4, 5]])
    reads = []
    original = torch.Tensor.__int__
    monkeypatch.setattr(torch.Tensor, "__int__", lambda self: reads.append(1) or original(self))
    runner.forward(fb)
    assert len(reads) == (0 if native else 1)
