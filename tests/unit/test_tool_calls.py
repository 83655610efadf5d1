"""Tool calls without a worker: reading the model's answer (whole and streamed, well-formed or not), the schema a
required call is held to, the plan a request makes, the prompt that shows tools and past calls, and stream deltas
as the official client accumulates them."""
from __future__ import annotations

import json

import pytest

from decode_worker.core.request import RequestError
from decode_worker.server.schemas import ChatCompletionRequest
from decode_worker.server.tools.output import ChoiceDeltas, chat_message, finish_reason
from decode_worker.server.tools.parsers import FORMATS, ArrayReader, TaggedReader, ToolCall, read_all
from decode_worker.server.tools.render import chat_prompt
from decode_worker.server.tools.spec import pick_format, tool_plan

NAMES = frozenset({"get_weather", "add"})
HERMES = FORMATS["hermes"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add"}}


def call_text(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def streamed(reader, text: str, step: int = 1) -> tuple[str | None, list[ToolCall]]:
    """``text`` fed ``step`` characters at a time: what a stream would hand out, gathered."""
    items = [item for at in range(0, len(text), step) for item in reader.feed(text[at:at + step])] + reader.finish()
    content = "".join(i for i in items if isinstance(i, str))
    return content or None, [i for i in items if isinstance(i, ToolCall)]


def calls_of(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


# ---- reading Hermes answers ---------------------------------------------------------------------------------------

ANSWERS = {  # answer -> (content, calls)
    "Let me look.\n" + call_text("get_weather", {"city": "Paris"}) + "\n" + call_text("add", {"a": 1, "b": 2}):
        ("Let me look.", [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
    call_text("add", {}): (None, [("add", {})]),
    call_text("add", {"s": "</tool_call> and \"<tool_call>\""}) + "\nDone.":
        ("Done.", [("add", {"s": "</tool_call> and \"<tool_call>\""})]),
    "Just text, < and <tool and <tool_c.": ("Just text, < and <tool and <tool_c.", []),
    '<tool_call>{"name": "add", "arguments": {"a": 1}}': (None, [("add", {"a": 1})]),  # stopped before the end tag
    '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>': (None, [("add", {"a": 1})]),
    # malformed, unknown or cut short: content, as written
    "A <tool_call>{not json}</tool_call> B": ("A <tool_call>{not json}</tool_call> B", []),
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>':
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    '<tool_call>{"name": "add", "arguments": [1]}</tool_call>':
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', []),
    '<tool_call>{"name": "add", "arguments": {}, "extra": 1}</tool_call>':
        ('<tool_call>{"name": "add", "arguments": {}, "extra": 1}</tool_call>', []),
    '<tool_call>{"name": "add", "argu': ('<tool_call>{"name": "add", "argu', []),
    '<tool_call>{"name": ["add"], "arguments": {}}</tool_call>':
        ('<tool_call>{"name": ["add"], "arguments": {}}</tool_call>', []),
    # nested past the JSON parser's depth (its RecursionError once made a 500): content, as written
    "<tool_call>" + "[" * 5000 + "</tool_call>": ("<tool_call>" + "[" * 5000 + "</tool_call>", []),
    '<tool_call>{"name": "add", "arguments": "' + "[" * 5000 + '"}</tool_call>':
        ('<tool_call>{"name": "add", "arguments": "' + "[" * 5000 + '"}</tool_call>', []),
}


@pytest.mark.parametrize("answer", list(ANSWERS))
def test_hermes_answers_read_whole_and_streamed_alike(answer):
    content, calls = ANSWERS[answer]
    for step in (len(answer), 1, 3, 7):
        got_content, got_calls = streamed(TaggedReader(NAMES), answer, step)
        assert (got_content, calls_of(got_calls)) == (content, calls), step


def test_a_streamed_call_costs_linear_time_in_its_length():
    """Each delta once re-read the whole pending body for every end tag inside a string: a body 4x longer took
    ~64x longer (cubic). Read once, 4x the body takes ~4x the time; a margin of 3x over that for a noisy machine."""
    import time

    def stream_time(repeats: int) -> float:
        answer = call_text("add", {"s": "</tool_call>" * repeats})
        reader, start = TaggedReader(NAMES), time.perf_counter()
        content, calls = streamed(reader, answer, 2)
        assert content is None and calls_of(calls) == [("add", {"s": "</tool_call>" * repeats})]
        return time.perf_counter() - start

    stream_time(50)  # warm
    assert min(stream_time(800) for _ in range(3)) < 12 * min(stream_time(200) for _ in range(3))


def test_a_stream_never_sends_markup_or_an_unfinished_call():
    reader = TaggedReader(NAMES)
    answer = "Sure." + call_text("get_weather", {"city": "Oslo"})
    sent: list = []
    for at in range(len(answer) - 1):
        sent += reader.feed(answer[at])
        assert not any(isinstance(i, str) and "<" in i for i in sent), sent
        assert not any(isinstance(i, ToolCall) for i in sent)  # the call is complete only with its end tag
    sent += reader.feed(answer[-1]) + reader.finish()
    assert "".join(sent[:-1]) == "Sure." and calls_of([sent[-1]]) == [("get_weather", {"city": "Oslo"})]


def test_call_ids_are_unique_and_shaped_as_openai_does():
    _, calls = read_all(TaggedReader(NAMES), call_text("add", {}) * 3)
    assert len({c.id for c in calls}) == 3 and all(c.id.startswith("call_") for c in calls)
    assert calls[0].message() == {"id": calls[0].id, "type": "function",
                                  "function": {"name": "add", "arguments": "{}"}}


# ---- reading the constrained JSON array ---------------------------------------------------------------------------

ARRAYS = {
    '[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {"city": "[]{}\\"x"}}]':
        (None, [("add", {"a": 1}), ("get_weather", {"city": '[]{}"x'})]),
    ' [ {"name": "add", "arguments": {"n": [1, {"m": []}]}} ] ': (None, [("add", {"n": [1, {"m": []}]})]),
    '[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "argum': ('{"name": "add", "argum', [("add", {"a": 1})]),
    'Sure: [{"name": "add", "arguments": {}}]': ('Sure: [{"name": "add", "arguments": {}}]', []),
    '[{"name": "add", "arguments": {}}] and more': ("] and more", [("add", {})]),
    '[1, 2]': ("[1, 2]", []),
}


@pytest.mark.parametrize("answer", list(ARRAYS))
def test_constrained_arrays_read_whole_and_streamed_alike(answer):
    content, calls = ARRAYS[answer]
    for step in (len(answer), 1, 4):
        got_content, got_calls = streamed(ArrayReader(NAMES), answer, step)
        assert (got_content, calls_of(got_calls)) == (content, calls), step


# ---- the plan and the schema a required call is held to -----------------------------------------------------------

def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_auto_and_none_leave_the_answer_free():
    assert tool_plan(request(tools=[WEATHER, ADD], tool_choice="none"), HERMES) is None
    assert tool_plan(request(), HERMES) is None and tool_plan(request(tool_choice="auto"), HERMES) is None
    plan = tool_plan(request(tools=[WEATHER, ADD]), HERMES)
    assert plan.names == {"get_weather", "add"} and not plan.required and plan.json_schema() is None
    assert isinstance(plan.reader(), TaggedReader) and plan.stop() == []


def test_one_call_at_most_under_auto_stops_the_answer_after_its_first_call():
    plan = tool_plan(request(tools=[WEATHER, ADD], parallel_tool_calls=False), HERMES)
    assert plan.stop() == ["</tool_call>"]
    cut = "Sure.\n" + call_text("add", {"a": 1}).removesuffix("</tool_call>")  # the server trims the stop string
    content, calls = read_all(plan.reader(), cut)
    assert content == "Sure." and calls_of(calls) == [("add", {"a": 1})]
    assert tool_plan(request(tools=[ADD], tool_choice="required", parallel_tool_calls=False), HERMES).stop() == []


def test_required_is_an_array_of_calls_to_any_tool_each_held_to_its_arguments_schema():
    import jsonschema_rs

    plan = tool_plan(request(tools=[WEATHER, ADD], tool_choice="required"), HERMES)
    schema = json.loads(plan.json_schema())
    assert schema["minItems"] == 1 and "maxItems" not in schema
    valid = jsonschema_rs.validator_for(schema).is_valid
    assert valid([{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "add", "arguments": {"x": 1}}])
    for wrong in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "other", "arguments": {}}],
                  [{"name": "add", "arguments": {}, "more": 1}], [{"name": "add"}], {"name": "add", "arguments": {}}):
        assert not valid(wrong), wrong
    assert isinstance(plan.reader(), ArrayReader)
    single = json.loads(tool_plan(request(tools=[ADD], tool_choice="required", parallel_tool_calls=False),
                                  HERMES).json_schema())
    assert single["maxItems"] == 1 and single["items"]["properties"]["name"] == {"const": "add"}


def test_a_named_function_is_the_only_one_allowed_once():
    import jsonschema_rs

    named = {"type": "function", "function": {"name": "get_weather"}}
    plan = tool_plan(request(tools=[WEATHER, ADD], tool_choice=named), HERMES)
    assert plan.required and plan.names == {"get_weather"}
    valid = jsonschema_rs.validator_for(json.loads(plan.json_schema())).is_valid
    assert valid([{"name": "get_weather", "arguments": {"city": "Rome"}}])
    assert not valid([{"name": "add", "arguments": {}}])
    assert not valid([{"name": "get_weather", "arguments": {"city": "a"}}] * 2)


@pytest.mark.parametrize("fields,fragment", [
    ({"tool_choice": "required"}, "tool_choice 'required' needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}},
     "tool_choice names function 'add', which is not among tools"),
    ({"tools": [ADD, ADD]}, "tools: function name 'add' is given more than once"),
])
def test_choices_that_cannot_be_met_are_refused_naming_the_field(fields, fragment):
    with pytest.raises(RequestError, match=fragment):
        tool_plan(request(**fields), HERMES)


def test_the_format_follows_the_flag_or_the_template():
    from typing import get_args

    from decode_worker.config import ServerConfig

    assert set(get_args(ServerConfig.model_fields["tool_call_parser"].annotation)) == {"auto"} | set(FORMATS)
    assert pick_format("hermes", "") is HERMES
    assert pick_format("auto", "{{ messages }}") is HERMES  # no format shown: the default
    assert pick_format("auto", "... <tool_call> ...") is HERMES


# ---- the prompt ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from decode_worker.model.tokenizer import Tokenizer
    from tests.tiny_model import save_tokenizer

    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(path)
    return Tokenizer.load(path, ())


def prompt_text(tokenizer, messages: list[dict], tools: list[dict]) -> str:
    body = request(messages=messages, tools=tools or None)
    return tokenizer.decode(chat_prompt(tokenizer, body.messages, body.tools or [], HERMES), skip_special_tokens=False)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rain"}]},
]


def test_a_template_without_tools_gets_them_hermes_style_with_past_calls_and_results(tokenizer):
    text = prompt_text(tokenizer, CONVERSATION, [WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    listed = text.split("<tools>\n")[1].split("\n</tools>")[0]
    assert [json.loads(line) for line in listed.splitlines()] == [WEATHER]
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>'
            in text)
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n") in text
    assert text.count("<|im_start|>") == 5  # system, user, assistant, one user turn of results, the new turn


def test_without_tools_the_prompt_is_the_templates_own(tokenizer):
    plain = [{"role": "user", "content": "hi"}]
    assert prompt_text(tokenizer, plain, []) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_text(tokenizer, [{"role": "system", "content": "S"}] + plain, [WEATHER]).startswith(
        "<|im_start|>system\nS\n\n# Tools")
    assert prompt_text(tokenizer, plain, [WEATHER]).startswith("<|im_start|>system\n# Tools")


def test_a_template_that_shows_tool_calls_renders_them_itself(tokenizer):
    from decode_worker.model.tokenizer import Tokenizer

    own = ("{% for t in tools or [] %}[T:{{ t.function.name }}]{% endfor %}{% for m in messages %}"
           "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}:{{ c.function.arguments.city }}"
           "</tool_call>{% endfor %}{% if m.role == 'tool' %}(R:{{ m.tool_call_id }}={{ m.content }}){% endif %}"
           "{% endfor %}")
    native = Tokenizer(tokenizer.backend.__class__.from_pretrained(tokenizer.backend.name_or_path), ())
    native.backend.chat_template = own
    body = request(messages=CONVERSATION, tools=[WEATHER])
    text = native.decode(chat_prompt(native, body.messages, body.tools, HERMES))
    assert text == ("[T:get_weather]<tool_call>get_weather:Paris</tool_call><tool_call>get_weather:Rome</tool_call>"
                    "(R:call_1=sunny)(R:call_2=rain)")


@pytest.mark.parametrize("change,fragment", [
    (lambda m: m[3].pop("tool_call_id"), r"messages\[3\].tool_call_id is missing"),
    (lambda m: m[4].update(tool_call_id="call_9"), r"messages\[4\].tool_call_id 'call_9' answers no earlier call"),
    (lambda m: m[2]["tool_calls"][1]["function"].update(arguments="[1]"), r"messages\[2\].tool_calls: the arguments"),
    (lambda m: m[1].update(tool_calls=m[2]["tool_calls"]), r"messages\[1\].tool_calls: only an assistant"),
])
def test_a_malformed_conversation_is_refused_naming_the_message(tokenizer, change, fragment):
    messages = json.loads(json.dumps(CONVERSATION))
    change(messages)
    with pytest.raises(RequestError, match=fragment):
        prompt_text(tokenizer, messages, [WEATHER])


# ---- the answer in OpenAI's shape ---------------------------------------------------------------------------------

ANSWER = "Checking.\n" + call_text("get_weather", {"city": "Paris"}) + call_text("add", {"a": 2})


def test_the_message_carries_the_calls_and_the_finish_reason_says_so():
    plan = tool_plan(request(tools=[WEATHER, ADD]), HERMES)
    message = chat_message(plan, ANSWER)
    assert message["content"] == "Checking."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] \
        == [("function", "get_weather", {"city": "Paris"}), ("function", "add", {"a": 2})]
    assert finish_reason("stop", True) == "tool_calls" and finish_reason("length", True) == "length"
    assert finish_reason("stop", False) == "stop"
    assert chat_message(None, ANSWER) == {"role": "assistant", "content": ANSWER}
    assert chat_message(plan, "plain") == {"role": "assistant", "content": "plain"}


@pytest.mark.parametrize("step", [1, 5, len(ANSWER)])
def test_stream_deltas_accumulate_in_the_official_client_to_the_whole_message(step):
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    plan = tool_plan(request(tools=[WEATHER, ADD]), HERMES)
    deltas_of = ChoiceDeltas(plan)
    deltas = [{"role": "assistant", "content": ""}]
    for at in range(0, len(ANSWER), step):
        deltas += deltas_of.feed(ANSWER[at:at + step])
    deltas += deltas_of.finish()
    assert deltas_of.called and not any("<" in d.get("content", "") for d in deltas)
    state = ChatCompletionStreamState(input_tools=[WEATHER, ADD])
    for i, delta in enumerate(deltas + [{}]):
        reason = finish_reason("stop", deltas_of.called) if i == len(deltas) else None
        state.handle_chunk(ChatCompletionChunk.model_validate(
            {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}))
    final = state.get_final_completion().choices[0]
    whole = chat_message(plan, ANSWER)
    assert final.finish_reason == "tool_calls" and final.message.content == whole["content"]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    assert all(c.id.startswith("call_") and c.type == "function" for c in final.message.tool_calls)
