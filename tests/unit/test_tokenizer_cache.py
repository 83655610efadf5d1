"""The embedded model's tokenizer, converted from its GGUF file once and read back from the cache folder after
that, tokenizes, detokenizes and renders chat exactly as the conversion does."""
from __future__ import annotations

import pytest

from decode_worker.model.tokenizer import Tokenizer, converted_tokenizer_dir

TEXTS = ["What is the capital of France?", "  leading spaces, tabs\tand\nnewlines  ", "naïve café — 東京 🙂",
         "<|im_start|>user\nhi<|im_end|>", "x" * 300, ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]


def same(a: Tokenizer, b: Tokenizer) -> None:
    assert a.vocab_size == b.vocab_size and a.eos_token_ids == b.eos_token_ids
    assert a.chat_template == b.chat_template
    for text in TEXTS:
        ids = a.encode(text)
        assert b.encode(text) == ids
        assert b.decode(ids) == a.decode(ids) and b.decode(ids, False) == a.decode(ids, False)
    assert a.apply_chat_template(MESSAGES) == b.apply_chat_template(MESSAGES)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODE_WORKER_CACHE", str(tmp_path))
    return tmp_path


def test_the_cached_tokenizer_equals_the_converted_one(cache, smollm2_path):
    converted = Tokenizer.load(smollm2_path, ())
    saved = converted_tokenizer_dir(smollm2_path)
    assert saved.is_relative_to(cache) and (saved / "tokenizer.json").is_file()
    (saved / "marker").write_text("read from here")
    same(converted, Tokenizer.load(smollm2_path, ()))
    assert (saved / "marker").exists()  # not converted and replaced again


@pytest.mark.slow  # two conversions (~10 s): the default run keeps the equality check above
def test_a_damaged_cached_tokenizer_is_converted_again(cache, smollm2_path, caplog):
    converted = Tokenizer.load(smollm2_path, ())
    (converted_tokenizer_dir(smollm2_path) / "tokenizer.json").write_text("{not json")
    same(converted, Tokenizer.load(smollm2_path, ()))
    assert "does not load" in caplog.text
    same(converted, Tokenizer.load(smollm2_path, ()))  # and the replacement is whole


@pytest.mark.slow  # two conversions (~10 s)
def test_an_unwritable_cache_folder_still_loads(cache, smollm2_path):
    (cache / "tokenizers").write_text("a file where the folder should be")
    same(Tokenizer.load(smollm2_path, ()), Tokenizer.load(smollm2_path, ()))
