"""Tokenizer and chat template of a model directory or GGUF file."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decode_worker.model.config import ModelLoadError
from decode_worker.model.embedded import cache_dir

log = logging.getLogger(__name__)


@dataclass
class Tokenizer:
    backend: Any  # a transformers PreTrainedTokenizerFast
    eos_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, path: Path, eos_token_ids: tuple[int, ...]) -> "Tokenizer":
        from transformers import AutoTokenizer

        try:
            backend = _from_gguf(path) if path.is_file() else AutoTokenizer.from_pretrained(str(path))
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
        """The chat template ('' when none)."""
        template = self.backend.chat_template
        return template if isinstance(template, str) else ""

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """``tools`` go to templates that render them."""
        if not self.backend.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        text = self.backend.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                                tools=tools)
        return self.encode(text)


def _from_gguf(path: Path) -> Any:
    """A GGUF's tokenizer, converted once and cached."""
    from transformers import AutoTokenizer

    saved = converted_tokenizer_dir(path)
    if (saved / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(saved))
        except Exception as e:  # noqa: BLE001 (tokenizers raises bare Exception): a damaged entry, converted again
            log.warning("converting the tokenizer of %s again: its cached copy in %s does not load (%s)", path, saved, e)
            shutil.rmtree(saved, ignore_errors=True)
    backend = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    _save(backend, saved)
    return backend


def converted_tokenizer_dir(path: Path) -> Path:
    """Cache folder by file identity and transformers' version."""
    import transformers

    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return cache_dir() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def _save(backend: Any, target: Path) -> None:
    """Save whole or not at all (workers may race)."""
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        backend.save_pretrained(str(partial))
        partial.rename(target)
    except OSError as e:  # a read-only cache folder, or another worker saved it first
        log.info("the converted tokenizer was not kept in %s (%s)", target, e)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
