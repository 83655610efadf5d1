"""Llama-family model, loaders, paged-KV runner, sampler, CUDA graphs."""
