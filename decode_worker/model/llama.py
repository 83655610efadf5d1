"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral) over a paged KV pool."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from decode_worker.cache.pool import KVPool
from decode_worker.model.attention import attend, plan_step, project_and_store
from decode_worker.model.config import ModelConfig
from decode_worker.model.forward_batch import ForwardBatch
from decode_worker.model.layers import MLP, AttentionProjections, RMSNorm, RotaryEmbedding

Block = Callable[..., torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = AttentionProjections(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)


@dataclass(frozen=True)
class LayerCalls:
    """A decoder layer's blocks as bound ``forward`` methods, taken at the first step (after loading has put the
    final linear forms in place): the layer loop then pays no nn.Module attribute lookup and call dispatch (~0.8 and
    ~1.5 us each), which a CPU step otherwise pays a few hundred times."""

    input_norm: Block
    attn: AttentionProjections
    o_proj: Block
    post_norm: Block
    mlp: Block

    @classmethod
    def of(cls, layer: DecoderLayer) -> LayerCalls:
        attn = layer.self_attn
        return cls(layer.input_layernorm.forward, attn, attn.o_proj.forward, layer.post_attention_layernorm.forward,
                   layer.mlp.forward)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_context, config.rope_theta, config.rope_scaling)
        self.scale = config.head_dim**-0.5
        self.head_matmul = None  # the vocabulary matmul's packed CPU form, set by the loader
        self.layer_calls: list[LayerCalls] | None = None

    def forward(self, fb: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """One step, writing the new K/V into ``pool``; float32 logits ``[rows, vocab]``."""
        return self.logits(self.hidden(fb, pool))

    @torch.inference_mode()
    def hidden(self, fb: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """One step, writing the new K/V into ``pool``; the final norm's output at ``fb.logits_indices``. On CPU the
        residual stream is float64 whatever the layers' dtype (each layer's output is added to it inside the next
        norm)."""
        h = self.embed_tokens(fb.input_ids)
        h = h.double() if h.device.type == "cpu" else h
        rope, plan = self.rotary.tables(fb.positions), plan_step(pool, fb, self.config.num_heads)  # for every layer
        if self.layer_calls is None:
            self.layer_calls = [LayerCalls.of(layer) for layer in self.layers]
        delta = None
        for i, calls in enumerate(self.layer_calls):
            q = project_and_store(pool, i, fb, plan, calls.attn, calls.input_norm(h, delta), rope)
            o = attend(pool, i, fb, plan, q, self.scale)
            delta = calls.mlp(calls.post_norm(h, calls.o_proj(o.reshape(o.shape[0], -1))))
        rows = fb.logits_indices
        return self.norm(h[rows], delta[rows])

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[rows, vocab]`` of final hidden rows ``h``."""
        if self.head_matmul is not None:
            return self.head_matmul(h).float()
        return _logits(h, self.head_weight()).float()

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight


def _logits(h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """``h @ head.T``; one 16-bit CPU row uses ``torch.mv`` (far faster than a one-row GEMM)."""
    if h.shape[0] == 1 and h.device.type == "cpu" and h.dtype in (torch.bfloat16, torch.float16):
        return torch.mv(head, h[0]).unsqueeze(0)
    return torch.nn.functional.linear(h, head)
