"""Tool calls over a real worker process serving a tiny random-weight model, through the official ``openai``
client with its types re-validated strictly. The weights are noise: a valid call under ``tool_choice`` required or
naming a function is the grammar's doing, never the model's; what a request cannot have is a 400 naming it."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema_rs
import pytest

from tests.servers import Proc, start_worker, wait_pages_free
from tests.tiny_model import save_tiny_chat_model

UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1,
                                                                                "maximum": 7}},
        "required": ["unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "forecast", "description": "Weather forecast", "parameters": UNIT}},
         {"type": "function", "function": {"name": "alarm", "parameters": {
             "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
             "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Forecast?"}]


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> Iterator[Proc]:
    model: Path = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-tools"))
    proc = start_worker("tools", tmp_path_factory.mktemp("tools-logs"), "colocated", "--model-path", str(model))
    yield proc
    wait_pages_free(proc)
    proc.stop()


def client(proc: Proc):
    from openai import OpenAI

    return OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0)


def check_calls(calls, allowed: set[str]) -> None:
    """Each call names an allowed function and its arguments keep to that function's schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in allowed
        assert jsonschema_rs.validator_for(schemas[call.function.name]).is_valid(json.loads(call.function.arguments))


@pytest.mark.parametrize("choice,allowed", [("required", {"forecast", "alarm"}),
                                            ({"type": "function", "function": {"name": "alarm"}}, {"alarm"})],
                         ids=["required", "named"])
def test_a_required_call_is_valid_from_noise_weights_whole_and_streamed(worker, choice, allowed):
    from openai.types.chat import ChatCompletion

    ask = {"model": "default", "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "max_tokens": 400,
           "temperature": 1.0, "seed": 3, "parallel_tool_calls": False}
    raw = client(worker).chat.completions.with_raw_response.create(n=2, **ask)
    assert raw.http_response.status_code == 200, raw.http_response.text
    answer = ChatCompletion.model_validate(json.loads(raw.http_response.text), strict=True)
    for c in answer.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
        check_calls(c.message.tool_calls, allowed)
    with client(worker).chat.completions.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and not final.message.content
    check_calls(final.message.tool_calls, allowed)
    assert any(e.type == "tool_calls.function.arguments.done" for e in events)
    assert not any(e.type == "content.delta" and e.delta for e in events)


def test_answers_with_calls_keep_to_the_declared_response_schema(worker):
    """What /openapi.json declares (and the schema fuzz holds workers to) admits call answers and call deltas."""
    from decode_worker.server.openapi import ChatCompletionChunk, ChatCompletionResponse

    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 400, "seed": 1}
    whole = httpx.post(worker.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert ChatCompletionResponse.model_validate(whole).choices[0].message.tool_calls
    with httpx.stream("POST", worker.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [ChatCompletionChunk.model_validate(c).choices[0].delta for c in chunks]
    assert [d.tool_calls[0].function.name is not None for d in deltas if d.tool_calls] == [True, False]


def test_a_conversation_with_calls_and_results_goes_back_to_the_model(worker):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_a", "type": "function", "function": {
            "name": "forecast", "arguments": '{"unit": "c", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny, 21"}]
    answer = client(worker).chat.completions.create(model="default", messages=history, tools=TOOLS, max_tokens=4,
                                                    temperature=0)
    assert answer.usage.prompt_tokens > 300  # the tools' definitions and the call and its result are in the prompt
    none = client(worker).chat.completions.create(model="default", messages=history, tools=TOOLS, tool_choice="none",
                                                  max_tokens=4, temperature=0)
    assert none.usage.prompt_tokens < answer.usage.prompt_tokens  # tool_choice none: the definitions are left out


@pytest.mark.parametrize("body,says", [
    ({"tool_choice": "required"}, "tool_choice 'required' needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names function 'nope', which is not among tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice and response_format each ask for a grammar"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "("}}}}}], "tool_choice": "required"}, "tools:"),
    ({"functions": [{"name": "f"}]}, ("field 'functions' is not supported by this worker (legacy function calls: "
                                      "send tools instead)")),
    ({"function_call": {"name": "f"}}, "field 'function_call' is not supported"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"messages": [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
     "messages[0].tool_call_id 'call_x' answers no earlier call"),
], ids=["required-without-tools", "unknown-name", "two-grammars", "bad-parameters", "functions", "function_call",
        "name", "orphan-result"])
def test_what_cannot_be_met_is_a_400_naming_the_field(worker, body, says):
    resp = httpx.post(worker.url + "/v1/chat/completions", timeout=60,
                      json={"messages": MESSAGES, "max_tokens": 4, **body})
    assert resp.status_code == 400 and says in resp.json()["error"]["message"], resp.text
