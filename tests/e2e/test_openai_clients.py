"""What SGLang and OpenAI users send, through the real smg gateway in PD mode (router, prefill, decode as real
processes) and against a colocated worker: the same answers, each re-validated strictly against the official
``openai`` client's types, and PD's equal to colocated's."""
from __future__ import annotations

import copy
import json
import re

import httpx
import pytest

from tests.servers import start_router, start_workers, wait_pages_free

TOKEN = {"DECODE_WORKER_PD_TOKEN": "openai-e2e"}
PROMPT = "The capital of France is"
TOL = 1e-3  # prefill and colocated compute the same prompt; only batch shapes may differ in the last bits


@pytest.fixture(scope="module")
def targets(tmp_path_factory, smollm2_path):
    """{"pd": router URL, "colocated": worker URL}."""
    logs = tmp_path_factory.mktemp("openai-e2e-logs")
    workers = start_workers({"prefill": ("prefill", (), TOKEN),
                             "decode": ("decode", ("--disaggregation-decode-enable-radix-cache",), TOKEN),
                             "colocated": ("colocated", (), None)}, logs)
    prefill, decode, colocated = workers.values()
    router = start_router(logs, prefill, decode)
    yield {"pd": router.url, "colocated": colocated.url}
    wait_pages_free(decode)
    for proc in (router, decode, prefill, colocated):
        proc.stop()


def client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def strict(raw, model) -> dict:
    """The answer's JSON, re-validated strictly against the client's own type (the client itself does not).

    One documented exception: an echoed prompt's first token has a null logprob and null alternatives (nothing
    precedes it; OpenAI's API answered so, and vLLM does), which the client's types do not admit. Those nulls
    are checked to be exactly there and left out of the copy that is validated; the answer is returned whole."""
    assert raw.http_response.status_code == 200, raw.http_response.text
    body = json.loads(raw.http_response.text)
    checked = copy.deepcopy(body)
    for choice in checked.get("choices", []):
        lp = choice.get("logprobs") or {}
        if lp.get("token_logprobs") and lp["token_logprobs"][0] is None:
            assert lp["top_logprobs"] is None or lp["top_logprobs"][0] is None
            assert None not in lp["token_logprobs"][1:] and None not in (lp["top_logprobs"] or [])[1:]
            for key in ("tokens", "token_logprobs", "text_offset") + (("top_logprobs",) if lp["top_logprobs"] else ()):
                del lp[key][0]
    model.model_validate(checked, strict=True)
    return body


def score(url: str, prompt, max_tokens: int, k: int = 1):
    from openai.types import Completion

    raw = client(url).completions.with_raw_response.create(model="default", prompt=prompt, max_tokens=max_tokens,
                                                            temperature=0, echo=True, logprobs=k)
    return strict(raw, Completion)


