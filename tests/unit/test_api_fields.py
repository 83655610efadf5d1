"""Every documented field is honoured or refused with a message naming it; undocumented ones are ignored with a
warning (once per field)."""
from __future__ import annotations

import logging

import pytest

from decode_worker.server import schemas
from decode_worker.server.schemas import (
    GENERATE,
    OPENAI,
    SAMPLING,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    check_fields,
)

# One value per refused field that asks for something this worker does not do.
ASKING = {
    "input_embeds": [[0.1]], "image_data": "x.png", "audio_data": "x.wav", "video_data": "x.mp4",
    "logprob_start_len": 0, "top_logprobs_num": 5, "token_ids_logprob": [1, 2], "return_text_in_logprobs": True,
    "lora_path": "adapter", "custom_logit_processor": "{}", "return_hidden_states": True,
    "min_p": 0.1, "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.2,
    "min_new_tokens": 4, "structural_tag": "{}", "n": 2, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "no_stop_trim": True, "custom_params": [{}], "logit_bias": {"1": 5},
    "best_of": 3, "suffix": "end", "stream_options": {"include_usage": True}, "functions": [{"name": "f"}],
    "function_call": {"name": "f"}, "top_logprobs": 2, "audio": {"voice": "x"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "high", "store": True, "web_search_options": {},
    "return_entropy": True, "return_bytes": True, "return_prompt_token_ids": True, "background": True,
}
NEUTRAL = {
    "logprob_start_len": -1, "top_logprobs_num": 0, "return_text_in_logprobs": False, "return_hidden_states": False,
    "min_p": 0.0, "frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0,
    "n": 1, "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False,
    "logit_bias": {}, "best_of": 1, "suffix": "", "stream_options": {"include_usage": False},
    "function_call": "auto", "top_logprobs": 0, "modalities": ["text"], "store": False,
    "return_entropy": False, "return_bytes": False, "return_prompt_token_ids": False, "background": False,
}


def test_every_refused_field_has_a_value_that_asks_and_the_tables_name_no_schema_field():
    assert set(GENERATE) | set(SAMPLING) | set(OPENAI) <= set(ASKING)
    for model in (GenerateRequest, CompletionRequest, ChatCompletionRequest):
        assert not set(model.model_fields) & (set(GENERATE) | set(OPENAI)), "a field both honoured and refused"


@pytest.mark.parametrize("name", sorted(GENERATE))
def test_generate_refuses_each_documented_field_it_does_not_honour(name):
    with pytest.raises(ValueError, match=f"field '{name}' is not supported"):
        check_fields(GenerateRequest, {"text": "hi", name: ASKING[name]}, "/generate")
    check_fields(GenerateRequest, {"text": "hi", name: NEUTRAL.get(name)}, "/generate")


@pytest.mark.parametrize("name", sorted(SAMPLING))
def test_sampling_params_refuse_each_documented_field_they_do_not_honour_also_in_a_batch(name):
    with pytest.raises(ValueError, match=f"field 'sampling_params.{name}' is not supported"):
        check_fields(GenerateRequest, {"text": "hi", "sampling_params": {name: ASKING[name]}}, "/generate")
    with pytest.raises(ValueError, match=rf"field 'sampling_params\.1\.{name}' is not supported"):
        check_fields(GenerateRequest, {"text": ["a", "b"], "sampling_params": [{}, {name: ASKING[name]}]}, "/generate")
    check_fields(GenerateRequest, {"text": "hi", "sampling_params": {name: NEUTRAL.get(name)}}, "/generate")


@pytest.mark.parametrize("route,model", [("/v1/completions", CompletionRequest),
                                         ("/v1/chat/completions", ChatCompletionRequest)])
@pytest.mark.parametrize("name", sorted(OPENAI))
def test_openai_routes_refuse_each_documented_field_they_do_not_honour(route, model, name):
    with pytest.raises(ValueError, match=f"field '{name}' is not supported"):
        check_fields(model, {name: ASKING[name]}, route)
    check_fields(model, {name: NEUTRAL.get(name)}, route)


def test_what_sglang_router_forwards_at_its_defaults_passes_without_a_warning(caplog):
    """sglang-router forwards SGLang's request defaults (seen from bench_serving): none of them is a warning."""
    schemas._warned.clear()
    with caplog.at_level(logging.WARNING, logger="decode_worker.server.schemas"):
        check_fields(GenerateRequest, {"text": "hi", "background": False, "return_bytes": False,
                                       "return_entropy": False, "return_prompt_token_ids": False}, "/generate")
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_an_undocumented_field_is_ignored_with_one_warning(caplog):
    schemas._warned.clear()
    with caplog.at_level(logging.WARNING, logger="decode_worker.server.schemas"):
        for _ in range(3):
            check_fields(GenerateRequest, {"text": "hi", "my_router_tag": 1, "sampling_params": {"my_knob": 2}},
                         "/generate")
    messages = [r.getMessage() for r in caplog.records]
    assert sum("'my_router_tag'" in m for m in messages) == 1
    assert sum("'sampling_params.my_knob'" in m for m in messages) == 1
    check_fields(ChatCompletionRequest, {"messages": [], "user": "u1", "metadata": {"a": "b"}}, "/v1/chat/completions")
    assert not any("'user'" in r.getMessage() for r in caplog.records)
