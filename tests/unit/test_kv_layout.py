"""The KV layout names the weights, not just the model's name: KV from another checkpoint never mixes in."""
from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file, save_file

from decode_worker.model.loader import load_model
from decode_worker.model.runner import ModelRunner


def layout_of(path):
    return ModelRunner(load_model(path, tokenizer=False), max_total_tokens=64, page_size=4).layout


def test_same_name_other_weights_is_another_layout(tiny_models, tmp_path):
    original = tiny_models["llama"]
    tuned = tmp_path / original.name  # same directory name, so the same config name
    shutil.copytree(original, tuned)
    (weights,) = tuned.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.down_proj.weight"] += 1e-3  # one matrix of one layer fine-tuned
    save_file(tensors, weights, metadata={"format": "pt"})

    base, again, other = layout_of(original), layout_of(original), layout_of(tuned)
    assert base == again and base.fingerprint() == again.fingerprint()
    assert base.model_id.split("@")[0] == other.model_id.split("@")[0] == original.name
    assert base.fingerprint() != other.fingerprint()
    (diff,) = base.differences(other.describe())
    assert diff.startswith("model_id:")


def test_dtype_changes_the_layout(tiny_models):
    path = tiny_models["llama"]
    f32 = layout_of(path)
    bf16 = ModelRunner(load_model(path, dtype=torch.bfloat16, tokenizer=False), max_total_tokens=64, page_size=4).layout
    assert f32.fingerprint() != bf16.fingerprint()