def close(a: list, b: list) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or abs(x - y) < TOL for x, y in zip(a, b))


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(targets, max_tokens):
    """lm-evaluation-harness's log-likelihood request: echo, logprobs, max_tokens 0 (or 1). Text prompts: smg
    refuses token-id prompts on this route (lm-eval's ``tokenized_requests=False``); a colocated worker takes both."""
    answers = {name: score(url, PROMPT, max_tokens, 2) for name, url in targets.items()}
    n = answers["colocated"]["usage"]["prompt_tokens"]
    answers["token ids"] = score(targets["colocated"], _prompt_ids(targets["colocated"]), max_tokens, 2)
    for name, comp in answers.items():
        lp = comp["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == n + max_tokens == len(lp["token_logprobs"]) == len(lp["top_logprobs"]), name
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(x <= 0 for x in lp["token_logprobs"][1:])
        assert all(len(row) == 2 and max(row.values()) >= chosen - 1e-5
                   for row, chosen in zip(lp["top_logprobs"][1:], lp["token_logprobs"][1:]))
        assert comp["usage"]["completion_tokens"] == max_tokens
    for name in ("pd", "token ids"):
        assert close(answers[name]["choices"][0]["logprobs"]["token_logprobs"],
                     answers["colocated"]["choices"][0]["logprobs"]["token_logprobs"]), name


def _prompt_ids(url: str) -> list[int]:
    """PROMPT's token ids, from the worker's own tokenizer (echoed with logprobs: one token per entry)."""
    out = httpx.post(url + "/generate", timeout=60, json={"text": PROMPT, "return_logprob": True,
                                                         "logprob_start_len": 0,
                                                         "sampling_params": {"max_new_tokens": 0}}).json()
    return [token for _, token, _ in out["meta_info"]["input_token_logprobs"]]


def test_generate_prompt_logprobs_through_pd_equal_colocated(targets):
    body = {"text": PROMPT, "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 3,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    out = {name: httpx.post(url + "/generate", json=body, timeout=120).json() for name, url in targets.items()}
    pd, co = out["pd"]["meta_info"], out["colocated"]["meta_info"]
    n = co["prompt_tokens"]
    assert len(pd["input_token_logprobs"]) == len(co["input_token_logprobs"]) == n - 2  # not doubled by the router
    assert [e[1:] for e in pd["input_token_logprobs"]] == [e[1:] for e in co["input_token_logprobs"]]
    assert close([e[0] for e in pd["input_token_logprobs"]], [e[0] for e in co["input_token_logprobs"]])
    assert [[e[1] for e in row] for row in pd["input_top_logprobs"]] == \
        [[e[1] for e in row] for row in co["input_top_logprobs"]]
    assert out["pd"]["output_ids"] == out["colocated"]["output_ids"]
    assert [len(row) for row in pd["output_top_logprobs"]] == [3] * 4
    assert close([e[0] for e in pd["output_token_logprobs"]], [e[0] for e in co["output_token_logprobs"]])


def test_top_logprobs_on_both_routes_through_pd(targets):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chats, comps = {}, {}
    for name, url in targets.items():
        raw = client(url).chat.completions.with_raw_response.create(
            model="default", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=5)
        chats[name] = strict(raw, ChatCompletion)
        raw = client(url).completions.with_raw_response.create(model="default", prompt=PROMPT, max_tokens=5,
                                                                temperature=0, logprobs=3)
        comps[name] = strict(raw, Completion)
    for chat in chats.values():
        content = chat["choices"][0]["logprobs"]["content"]
        assert len(content) == 5 and all(len(c["top_logprobs"]) == 5 for c in content)
    assert [c["token"] for c in chats["pd"]["choices"][0]["logprobs"]["content"]] == \
        [c["token"] for c in chats["colocated"]["choices"][0]["logprobs"]["content"]]
    pd, co = (comps[name]["choices"][0]["logprobs"] for name in ("pd", "colocated"))
    assert [list(row) for row in pd["top_logprobs"]] == [list(row) for row in co["top_logprobs"]]
    assert close(pd["token_logprobs"], co["token_logprobs"])


def test_streamed_echo_carries_the_prompt_logprobs(targets):
    for url in targets.values():
        chunks = list(client(url).completions.create(model="default", prompt=PROMPT, max_tokens=3, temperature=0,
                                                     echo=True, logprobs=1, stream=True))
        first = chunks[0].choices[0]
        assert first.text == PROMPT and first.logprobs.token_logprobs[0] is None
        tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
        assert "".join(tokens).startswith(PROMPT)


def test_n_choices_through_pd_on_every_route(targets):
    """smg sends one room per choice on chat and one per prompt elsewhere: each choice gets its own room
    either way, and its first token (sampled on prefill under the choice's seed) is the colocated worker's."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    messages = [{"role": "user", "content": "Name a colour."}]
    seeded = {"max_tokens": 4, "temperature": 1.0, "seed": 11, "n": 3}
    firsts = {}
    for name, url in targets.items():
        raw = client(url).chat.completions.with_raw_response.create(model="default", messages=messages,
                                                                    logprobs=True, **seeded)
        chat = strict(raw, ChatCompletion)
        raw = client(url).completions.with_raw_response.create(model="default", prompt=PROMPT, logprobs=0, **seeded)
        comp = strict(raw, Completion)
        gen = httpx.post(url + "/generate", timeout=120, json={
            "text": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 11, "n": 3}}).json()
        assert sorted(c["index"] for c in chat["choices"]) == sorted(c["index"] for c in comp["choices"]) == [0, 1, 2]
        assert len(gen) == 3 and all(len(g["output_ids"]) == 4 for g in gen)
        firsts[name] = ([c["logprobs"]["content"][0]["token"] for c in chat["choices"]],
                        [c["logprobs"]["tokens"][0] for c in comp["choices"]], [g["output_ids"][0] for g in gen])
    assert firsts["pd"] == firsts["colocated"]
    greedy = {name: client(url).completions.create(model="default", prompt=PROMPT, max_tokens=5, temperature=0,
                                                   n=3) for name, url in targets.items()}
    texts = {name: [c.text for c in sorted(g.choices, key=lambda c: c.index)] for name, g in greedy.items()}
    assert texts["pd"] == texts["colocated"] == [texts["colocated"][0]] * 3


def test_a_model_by_id(targets):
    from openai import NotFoundError
    from openai.types import Model

    url = targets["colocated"]
    listed = client(url).models.list().data[0].id
    raw = client(url).models.with_raw_response.retrieve(listed)
    assert strict(raw, Model)["id"] == listed
    with pytest.raises(NotFoundError):
        client(url).models.retrieve("no-such-model")


CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                "country": {"type": "string", "maxLength": 24}},
               "required": ["city", "country"], "additionalProperties": False}
CITY_QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in JSON: the city and its country."}]


def test_json_schema_answers_through_pd_are_valid_and_equal_colocated(targets):
    """Prefill samples the first token under the schema and decode carries on in the same grammar from it: the
    greedy PD answer is the colocated one, whole and streamed, and the client's own parse() accepts it."""
    import jsonschema_rs
    from openai.types.chat import ChatCompletion
    from pydantic import BaseModel, ConfigDict

    class City(BaseModel):
        model_config = ConfigDict(extra="forbid")
        city: str
        country: str

    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}
    answers = {}
    for name, url in targets.items():
        raw = client(url).chat.completions.with_raw_response.create(
            model="default", messages=CITY_QUESTION, max_tokens=40, temperature=0, response_format=fmt)
        body = strict(raw, ChatCompletion)
        answers[name] = body["choices"][0]["message"]["content"]
        jsonschema_rs.validate(CITY_SCHEMA, json.loads(answers[name]))
        assert body["choices"][0]["finish_reason"] == "stop"
        chunks = client(url).chat.completions.create(model="default", messages=CITY_QUESTION, max_tokens=40,
                                                     temperature=0, response_format=fmt, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answers[name]
    assert answers["pd"] == answers["colocated"]
    parsed = client(targets["pd"]).chat.completions.parse(model="default", messages=CITY_QUESTION, max_tokens=40,
                                                          temperature=0, response_format=City)
    assert parsed.choices[0].message.parsed == City.model_validate_json(answers["colocated"])


def test_regex_shaped_answers_through_pd_on_every_route(targets):
    from openai.types import Completion

    shape = r" [A-Z][a-z]+\."
    for name, url in targets.items():
        raw = client(url).completions.with_raw_response.create(model="default", prompt=PROMPT, max_tokens=12,
                                                                temperature=0.7, seed=3, extra_body={"regex": shape})
        text = strict(raw, Completion)["choices"][0]["text"]
        assert re.fullmatch(shape, text), (name, text)
        out = httpx.post(url + "/generate", timeout=120, json={
            "text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "regex": shape}}).json()
        assert re.fullmatch(shape, out["text"]) and out["meta_info"]["finish_reason"]["type"] == "stop", (name, out)
    obj = client(targets["pd"]).chat.completions.create(model="default", messages=CITY_QUESTION, max_tokens=40,
                                                        temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", pytest.param({"type": "function", "function": {"name": "get_weather"}},
                                                             marks=pytest.mark.slow)],  # the tiny worker's test has it
                         ids=["required", "named"])
def test_a_tool_call_through_pd_whole_and_streamed(targets, choice):
    """The client gets a call it can run (its arguments keep to the tool's schema), streamed as its accumulator
    expects, and PD's greedy call is the colocated worker's."""
    import jsonschema_rs
    from openai.types.chat import ChatCompletion

    ask = {"model": "default", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
           "tools": [WEATHER_TOOL], "tool_choice": choice, "max_tokens": 60, "temperature": 0}
    calls = {}
    for name, url in targets.items():
        body = strict(client(url).chat.completions.with_raw_response.create(**ask), ChatCompletion)
        choice0 = body["choices"][0]
        assert choice0["finish_reason"] == "tool_calls" and choice0["message"]["content"] is None, (name, body)
        (call,) = choice0["message"]["tool_calls"]
        assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
        jsonschema_rs.validate(WEATHER_TOOL["function"]["parameters"], json.loads(call["function"]["arguments"]))
        calls[name] = call["function"]
        with client(url).chat.completions.stream(**ask) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion().choices[0]
        assert final.finish_reason == "tool_calls" and not final.message.content
        assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
            [(call["function"]["name"], call["function"]["arguments"])]
    assert calls["pd"] == calls["colocated"]
