"""Shared fixtures: tiny random-weight Hugging Face checkpoints, the embedded SmolLM2 model and the native CPU
kernels."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

COLD_CACHE = pytest.StashKey[Path]()  # the session's own cache folder, removed at its end


def pytest_configure(config):
    """Every test session starts cold, as a first-time user does: the product's cache folder (converted tokenizers,
    compiled CPU kernels, bench outputs) is a new empty one, which the xdist workers and every process the tests
    start inherit. Only the fetched model file is reused, linked in from the usual cache (fetched there if missing)."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller made the folder and set the variable
        return
    from decode_worker.model.embedded import GGUF_NAME, ensure_default_model

    model = ensure_default_model()
    cold = Path(tempfile.mkdtemp(prefix="decode-worker-cache-"))
    (cold / "models").mkdir()
    (cold / "models" / GGUF_NAME).symlink_to(model)
    os.environ["DECODE_WORKER_CACHE"] = str(cold)
    config.stash[COLD_CACHE] = cold


def pytest_unconfigure(config):
    cold = config.stash.get(COLD_CACHE, None)
    if cold is not None:
        shutil.rmtree(cold, ignore_errors=True)


PROCESS_SUITES = {"integration", "e2e", "soak"}  # folders whose tests start worker, router or server processes


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, called only when it runs the tests
def pytest_xdist_make_scheduler(config, log):
    """``make test`` runs two xdist workers: every test that starts processes goes to one of them, in file order, and
    the other takes the unit tests module by module. The process tests hold deadlines and watch for stalls, so two of
    them never compete for the cores; the unit tests fill the core that their waits leave idle."""
    from xdist.scheduler import LoadScopeScheduling

    class ProcessTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "processes" if PROCESS_SUITES & set(module.split("/")[:-1]) else module

    return ProcessTestsTogether(config, log)


def save_random_checkpoint(path, model_type: str, **overrides) -> None:
    """Write a small random-weight checkpoint with transformers' own save_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=None,
    )
    fields.update(overrides)
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb them so they are tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Random-weight Llama, Llama-3-scaled, Qwen2 (QKV bias) and Mistral checkpoints, by name."""
    root = tmp_path_factory.mktemp("tiny")
    specs = {
        "llama": ("llama", {}),
        "llama3": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
        "qwen2": ("qwen2", {"tie_word_embeddings": True}),
        "mistral": ("mistral", {"sliding_window": 4096}),
    }
    paths = {}
    for name, (model_type, overrides) in specs.items():
        save_random_checkpoint(root / name, model_type, **overrides)
        paths[name] = root / name
    return paths


@pytest.fixture(scope="session")
def smollm2_path():
    from decode_worker.model.embedded import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """Transformers' own SmolLM2 from the GGUF file in float64, the parity reference; its conversion is the slowest
    set-up in the suite, so the modules that compare with it share one. float64, because transformers' float32
    GGUF forward is no longer the closer one: from 5.25 its logits lie 1.1e-4 from its own float64 forward on the
    parity prompt, ours 3.7e-5."""
    import functools

    import gguf
    from transformers import AutoModelForCausalLM

    # Transformers parses the file twice and builds the same tensor-name map once per tensor (~20 s of ~30 s
    # here): the same objects, each made once, make the same model.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        return AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                                    dtype=torch.float64).eval()


@pytest.fixture(scope="session")
def native_lib():
    """The native CPU kernels: skips where no C compiler is on PATH, fails where one is and they did not build."""
    from decode_worker.model.native import native_kernels

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on PATH: the native kernels cannot be built here")
    built = native_kernels()
    assert built is not None, "a C compiler is on PATH but the native kernels did not build (see the warning)"
    return built
