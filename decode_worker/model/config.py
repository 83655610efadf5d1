"""Model hyper-parameters from a config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


class ModelLoadError(ValueError):
    """A model the worker cannot serve."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_context: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    name: str = "model"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str) -> "ModelConfig":
        arch = cfg.get("model_type", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch!r} in config.json; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = cfg["num_attention_heads"]
        max_context = cfg.get("max_position_embeddings", 4096)
        if arch == "mistral" and cfg.get("sliding_window"):
            # Full attention equals sliding-window attention only up to the window; serve no further.
            max_context = min(max_context, cfg["sliding_window"])
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 10000.0),
            max_context=max_context,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            rope_scaling=cfg.get("rope_scaling"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            bos_token_id=cfg.get("bos_token_id"),
            name=name,
        )
