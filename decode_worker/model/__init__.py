"""The Llama-family model, its loaders, the batch runner over paged KV, the sampler and CUDA graphs."""
