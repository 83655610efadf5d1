"""Example bodies for the OpenAPI schema, which the schema fuzz test always sends."""
from __future__ import annotations

_PD = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 30001, "bootstrap_room": 8123456789}
_GEN = {"max_new_tokens": 8, "temperature": 0}
GENERATE_EXAMPLES = {
    "text": {"text": "The capital of France is", "sampling_params": _GEN},
    "stream": {"text": "The capital of France is", "sampling_params": _GEN, "stream": True},
    "batch": {"input_ids": [[1, 504, 3575], [1, 504]], "sampling_params": {"max_new_tokens": 4},
              "return_logprob": True},
    "pd": {"text": "The capital of France is", "sampling_params": _GEN, **_PD},  # what a PD router sends
}
COMPLETION_EXAMPLES = {
    "prompt": {"model": "default", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
    "stream": {"model": "default", "prompt": "The capital of France is", "max_tokens": 8, "stream": True},
    "pd": {"model": "default", "prompt": ["The capital of France is", "Hello"], "max_tokens": 8,
           "bootstrap_host": ["127.0.0.1"] * 2, "bootstrap_port": [30001, None],  # null: the --bootstrap-port
           "bootstrap_room": [8123456789, 8123456790]},
}
CHAT_EXAMPLES = {
    "chat": {"model": "default",
             "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
             "max_tokens": 16},
    "stream": {"model": "default", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8,
               "stream": True},
    "pd": {"model": "default", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8, **_PD},
}
HANDSHAKE_EXAMPLES = {  # what a decode worker sends; the layout is that of the decode side's KV pool
    "handshake": {"room": 8123456789, "prompt_len": 40, "prompt_digest": "0" * 32,
                  "nixl_agent": "decode-0123456789ab", "known_agent": "",
                  "layout": {"model_id": "SmolLM2-135M-Instruct.Q4_1@0123456789ab", "num_layers": 30,
                             "num_kv_heads": 3, "head_dim": 64, "page_size": 16, "dtype": "float32"}},
}
