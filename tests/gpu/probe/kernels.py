"""Kernel sections: each Triton kernel against its torch reference (``kernel_parity``), and decode attention's
bandwidth against the device's (``attention``)."""
from __future__ import annotations

import functools

import torch

from probe.common import GB, device_of, timed

# (q_heads, kv_heads, head_dim, page_size): SmolLM2, Llama-3-8B, Qwen2-7B (group 7), Llama-70B with 1-token pages
GPU_GEOMETRIES = {"smollm2": (9, 3, 64, 16), "llama8b": (32, 8, 128, 16), "qwen7b": (28, 4, 128, 16),
                  "llama70b": (64, 8, 128, 1)}
GPU_LENGTHS = [0, 1, 255, 256, 257, 777, 2048, 4000, 8191]
TINY_GEOMETRIES = {"g2": (4, 2, 16, 4)}
TINY_LENGTHS = [0, 1, 5, 37, 70]


def attention_inputs(geometry: tuple[int, int, int, int], lengths: list[int], dtype: torch.dtype, device: str,
                     seed: int = 0) -> dict:
    """A decode batch over one layer of a page-major pool: each request's pages scattered, spare table entries
    pointing at live pages (masking must hide them), K/V strided views as the pool gives them."""
    q_heads, kv_heads, head_dim, page_size = geometry
    gen = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-n // page_size) for n in lengths)) + 1
    num_pages = len(lengths) * width + 1
    table = torch.randperm(num_pages - 1, generator=gen)[: len(lengths) * width].view(len(lengths), width) + 1
    on_device = torch.Generator(device).manual_seed(seed)  # GBs of K/V at 64 x 8K: made where they are used
    pool = torch.randn(num_pages, 2, 2, page_size, kv_heads, head_dim, generator=on_device, device=device, dtype=dtype)
    return {"q": torch.randn(len(lengths), q_heads, head_dim, generator=on_device, device=device, dtype=dtype),
            "k_pages": pool[:, 1, 0], "v_pages": pool[:, 1, 1], "page_table": table.to(device),
            "seq_lens": torch.tensor(lengths, device=device), "scale": head_dim ** -0.5}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max |got - want| over max(1, |want|) (bf16 rounds relative to the output's size); inf where got has a NaN."""
    if torch.isnan(got).any():
        return float("inf")
    return ((got.float() - want).abs() / want.abs().clamp(min=1)).max().item()


def attention_parity(tiny: bool, dtype: torch.dtype) -> dict:
    from decode_worker_kernels import paged_attention, paged_attention_split

    device = device_of(tiny)
    split_args = {"num_splits": 3, "min_split_tokens": 16, "block_n": 16} if tiny else {}
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    out = {}
    geometries, lengths = (TINY_GEOMETRIES, TINY_LENGTHS) if tiny else (GPU_GEOMETRIES, GPU_LENGTHS)
    for name, geometry in geometries.items():
        inputs = attention_inputs(geometry, lengths, dtype, device)
        # float32 on CPU: a zero-length request gets CPU SDPA's zeros (CUDA's kernels need not)
        on_cpu = {k: v.float().cpu() if k in ("q", "k_pages", "v_pages") else v.cpu() if torch.is_tensor(v) else v
                  for k, v in inputs.items()}
        want = paged_attention.paged_decode_attention_reference(**on_cpu).to(device)
        errors = {"one_pass": relative_error(paged_attention.paged_decode_attention_triton(**inputs), want),
                  "split": relative_error(paged_attention_split.paged_decode_attention_split(**inputs, **split_args),
                                          want)}
        out[name] = {**{k: round(v, 7) for k, v in errors.items()}, "ok": max(errors.values()) <= tolerance}
    return out


def copy_parity(device: str, dtype: torch.dtype) -> dict:
    """write_kv and copy_pages (Triton) against their references: copies must be exact."""
    from decode_worker_kernels import kv_write, page_copy

    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(12, 3, 2, 4, 2, 16, generator=gen).to(device, dtype)  # [page, layer, kv, slot, head, dim]
    k, v = (torch.randn(9, 2, 16, generator=gen).to(device, dtype) for _ in range(2))
    slots = (torch.randperm(44, generator=gen)[:9] + 4).to(device)
    want, got = pool.clone(), pool.clone()
    kv_write.write_kv_reference(want[:, 1, 0], want[:, 1, 1], slots, k, v)
    kv_write.write_kv_triton(got[:, 1, 0], got[:, 1, 1], slots, k, v)
    src, dst_want, dst_got = pool, torch.zeros_like(pool), torch.zeros_like(pool)
    src_pages, dst_pages = torch.tensor([7, 0, 3, 11], device=device), torch.tensor([1, 6, 2, 9], device=device)
    page_copy.copy_pages_reference(src, dst_want, src_pages, dst_pages)
    page_copy.copy_pages_triton(src, dst_got, src_pages, dst_pages)
    return {"write_kv_exact": bool(torch.equal(got, want)), "copy_pages_exact": bool(torch.equal(dst_got, dst_want))}


def large_pool_copy(tiny: bool) -> dict:
    """Three pages ~1 GiB apart (a page stride Triton passes as int32): page 2's offsets pass 2^31 elements, where
    an int32 offset would wrap. Tiny: the same copy with a small stride (the logic, not the offsets)."""
    from decode_worker_kernels import page_copy

    device = device_of(tiny)
    page_shape, page_strides = (2, 2, 16, 1, 8), (256, 128, 8, 8, 1)  # [layer, kv, slot, head, dim], dense
    stride = 1024 if tiny else (1 << 30) + (1 << 20)
    size = 2 * stride + 512
    src = torch.randint(1, 255, (size,), dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    src_v, dst_v = (t.as_strided((3, *page_shape), (stride, *page_strides)) for t in (src, dst))
    sp, dp = torch.tensor([2, 0], device=device), torch.tensor([1, 2], device=device)
    page_copy.copy_pages_triton(src_v, dst_v, sp, dp)
    exact = bool(torch.equal(dst_v[dp], src_v[sp])) and not dst_v[0].any().item()
    return {"exact": exact, "max_offset": src_v[2].data_ptr() - src_v.data_ptr(), "ok": exact}


def kernel_parity(tiny: bool) -> dict:
    """Every Triton kernel against its torch reference at serving geometries (tiny: fp32 under the interpreter,
    whose bf16 arithmetic is wrong), with a zero-length request in every attention batch (it must give 0, no NaN)."""
    dtypes = [torch.float32] if tiny else [torch.float32, torch.bfloat16]
    out: dict = {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        out[f"attention_{name}"] = attention_parity(tiny, dtype)
        out[f"copies_{name}"] = copy_parity(device_of(tiny), dtype)
    out["large_pool_copy"] = large_pool_copy(tiny)
    attention_ok = all(case["ok"] for key, cases in out.items() if key.startswith("attention_")
                       for case in cases.values())
    copies_ok = all(all(v.values()) for key, v in out.items() if key.startswith("copies_"))
    out["ok"] = attention_ok and copies_ok and out["large_pool_copy"]["ok"]
    return out


def peak_bandwidth_gbs() -> float | None:
    props = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return round(2 * clock_khz * 1e3 * bus_bits / 8 / GB, 1) if clock_khz and bus_bits else None


def device_copy_gbs(device: str, nbytes: int) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return round(2 * nbytes / timed(lambda: b.copy_(a), device) / GB, 1)


def attention(tiny: bool) -> dict:
    """Decode attention GB/s (K/V bytes read / time) at batch 1/64 x context 2K/8K, Llama-8B heads, bf16, by the
    dispatcher's kernel (the split kernel), the one-pass kernel it replaced and other stage-1 tiles, against the
    device's peak bandwidth and a device-to-device copy (read + write bytes / time)."""
    device = device_of(tiny)
    out: dict = {"peak_gbs": None if tiny else peak_bandwidth_gbs(),
                 "device_copy_gbs": device_copy_gbs(device, 1 << (20 if tiny else 30))}
    cases = [(2, 64)] if tiny else [(1, 2048), (1, 8192), (64, 2048), (64, 8192)]
    for batch, ctx in cases:
        out[f"b{batch}_ctx{ctx}"] = attention_case(batch, ctx, tiny)
    best = max(out[f"b{batch}_ctx{ctx}"]["dispatch"]["gbs"] for batch, ctx in cases)
    out["best_dispatch_of_device_copy"] = round(best / out["device_copy_gbs"], 3) if out["device_copy_gbs"] else None
    if out["peak_gbs"]:
        out["best_dispatch_of_peak"] = round(best / out["peak_gbs"], 3)
    return out


def attention_case(batch: int, ctx: int, tiny: bool) -> dict:
    """One decode attention call over ``batch`` requests of ``ctx`` tokens on scattered pages, by each kernel."""
    from decode_worker_kernels import paged_attention, paged_attention_split

    device, dtype = device_of(tiny), torch.float32 if tiny else torch.bfloat16
    geometry = TINY_GEOMETRIES["g2"] if tiny else GPU_GEOMETRIES["llama8b"]
    inputs = attention_inputs(geometry, [ctx] * batch, dtype, device)
    kv_bytes = 2 * batch * ctx * geometry[1] * geometry[2] * inputs["q"].element_size()
    split = paged_attention_split.paged_decode_attention_split
    small = {"min_split_tokens": 16, "block_n": 16} if tiny else {}
    kernels = {"dispatch": paged_attention.paged_decode_attention if not tiny else functools.partial(split, **small),
               "one_pass": paged_attention.paged_decode_attention_triton,  # the kernel the dispatcher replaced
               "split_bn64_w8": functools.partial(split, block_n=16 if tiny else 64, num_warps=8,  # the tile before
                                                  min_split_tokens=16 if tiny else 256),
               "split_bn32_w4": functools.partial(split, block_n=16 if tiny else 32, num_warps=4,
                                                  min_split_tokens=16 if tiny else 256)}
    out: dict = {"num_splits": paged_attention_split.choose_num_splits(
        batch, geometry[1], inputs["page_table"].shape[1] * geometry[3], paged_attention_split.sm_count(
            inputs["q"].device))}
    repeat = 2 if tiny else 20
    for name, fn in kernels.items():
        seconds = timed(lambda fn=fn: fn(**inputs), device, repeat=repeat, warmup=1)
        out[name] = {"us": round(seconds * 1e6, 1), "gbs": round(kv_bytes / seconds / GB, 3)}
    return out
