"""Bad model input gives an error that names the problem."""
from __future__ import annotations

import json

import pytest

from decode_worker.engine.llm import LLM
from decode_worker.core.sequence import PromptTooLong
from decode_worker.core.sampling import SamplingParams
from decode_worker.model.config import ModelLoadError
from decode_worker.model.loader import load_model


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="model path not found"):
        load_model(tmp_path / "nope.gguf")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(bad)


def test_truncated_safetensors(tiny_models, tmp_path):
    d = tmp_path / "cut"
    d.mkdir()
    (d / "config.json").write_text((tiny_models["llama"] / "config.json").read_text())
    data = (tiny_models["llama"] / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(d, tokenizer=False)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_model(tmp_path)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)


def test_prompt_longer_than_context(tiny_models):
    llm = LLM(str(tiny_models["llama"]), max_total_tokens=4096, page_size=4, load_tokenizer=False)
    with pytest.raises(PromptTooLong, match="context is 512 tokens"):
        llm.generate([[1] * 600], SamplingParams(max_new_tokens=4))


def test_request_larger_than_pool(tiny_models):
    llm = LLM(str(tiny_models["llama"]), max_total_tokens=64, page_size=4, load_tokenizer=False)
    with pytest.raises(PromptTooLong, match="KV pool .* has 16"):
        llm.generate([[1] * 40], SamplingParams(max_new_tokens=40))
    assert llm.allocator.num_used == 0
