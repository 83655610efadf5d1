"""End to end through the real smg gateway in PD mode: router, prefill and decode as real processes."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from decode_worker.core.sampling import SamplingParams
from decode_worker.engine.llm import LLM
from tests.servers import start_router, start_workers, wait_pages_free
from tests.unit.test_smollm2 import CHAT_QUESTION

# float32 (prefill and decode): the tests compare cached outputs with a cache-free run token for token, which a bf16
# near-tie flips with the shape of the pass (the default dtype's greedy output is test_default_dtype_greedy's)
WORKER_ENV = {"DECODE_WORKER_PD_TOKEN": "e2e-token", "DECODE_WORKER_DTYPE": "float32"}
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
SYSTEM = "You are a careful assistant. Rules: answer briefly, cite facts, avoid speculation, be polite. " * 4


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, smollm2_path):
    logs = tmp_path_factory.mktemp("e2e-logs")
    # A small L1 (1024 tokens) with L2 behind it: long prompts push each other out to the host tier.
    decode_flags = ("--max-total-tokens", "1024", "--disaggregation-decode-enable-radix-cache",
                    "--disaggregation-decode-enable-hicache", "--max-running-requests", "40")
    prefill, decode = start_workers({"prefill": ("prefill", (), WORKER_ENV),
                                     "decode": ("decode", decode_flags, WORKER_ENV)}, logs).values()
    router = start_router(logs, prefill, decode)
    yield prefill, decode, router
    for proc in (router, decode, prefill):
        proc.stop()


@pytest.fixture(scope="module")
def no_cache_llm(smollm2_path):
    """The cache-off reference: every prompt computed from scratch in one process."""
    return LLM(str(smollm2_path), max_total_tokens=8192, dtype=torch.float32)  # the workers'


def generate(router, text, **extra):
    r = httpx.post(router.url + "/generate", json={"text": text, "sampling_params": GREEDY, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_plain_and_streaming(deployment):
    _, _, router = deployment
    plain = generate(router, "The capital of France is")
    assert len(plain["output_ids"]) == 10 and "Paris" in plain["text"]
    with httpx.stream("POST", router.url + "/generate", timeout=120, headers={"content-type": "application/json"},
                      json={"text": "The capital of France is", "stream": True, "sampling_params": GREEDY}) as r:
        events = [l[6:] for l in r.iter_lines() if l.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["output_ids"] == plain["output_ids"]


def test_openai_routes_with_the_official_client(deployment):
    from openai import OpenAI

    _, _, router = deployment
    client = OpenAI(base_url=router.url + "/v1", api_key="none")
    comp = client.completions.create(model="default", prompt="The capital of France is", max_tokens=6, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="default", prompt="The capital of France is", max_tokens=6, temperature=0, stream=True))
    assert comp.choices[0].text == streamed and "Paris" in streamed
    messages = [{"role": "user", "content": CHAT_QUESTION}]
    chat = client.chat.completions.create(model="default", messages=messages, max_tokens=20, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="default", messages=messages, max_tokens=20, temperature=0, stream=True) if c.choices]
    assert "".join(deltas) == chat.choices[0].message.content


def test_shared_prefix_is_reused_with_identical_output(deployment, no_cache_llm):
    """The second request reuses the first one's prefix; both answers, the cached one above all, equal a
    cache-free run."""
    _, decode, router = deployment
    texts = [SYSTEM + "Question: what is two plus two?", SYSTEM + "Question: what is three plus three?"]
    first = generate(router, texts[0])
    before = decode.metric("decode_worker_kv_received_tokens_total")
    second = generate(router, texts[1])
    received = decode.metric("decode_worker_kv_received_tokens_total") - before
    assert second["meta_info"]["cached_tokens"] > 0
    assert received == second["meta_info"]["prompt_tokens"] - second["meta_info"]["cached_tokens"]
    refs = no_cache_llm.generate(texts, SamplingParams(**GREEDY))
    assert first["output_ids"] == refs[0].output_ids
    assert second["output_ids"] == refs[1].output_ids


def test_host_tier_hits_with_outputs_equal_to_cache_off(deployment, no_cache_llm):
    _, decode, router = deployment
    topics = ["rivers", "mountains", "deserts", "forests", "oceans"]
    prompts = [f"Background on {t}: " + f"{t} are part of the natural world and shape climate and life. " * 24
               + f"Question: name one famous example of {t}." for t in topics]
    host_before = decode.metric("decode_worker_cached_tokens_total", tier="host")
    outputs = [generate(router, p) for p in prompts]  # ~350 tokens each: together they overflow the 1024-token L1
    again = [generate(router, p) for p in prompts]
    host_hits = decode.metric("decode_worker_cached_tokens_total", tier="host") - host_before
    assert host_hits > 0
    assert sum(a["meta_info"]["cached_tokens_details"]["host"] for a in again) == host_hits
    refs = no_cache_llm.generate(prompts, SamplingParams(**GREEDY))
    for p, out, out2, ref in zip(prompts, outputs, again, refs):
        assert out["output_ids"] == ref.output_ids == out2["output_ids"], p[:30]
    assert decode.metric("decode_worker_load_back_tokens_total") >= host_hits


def test_concurrent_streaming_clients_and_disconnects_free_every_page(deployment):
    _, decode, router = deployment

    async def client_run(client, i):
        body = {"text": f"Story {i}: once upon a time", "stream": True,
                "sampling_params": {"max_new_tokens": 16, "temperature": 0.8, "seed": i, "ignore_eos": True}}
        n = 0
        async with client.stream("POST", router.url + "/generate", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    n += 1
                    if i % 10 == 0 and n == 2:
                        return -1  # disconnects mid-stream
        return n

    async def run():
        async with httpx.AsyncClient(timeout=300, headers={"content-type": "application/json"}) as client:
            return await asyncio.gather(*(client_run(client, i) for i in range(32)))

    counts = asyncio.run(run())
    assert all(c == 16 for i, c in enumerate(counts) if i % 10), counts
    wait_pages_free(decode, timeout_s=60)
    assert decode.metric("decode_worker_cache_pages", tier="device", state="locked") == 0
