"""Trace prompts as text of known tokens: cache-aware routing matches on text."""
from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from decode_worker.config import ConfigError

SPACED_WORD = re.compile(r" [A-Za-z]{2,}")
LETTERS = re.compile(r" ?[A-Za-z]+")
MIN_WORDS = 64  # fewer spaced words than this: too few distinct prompts, use letters


def load_tokenizer(model_path: str):
    from decode_worker.model.tokenizer import Tokenizer

    return Tokenizer.load(Path(model_path).expanduser(), ())


def round_trip_words(tokenizer) -> list[int]:
    """Ids whose text encodes back to them, preferring whole words with a leading space."""
    texts = tokenizer.backend.batch_decode([[t] for t in range(tokenizer.vocab_size)], skip_special_tokens=False)

    def keep(pattern: re.Pattern) -> list[int]:
        return [t for t, s in enumerate(texts) if pattern.fullmatch(s) and tokenizer.encode(s) == [t]]

    words = keep(SPACED_WORD)
    return words if len(words) >= MIN_WORDS else keep(LETTERS)


def as_texts(tokenizer, prompts: Sequence[list[int]]) -> list[str]:
    """Each prompt's text; ConfigError when one would reach the worker as other tokens."""
    texts = [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]
    for ids, text in zip(prompts, texts):
        if tokenizer.encode(text) != ids:
            raise ConfigError("this model's tokenizer does not give the trace's prompts back as the same tokens, so "
                              "the scale-out trace cannot be sent as text: give --model-path a BPE model")
    return texts
