"""A random-weight two-layer Llama with a byte-level tokenizer and a chat template.

A worker serving it starts in seconds and generates a token in about a millisecond of model time, which is what
tests that send hundreds of requests (schema fuzzing, limits) need. Its text is noise; these tests check
statuses, shapes and bookkeeping, never wording.
"""
from __future__ import annotations

from pathlib import Path

from tests.conftest import save_random_checkpoint

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tokenizer(path: Path) -> int:
    """One token per byte plus the chat markers; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return len(tok)


def save_tiny_chat_model(path: Path, max_context: int = 2048, vocab_size: int = 0) -> Path:
    """``vocab_size``: pad the model's vocabulary past the tokenizer's (as real checkpoints do), for tests whose
    cost grows with the vocabulary; ids past the tokenizer's have no text."""
    vocab = max(save_tokenizer(path), vocab_size)
    save_random_checkpoint(path, "llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_context,
                           tie_word_embeddings=True)
    return path
