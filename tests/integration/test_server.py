"""A colocated worker as a real process: the HTTP API, errors, cache figures and page accounting."""
from __future__ import annotations

import asyncio
import http.client
import json
import time

import httpx
import pytest

from tests.servers import start_worker, wait_pages_free
from tests.unit.test_smollm2 import CHAT_QUESTION

LONG = "The history of the Roman Empire is long and complicated, full of emperors and wars. " * 8


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    # float32: these tests compare cached runs with cache-free ones token for token, which a bf16 near-tie flips
    # with the shape of the pass (the default dtype's greedy output is test_default_dtype_greedy's)
    proc = start_worker("colocated", tmp_path_factory.mktemp("logs"), "colocated", "--max-running-requests", "48",
                        "--max-total-tokens", "4096", "--dtype", "float32")
    yield proc
    proc.stop()


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=120, **kw)


def test_generate_plain_and_cached_repeat(server):
    body = {"text": LONG + "Tell me", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    first = post(server, "/generate", body).json()
    second = post(server, "/generate", body).json()
    assert first["output_ids"] == second["output_ids"] and len(first["output_ids"]) == 8
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert second["meta_info"]["cached_tokens"] > 0
    assert second["meta_info"]["cached_tokens_details"]["device"] == second["meta_info"]["cached_tokens"]
    assert second["meta_info"]["cached_tokens"] % 16 == 0  # page-aligned reuse
    wait_pages_free(server)


def greedy_ids(server, input_ids: list[int], max_new_tokens: int) -> dict:
    body = {"input_ids": input_ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    r = post(server, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def logprobs(out: dict) -> list[float]:
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def test_conversation_continuation_on_a_page_boundary_matches_a_cache_free_run(server):
    """A follow-up turn (earlier prompt + its answer + more) after an earlier turn that ends exactly on a
    16-token page boundary: that last page holds the last sampled token, whose KV was never computed, so it must
    not be reused. The follow-up must equal the same prompt run on an empty cache."""
    text = post(server, "/generate", {"text": LONG + "Tell me", "sampling_params": {"max_new_tokens": 40, "temperature": 0,
                                                                                    "ignore_eos": True}}).json()
    earlier, more = text["output_ids"], text["output_ids"][:8]  # model-written text as the conversation
    wait_pages_free(server)
    assert post(server, "/flush_cache", {}).json()["success"] is True
    answer = greedy_ids(server, earlier, 16 + -(len(earlier) + 16) % 16)["output_ids"]
    assert (len(earlier) + len(answer)) % 16 == 0
    follow_up = earlier + answer + more
    cached = greedy_ids(server, follow_up, 16)
    assert cached["meta_info"]["cached_tokens"] >= (len(earlier) + len(answer) - 1) // 16 * 16
    wait_pages_free(server)
    assert post(server, "/flush_cache", {}).json()["success"] is True
    fresh = greedy_ids(server, follow_up, 16)
    assert fresh["meta_info"]["cached_tokens"] == 0
    assert cached["output_ids"] == fresh["output_ids"]
    assert logprobs(cached) == pytest.approx(logprobs(fresh), abs=1e-3)


def test_generate_batch_input_ids_and_logprobs(server):
    body = {"input_ids": [[1, 504, 3575], [1, 504]], "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True}
    out = post(server, "/generate", body).json()
    assert isinstance(out, list) and len(out) == 2
    for item in out:
        assert len(item["output_ids"]) == 3
        lps = item["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in lps] == item["output_ids"] and all(lp <= 0 for lp, _, _ in lps)


def test_generate_stream_ends_with_done(server):
    with httpx.stream("POST", server.url + "/generate", timeout=60,
                      json={"text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}) as r:
        lines = [l for l in r.iter_lines() if l.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(l[6:]) for l in lines[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_string_and_unknown_fields(server):
    out = post(server, "/generate", {"text": "Count: 1, 2, 3,", "whatever": 1,
                                      "sampling_params": {"max_new_tokens": 20, "temperature": 0, "stop": [" 6"], "foo": 2}}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 6"}
    assert " 6" not in out["text"]


@pytest.mark.parametrize("body,status,fragment", [
    ("{not json", 400, "malformed JSON"),
    ({"sampling_params": {"max_new_tokens": 4}}, 400, "text or input_ids"),
    ({"text": "hi", "sampling_params": {"temperature": -1}}, 400, "temperature"),
    ({"text": "hi " * 9000, "sampling_params": {"max_new_tokens": 4}}, 400, "context"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": 9000}}, 400, "KV pool"),
    ({"input_ids": [1, 999999], "sampling_params": {"max_new_tokens": 4}}, 400, "input_ids"),
])
def test_bad_requests_get_clear_errors(server, body, status, fragment):
    if isinstance(body, str):
        r = httpx.post(server.url + "/generate", content=body, timeout=30)
    else:
        r = post(server, "/generate", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["code"] == status and err["type"]


def test_openai_clients(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": CHAT_QUESTION}],
                                          max_tokens=24, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    parts = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello"}],
                                                max_tokens=8, temperature=0, stream=True))
    assert parts[-1].choices[0].finish_reason in ("stop", "length")
    comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, temperature=0, stream=True))
    assert comp.choices[0].text == streamed and "Paris" in streamed
    assert comp.usage.completion_tokens == 4


def test_info_routes(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    info = httpx.get(server.url + "/server_info").json()
    assert info["served_model_name"] and info["role"] == "colocated" and "pd_token" not in info
    assert httpx.get(server.url + "/get_server_info").json()["kv_layout_fingerprint"] == info["kv_layout_fingerprint"]
    assert httpx.get(server.url + "/model_info").json()["is_generation"] is True
    assert "num_reqs" in httpx.get(server.url + "/get_load").json()
    text = httpx.get(server.url + "/metrics").text
    for name in ("prompt_tokens_total", "cached_tokens_total", "kv_received_tokens_total", "requests_total",
                 "ttft_seconds", "cache_pages", "queue_requests", "running_requests", "evicted_tokens_total"):
        assert f"decode_worker_{name}" in text, name


def test_concurrent_streams_and_disconnect_free_every_page(server):
    async def one(client, i, cut):
        body = {"text": f"{LONG} Question {i}:", "stream": True, "sampling_params": {"max_new_tokens": 24, "temperature": 0.7, "seed": i, "ignore_eos": True}}
        n = 0
        async with client.stream("POST", server.url + "/generate", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    n += 1
                    if cut and n == 3:
                        return n  # leaves mid-stream: the server must abort and free its pages
        return n

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, i, cut=i % 8 == 0) for i in range(32)))

    counts = asyncio.run(run())
    assert all(c == 24 for i, c in enumerate(counts) if i % 8), counts
    wait_pages_free(server)
    assert server.metric("decode_worker_requests_total", outcome="aborted") >= 1


def test_a_connection_idle_past_uvicorns_default_keep_alive_still_takes_a_request(server):
    """A router's pool reuses a connection after it sat idle for seconds; the worker must not have closed it
    (with uvicorn's 5 s default, a request sent as the server closes fails without reaching it)."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        for _ in range(2):
            conn.request("GET", "/health")
            answer = conn.getresponse()
            answer.read()
            assert answer.status == 200
            time.sleep(6)
    finally:
        conn.close()


def test_flush_cache(server):
    post(server, "/generate", {"text": LONG, "sampling_params": {"max_new_tokens": 2}})
    wait_pages_free(server)
    assert post(server, "/flush_cache", {}).json()["success"] is True
    assert server.metric("decode_worker_cache_pages", tier="device", state="evictable") == 0


def test_documented_fields_not_honoured_are_refused_by_name_and_neutral_values_pass(server):
    """A caller who asked for structural tags, best_of, predicted outputs or legacy functions hears so; nothing is
    dropped with a 200."""
    refused = [
        ("/generate", {"text": "hi", "sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag"),
        ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "prediction": {"type": "content", "content": "x"}}, "prediction"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "functions": [{"name": "f"}]}, "functions"),
    ]
    for path, body, name in refused:
        r = post(server, path, body)
        assert r.status_code == 400, (path, r.text)
        assert f"'{name}' is not supported" in r.json()["error"]["message"]
    neutral = {"text": "hi", "logprob_start_len": -1, "my_router_tag": "x",
               "sampling_params": {"max_new_tokens": 2, "n": 1, "frequency_penalty": 0, "skip_special_tokens": True}}
    assert post(server, "/generate", neutral).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "user": "u1"}
    assert post(server, "/v1/chat/completions", chat).status_code == 200
    wait_pages_free(server)


def sse_chunks(server, path, body) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_n_samples_on_every_route_differ_repeat_with_a_seed_and_count_the_prompt_once(server):
    sampled = {"max_new_tokens": 6, "temperature": 1.0, "n": 3, "sampling_seed": 7, "ignore_eos": True}
    outs = post(server, "/generate", {"text": "Once upon a time", "sampling_params": sampled}).json()
    assert isinstance(outs, list) and len(outs) == 3 and all(len(o["output_ids"]) == 6 for o in outs)
    assert len({tuple(o["output_ids"]) for o in outs}) > 1, "three samples with seeds 7, 8, 9 all alike"
    again = post(server, "/generate", {"text": "Once upon a time", "sampling_params": sampled}).json()
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
    assert all(o["meta_info"]["e2e_latency"] > 0 for o in outs)
    comp = post(server, "/v1/completions", {"prompt": ["A", "B"], "n": 2, "max_tokens": 3, "ignore_eos": True}).json()
    assert [c["index"] for c in comp["choices"]] == [0, 1, 2, 3]
    one = post(server, "/v1/completions", {"prompt": "A", "max_tokens": 3, "ignore_eos": True}).json()
    assert comp["usage"]["prompt_tokens"] == 2 * one["usage"]["prompt_tokens"]
    assert comp["usage"]["completion_tokens"] == 12 and "cached_tokens" in comp["usage"]["prompt_tokens_details"]
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 2,
                                                 "max_tokens": 3}).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    wait_pages_free(server)


def test_a_batched_stream_interleaves_its_prompts(server):
    body = {"input_ids": [[1, 504, 3575], [1, 504, 17]], "stream": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}
    order = [c["index"] for c in sse_chunks(server, "/generate", body)]
    assert sorted(order) == [0] * 10 + [1] * 10
    assert order.index(1) < len(order) - 1 - order[::-1].index(0), f"prompt 1 waited for prompt 0: {order}"


def test_include_usage_ends_openai_streams_with_the_usage(server):
    for path, body in (("/v1/completions", {"prompt": "Hello", "n": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]})):
        chunks = sse_chunks(server, path, {**body, "max_tokens": 4, "ignore_eos": True, "stream": True,
                                           "stream_options": {"include_usage": True}})
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4 * body.get("n", 1)
        assert all("usage" not in c or c["usage"] is None for c in chunks[:-1])
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    parts = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], n=2,
                                                max_tokens=3, stream=True, stream_options={"include_usage": True}))
    assert {p.choices[0].index for p in parts if p.choices} == {0, 1} and parts[-1].usage.completion_tokens == 6


def test_abort_request_ends_a_live_stream_and_get_version_answers(server):
    body = {"text": "Tell me a long story", "rid": "to-abort", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it runs
        assert post(server, "/abort_request", {"rid": "to-abort"}).json() == {"aborted": 1}
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert rest[-1]["error"]["code"] == 499
    reason = rest[-2]["meta_info"]["finish_reason"]  # the last chunk keeps the tokens streamed and says abort
    assert reason["type"] == "abort" and reason["status_code"] == 499 and rest[-2]["output_ids"], rest[-2]
    assert post(server, "/abort_request", {"rid": "to-abort"}).json() == {"aborted": 0}
    assert httpx.get(server.url + "/get_version").json()["version"]
    wait_pages_free(server)


def test_request_metrics_users_chart_carry_the_model_name(server):
    before = {name: server.metric(name, default=0) for name in (
        "decode_worker_output_tokens_total", "decode_worker_e2e_request_latency_seconds_count",
        "decode_worker_inter_token_latency_seconds_count", "decode_worker_queue_time_seconds_count")}
    success = server.metric("decode_worker_request_success_total", finish_reason="length", default=0)
    out = post(server, "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
    assert out.status_code == 200
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    after = {name: server.metric(name, model_name=model) for name in before}
    assert after["decode_worker_output_tokens_total"] - before["decode_worker_output_tokens_total"] == 5
    assert after["decode_worker_inter_token_latency_seconds_count"] - before["decode_worker_inter_token_latency_seconds_count"] == 4
    for name in ("decode_worker_e2e_request_latency_seconds_count", "decode_worker_queue_time_seconds_count"):
        assert after[name] - before[name] == 1, name
    assert server.metric("decode_worker_request_success_total", finish_reason="length") - success == 1
    text = httpx.get(server.url + "/metrics").text
    assert all(f'model_name="{model}"' in line for line in text.splitlines()
               if line.startswith("decode_worker_") and "{" in line)
    wait_pages_free(server)


def test_startup_line_says_what_runs_and_probes_stay_out_of_the_access_log(server):
    for path in ("/health", "/metrics", "/v1/models", "/health"):
        httpx.get(server.url + path, timeout=10)
    log = server.log.read_text(errors="replace")
    start = next(line for line in log.splitlines() if "starting: role colocated" in line)
    for part in ("model ", "dtype float32", "device cpu", "L1 4096 tokens (", "L2 off", "L3 off", "http 127.0.0.1:"):
        assert part in start, (part, start)
    assert '"GET /v1/models HTTP/1.1" 200' in log
    assert '"GET /health HTTP' not in log and '"GET /metrics HTTP' not in log
    access = [line for line in log.splitlines() if "uvicorn.access" in line]
    assert access and all(" INFO uvicorn.access: " in line for line in access), access[:3]


def test_penalties_pick_what_the_penalised_distribution_ranks_first(server):
    """Greedy under presence and frequency penalties: at each step no reported alternative, penalised by what the
    output held before it, beats the chosen token penalised the same way (logprobs are the model's own)."""
    fp, pp = 0.7, 0.9
    body = {"text": "The the the the the the", "return_logprob": True, "top_logprobs_num": 20,
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True,
                                "frequency_penalty": fp, "presence_penalty": pp}}
    out = post(server, "/generate", body).json()
    meta, ids = out["meta_info"], out["output_ids"]
    assert len(meta["output_top_logprobs"]) == len(ids) == 24
    plain = post(server, "/generate", {**body, "sampling_params": {**body["sampling_params"], "frequency_penalty": 0,
                                                                    "presence_penalty": 0}}).json()
    assert plain["output_ids"] != ids, "the penalties changed nothing"
    for step, (chosen, top) in enumerate(zip(meta["output_token_logprobs"], meta["output_top_logprobs"])):
        before = ids[:step]

        def penalised(lp, t, before=before):
            n = before.count(t)
            return lp - fp * n - (pp if n else 0)

        assert all(penalised(lp, t) <= penalised(chosen[0], chosen[1]) + 1e-4 for lp, t, _ in top), step


def test_min_new_tokens_holds_off_a_stop_token_and_special_tokens_can_stay(server):
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    first = post(server, "/generate", body).json()["output_ids"][0]
    stopped = post(server, "/generate", {**body, "sampling_params": {**body["sampling_params"],
                                                                       "stop_token_ids": [first]}}).json()
    assert stopped["output_ids"] == [first] and stopped["meta_info"]["finish_reason"]["type"] == "stop"
    held = post(server, "/generate", {**body, "sampling_params": {**body["sampling_params"], "stop_token_ids": [first],
                                                                    "min_new_tokens": 3}}).json()
    assert len(held["output_ids"]) >= 3 and first not in held["output_ids"][:3]
    special = {"input_ids": [1, 504], "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True,
                                                          "stop_token_ids": [2], "min_new_tokens": 0}}
    kept = post(server, "/generate", {**special, "sampling_params": {**special["sampling_params"],
                                                                      "skip_special_tokens": False}}).json()
    skipped = post(server, "/generate", special).json()
    assert kept["output_ids"] == skipped["output_ids"]
    tokenizer_specials = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    has_special = any(s in kept["text"] for s in tokenizer_specials)
    assert has_special == (kept["text"] != skipped["text"])
    wait_pages_free(server)


def test_openai_logprobs_and_echo_through_the_official_client(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0,
                                     logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(alts) == 2 and max(alts.values()) >= chosen - 1e-4 for alts, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert "".join(lp.tokens) == comp.choices[0].text and lp.text_offset[0] == 0
    echoed = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "The capital of France is" + comp.choices[0].text
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    streamed = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=4, temperature=0, logprobs=True, stream=True))
    tokens = [c.token for p in streamed if p.choices and p.choices[0].logprobs for c in p.choices[0].logprobs.content]
    assert tokens == [c.token for c in content]
    r = post(server, "/generate", {"text": "Hi", "return_logprob": True, "logprob_start_len": 5})
    assert r.status_code == 400 and "logprob_start_len must be" in r.json()["error"]["message"]
    wait_pages_free(server)
