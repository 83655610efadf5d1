"""Structured outputs over a real worker process serving a tiny random-weight model: every grammar field on every
route, whole and streamed, through the official ``openai`` client too. The weights are noise, so whatever comes
out valid came out valid because of the grammar; a grammar that cannot compile is a 400 naming its field."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema_rs
import pytest

from tests.servers import Proc, start_worker, wait_pages_free
from tests.tiny_model import save_tiny_chat_model

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "size", "n"], "additionalProperties": False}
REGEX = r"(yes|no), [0-9]{2}"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> Iterator[Proc]:
    model: Path = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-structured"))
    proc = start_worker("structured", tmp_path_factory.mktemp("structured-logs"), "colocated", "--model-path",
                        str(model))
    yield proc
    wait_pages_free(proc)
    proc.stop()


def post(proc: Proc, path: str, body: dict) -> httpx.Response:
    return httpx.post(proc.url + path, json=body, timeout=120)


def sse(proc: Proc, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", proc.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def schema_format(schema: dict = SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def valid(text: str) -> dict:
    value = json.loads(text)
    jsonschema_rs.validate(SCHEMA, value)
    return value


@pytest.mark.parametrize("path,body,field,says", [
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": '{"type": "object", '}}, "sampling_params.json_schema",
     "JSON"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "(ab"}}, "sampling_params.regex", "parenthesis"),
    ("/generate", {"text": "hi", "sampling_params": {"ebnf": "root ::= nowhere"}}, "sampling_params.ebnf", "nowhere"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": schema_format({"type": "strnig"})},
     "response_format.json_schema.schema", "strnig"),
    ("/v1/completions", {"prompt": "hi", "regex": "[z-a]"}, "regex", "cannot compile the regex"),
    ("/v1/chat/completions", {"messages": MESSAGES, "ebnf": 'root ::= "a" | '}, "ebnf", "cannot compile the ebnf"),
])
def test_a_grammar_that_cannot_compile_is_a_400_naming_its_field(worker, path, body, field, says):
    for stream in (False, True):  # refused before a stream starts, as before a whole answer
        r = post(worker, path, {**body, "stream": stream})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert message.startswith(f"{field}: ") and says in message, message


@pytest.mark.parametrize("path,body,says", [
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": "{}", "regex": "a"}},
     "sampling_params.json_schema and sampling_params.regex each ask for a grammar"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_object"}, "regex": "a"},
     "response_format and regex each ask for a grammar"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema"}},
     "response_format.json_schema is required"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "structural_tag"}}, "response_format"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "a+", "min_new_tokens": 2}},
     "min_new_tokens cannot be combined with sampling_params.regex"),
])
def test_grammar_fields_that_disagree_are_a_400_naming_them(worker, path, body, says):
    r = post(worker, path, body)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_every_route_keeps_to_its_grammar_whole_and_streamed(worker):
    gen = post(worker, "/generate", {"text": ["a", "b"], "sampling_params": [
        {"max_new_tokens": 200, "temperature": 1.0, "sampling_seed": 3, "json_schema": json.dumps(SCHEMA)},
        {"max_new_tokens": 40, "temperature": 1.0, "sampling_seed": 4, "regex": REGEX}]}).json()
    valid(gen[0]["text"])
    assert re.fullmatch(REGEX, gen[1]["text"]) and gen[1]["meta_info"]["finish_reason"]["type"] == "stop"
    streamed = sse(worker, "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 40, "regex": REGEX}})
    assert re.fullmatch(REGEX, streamed[-1]["text"]) and len(streamed) > 2
    chunks = sse(worker, "/v1/completions", {"prompt": "a", "max_tokens": 40, "regex": REGEX})
    assert re.fullmatch(REGEX, "".join(c["choices"][0]["text"] for c in chunks))
    chunks = sse(worker, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 200, "n": 2, "seed": 5,
                                                  "response_format": schema_format()})
    for index in (0, 1):
        valid("".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"][0]["index"] == index))
    # Any object is unbounded: a seed whose object closes well within the limit (unseeded, a third run past it).
    chunks = sse(worker, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 300, "seed": 4,
                                                  "response_format": {"type": "json_object"}})
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads("".join(c["choices"][0]["delta"].get("content", "") for c in chunks)), dict)


def test_the_openai_client_gets_schema_valid_json_and_a_regex_shaped_answer(worker):
    from openai import OpenAI
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    client = OpenAI(base_url=worker.url + "/v1", api_key="none", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=200,
                                                           response_format=schema_format())
    chat = ChatCompletion.model_validate(json.loads(raw.http_response.text), strict=True)
    assert chat.choices[0].finish_reason == "stop"
    valid(chat.choices[0].message.content)
    raw = client.completions.with_raw_response.create(model="tiny", prompt="a", max_tokens=40, temperature=0.8,
                                                      extra_body={"regex": REGEX})
    comp = Completion.model_validate(json.loads(raw.http_response.text), strict=True)
    assert re.fullmatch(REGEX, comp.choices[0].text) and comp.choices[0].finish_reason == "stop"
