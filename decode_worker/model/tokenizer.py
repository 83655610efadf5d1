"""Tokenizer and chat template for a model directory or GGUF file (through transformers' tokenizers)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decode_worker.model.config import ModelLoadError


@dataclass
class Tokenizer:
    backend: Any  # a transformers PreTrainedTokenizerFast
    eos_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, path: Path, eos_token_ids: tuple[int, ...]) -> "Tokenizer":
        from transformers import AutoTokenizer

        try:
            if path.is_file():
                backend = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            else:
                backend = AutoTokenizer.from_pretrained(str(path))
        except Exception as e:
            raise ModelLoadError(f"cannot load the tokenizer of {path}: {e}") from e
        eos = set(eos_token_ids)
        if backend.eos_token_id is not None:
            eos.add(backend.eos_token_id)
        return cls(backend, tuple(sorted(eos)))

    @property
    def vocab_size(self) -> int:
        return len(self.backend)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> str:
        """The model's chat template ('' when it has none): what it shows decides how tools are rendered."""
        template = self.backend.chat_template
        return template if isinstance(template, str) else ""

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """``tools`` (OpenAI tool definitions) go to a template that renders them itself."""
        if not self.backend.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        text = self.backend.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                                tools=tools)
        return self.encode(text)
