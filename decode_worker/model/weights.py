"""Hugging Face-named tensors into LlamaModel's fused parameters."""
from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

import torch

from decode_worker.model.config import ModelConfig, ModelLoadError
from decode_worker.model.llama import LlamaModel
from decode_worker.model.quant import Int4Linear, Q4Blocks, Q8Blocks

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}


def _fused_slot(config: ModelConfig, part: str) -> tuple[str, int, int] | None:
    """(fused param, row start, row end) of a q/k/v or gate/up tensor."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    slots = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, q + kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, 2 * inter),
    }
    module, _, kind = part.rpartition(".")
    if module in slots:
        name, lo, hi = slots[module]
        return f"{name}.{kind}", lo, hi
    return None


def load_weights(model: LlamaModel, tensors: Iterable[tuple[str, torch.Tensor | Q4Blocks | Q8Blocks]],
                 wide_from_rows: int | None = None, exact: bool = False) -> Q8Blocks | None:
    """Fill every parameter (ModelLoadError if missing or mis-shaped); wholly-``Q4Blocks`` bias-free linears become
    ``Int4Linear`` (``exact`` as there). Returns the vocabulary matrix's ``Q8Blocks`` if it came as such (its
    parameter holds the dequantized values too: the embedding lookup reads them)."""
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}
    head_name = "embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
    head_blocks = None
    quantized: dict[str, list[tuple[int, Q4Blocks]]] = {}
    for hf_name, tensor in tensors:
        if "rotary_emb" in hf_name:
            continue
        target, rows = _GLOBAL.get(hf_name), None
        match = _LAYER.match(hf_name)
        if match:
            layer, part = match.groups()
            fused = _fused_slot(model.config, part)
            if fused:
                target, rows = f"layers.{layer}.{fused[0]}", fused[1:]
            elif part in _DIRECT:
                target = f"layers.{layer}.{_DIRECT[part]}"
        if target is None or target not in params:
            if hf_name == "lm_head.weight" and model.lm_head is None:
                continue  # tied checkpoints may still carry a copy of the embedding
            raise ModelLoadError(f"unexpected tensor {hf_name!r} in checkpoint")
        dest = params[target].data if rows is None else params[target].data[rows[0] : rows[1]]
        if dest.shape != tensor.shape:
            raise ModelLoadError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        if isinstance(tensor, Q4Blocks) and _bias_free_linear(model, target):
            quantized.setdefault(target, []).append((0 if rows is None else rows[0], tensor))
        else:
            dest.copy_(tensor.dequantize() if isinstance(tensor, (Q4Blocks, Q8Blocks)) else tensor)
            if isinstance(tensor, Q8Blocks) and target == head_name:
                head_blocks = tensor
        filled[target] = filled.get(target, 0) + (dest.shape[0] if rows is not None else params[target].shape[0])
    missing = [n for n, p in params.items() if filled.get(n, 0) < p.shape[0]]
    if missing:
        raise ModelLoadError(f"checkpoint lacks tensors for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    for target, pieces in quantized.items():
        if sum(b.shape[0] for _, b in pieces) != params[target].shape[0]:  # some pieces came dense: stay dense
            for start, b in pieces:
                params[target].data[start : start + b.shape[0]].copy_(b.dequantize())
            continue
        module_name = target.removesuffix(".weight")
        parent, _, attr = module_name.rpartition(".")
        dtype = params[target].dtype
        blocks = Q4Blocks.stack([b for _, b in sorted(pieces, key=lambda piece: piece[0])])
        setattr(model.get_submodule(parent), attr, Int4Linear(blocks, dtype, wide_from_rows, exact))
    return head_blocks


def _bias_free_linear(model: torch.nn.Module, weight_name: str) -> bool:
    module = model.get_submodule(weight_name.removesuffix(".weight"))
    return isinstance(module, torch.nn.Linear) and module.bias is None


def weights_digest(model: torch.nn.Module, samples_per_tensor: int = 4096) -> str:
    """Digest of strided weight samples: checkpoints never share KV."""
    h = hashlib.sha256()
    for name, module in model.named_modules():
        if hasattr(module, "form"):
            h.update(f"{name}:{module.form};".encode())
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // samples_per_tensor)
        sample = flat[::step][:samples_per_tensor].float().cpu().contiguous()
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:12]
