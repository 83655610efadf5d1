"""A llama-architecture GGUF: config from metadata, tensors under Hugging Face names."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from decode_worker.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError
from decode_worker.model.dequant import dequantize
from decode_worker.model.gguf_file import GGUFFile, GGUFFormatError, read_gguf
from decode_worker.model.quant import Q4Blocks, Q8Blocks, packable

_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def open_gguf(path: Path) -> GGUFFile:
    try:
        return read_gguf(path)
    except (GGUFFormatError, OSError, ValueError) as e:  # ValueError: numpy cannot map an empty file
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field(reader: GGUFFile, key: str, default=None):
    return reader.fields.get(key, default)


def gguf_config(reader: GGUFFile, name: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r} in GGUF; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    freq_factors = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_context=int(_field(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        # Llama-3 GGUFs carry their RoPE scaling as per-frequency divisors.
        rope_scaling=None if freq_factors is None else {"rope_type": "freq_factors", "factors": freq_factors.data.tolist()},
        eos_token_ids=(int(eos),) if eos is not None else (),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        name=name,
    )


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(reader: GGUFFile, config: ModelConfig,
                 keep_low_bit: bool = False) -> Iterator[tuple[str, torch.Tensor | Q4Blocks | Q8Blocks]]:
    """Every tensor as float32 under its HF name; with ``keep_low_bit``, Q4_1 layer matrices as ``Q4Blocks`` and a
    Q8_0 embedding or output matrix as ``Q8Blocks``."""
    from gguf import GGMLQuantizationType

    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        parts = t.name.split(".")
        if keep_low_bit and parts[0] == "blk" and t.tensor_type == GGMLQuantizationType.Q4_1 and len(shape) == 2 and packable(*shape):
            tensor = Q4Blocks.from_gguf(t.data, *shape)
        elif (keep_low_bit and t.name in ("token_embd.weight", "output.weight")
              and t.tensor_type == GGMLQuantizationType.Q8_0 and len(shape) == 2):
            tensor = Q8Blocks.from_gguf(t.data, *shape)
        else:
            tensor = torch.from_numpy(dequantize(t.data, t.tensor_type)).reshape(shape)
        if t.name == "token_embd.weight":
            yield "model.embed_tokens.weight", tensor
        elif t.name == "output_norm.weight":
            yield "model.norm.weight", tensor
        elif t.name == "output.weight":
            yield "lm_head.weight", tensor
        elif parts[0] == "blk" and parts[2] in _TENSOR_NAMES:
            if config.architecture != "qwen2" and parts[2] == "attn_q":
                tensor = _unpermute_any(tensor, config.num_heads)
            elif config.architecture != "qwen2" and parts[2] == "attn_k":
                tensor = _unpermute_any(tensor, config.num_kv_heads)
            yield f"model.layers.{parts[1]}.{_TENSOR_NAMES[parts[2]]}.{parts[3]}", tensor
        elif "rope_freqs" not in t.name:
            raise ModelLoadError(f"unexpected tensor {t.name!r} in GGUF file")


def _unpermute_any(tensor: torch.Tensor | Q4Blocks, n_head: int) -> torch.Tensor | Q4Blocks:
    if isinstance(tensor, Q4Blocks):
        return tensor.map_rows(lambda part: _unpermute(part, n_head))
    return _unpermute(tensor, n_head)
