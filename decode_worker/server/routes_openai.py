"""OpenAI completions, chat and models, with SGLang's extras."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from decode_worker.config import ServerConfig
from decode_worker.core.request import GenerateInput, PromptLogprobs, RequestError
from decode_worker.core.sampling import SamplingParams
from decode_worker.engine.engine import Engine
from decode_worker.server.generation import Collected, admit, collect, interleave, sse_response, token_text
from decode_worker.server.inputs import (
    EngineDep,
    bootstrap,
    bootstrap_per_choice,
    choice_inputs,
    openai_grammar,
    parse_body,
    stop_list,
)
from decode_worker.server.openapi import (
    CHAT_EXAMPLES,
    COMPLETION_EXAMPLES,
    ChatCompletionEvent,
    ChatCompletionResponse,
    CompletionEvent,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    auth_statuses,
    errors,
    generation_errors,
    json_body,
    sse_content,
)
from decode_worker.server.schemas import ChatCompletionRequest, CompletionRequest, OpenAISampling
from decode_worker.server.tools.output import ChoiceDeltas, chat_message, finish_reason
from decode_worker.server.tools.render import chat_prompt
from decode_worker.server.tools.spec import ToolPlan, pick_format, tool_plan


def router(cfg: ServerConfig) -> APIRouter:
    """``cfg`` picks the declared errors."""
    routes = APIRouter()
    routes.add_api_route("/v1/completions", completions, methods=["POST"], response_model=None,
                         openapi_extra=json_body(CompletionRequest, COMPLETION_EXAMPLES),
                         responses={200: {"model": CompletionResponse, "content": sse_content(CompletionEvent)},
                                    **generation_errors(cfg)})
    routes.add_api_route("/v1/chat/completions", chat, methods=["POST"], response_model=None,
                         openapi_extra=json_body(ChatCompletionRequest, CHAT_EXAMPLES),
                         responses={200: {"model": ChatCompletionResponse, "content": sse_content(ChatCompletionEvent)},
                                    **generation_errors(cfg)})
    routes.add_api_route("/v1/models", models, methods=["GET"], response_model=None,
                         responses={200: {"model": ModelList}, **errors(*auth_statuses(cfg), 503)})
    routes.add_api_route("/v1/models/{model_id:path}", model, methods=["GET"], response_model=None,
                         openapi_extra={"parameters": [{"name": "model_id", "in": "path", "required": True,
                                                        "schema": {"type": "string"}}]},
                         responses={200: {"model": ModelCard}, **errors(*auth_statuses(cfg), 503),
                                    404: {"model": ErrorResponse, "description": "no model by that id here"}})
    return routes


async def completions(request: Request, engine: EngineDep) -> dict | StreamingResponse:
    body = await parse_body(request, CompletionRequest)
    engine.require_ready()
    inputs = _completion_inputs(body, engine)
    await admit(engine, request, inputs)
    created, model = int(time.time()), engine.model_name
    if body.stream:
        return sse_response(_completion_chunks(engine, inputs, body, created, model))
    results = await collect(engine, request, inputs)
    echo = _echoes(body, inputs, engine)
    choices = [{"index": i, "text": echo[i] + c.text(), "finish_reason": _finish(c),
                "logprobs": _joined(_echo_lp(engine, body, inputs[i], c),
                                    _completion_lp(engine, body, c.ids, c.logprobs, c.top_logprobs, len(echo[i])))}
               for i, c in enumerate(results)]
    return {**_envelope(inputs[0].rid, "text_completion", created, model, choices),
            "usage": _usage(results, body.n)}


def _completion_inputs(body: CompletionRequest, engine: Engine) -> list[GenerateInput]:
    """``n`` inputs per prompt, in prompt order."""
    prompts = _prompts(body)
    per_choice = bootstrap_per_choice(body, len(prompts), len(prompts) * body.n)
    params = _sampling(body, body.max_tokens, body.logprobs or 0)
    scored = 0 if body.echo and body.logprobs is not None else None  # echo with logprobs: the prompt's too
    inputs = []
    for i, p in enumerate(prompts):
        prompt = engine.tokenizer.encode(p) if isinstance(p, str) else list(p)
        rid = (body.rid or "cmpl-" + uuid.uuid4().hex) + (f"-{i}" if len(prompts) > 1 else "")
        boot = None if per_choice else bootstrap(body, i, engine.config)
        inp = GenerateInput(rid, prompt, params, False, boot, scored)
        inputs += choice_inputs(inp, body.n, body, i * body.n if per_choice else None, engine.config)
    return inputs


async def _completion_chunks(engine: Engine, inputs: list[GenerateInput], body: CompletionRequest, created: int,
                             model: str) -> AsyncIterator[dict]:
    """All choices at once, by index."""
    sent, last = [""] * len(inputs), [None] * len(inputs)
    echoes = _echoes(body, inputs, engine)
    scored = body.echo and body.logprobs is not None  # the echo goes out with the prompt's logprobs, once scored
    for index, echo in enumerate(echoes):
        if echo and not scored:
            choice = {"index": index, "text": echo, "finish_reason": None, "logprobs": None}
            yield _envelope(inputs[index].rid, "text_completion", created, model, [choice])
    async for index, c, event in interleave(engine, inputs):
        if scored and event.prompt_logprobs is not None:
            choice = {"index": index, "text": echoes[index], "finish_reason": None,
                      "logprobs": _echo_lp(engine, body, inputs[index], c)}
            yield _envelope(inputs[index].rid, "text_completion", created, model, [choice])
        delta = _new_text(c.text(), sent[index], event.finish_reason is not None)
        lp = _completion_lp(engine, body, event.token_ids, event.logprobs, event.top_logprobs,
                            len(echoes[index]) + len(sent[index]))
        sent[index] += delta
        last[index] = c
        choice = {"index": index, "text": delta, "finish_reason": _finish(c) if event.finish_reason else None,
                  "logprobs": lp}
        yield _envelope(inputs[index].rid, "text_completion", created, model, [choice])
    if _include_usage(body):
        yield {**_envelope(inputs[0].rid, "text_completion", created, model, []), "usage": _usage(last, body.n)}


async def chat(request: Request, engine: EngineDep) -> dict | StreamingResponse:
    body = await parse_body(request, ChatCompletionRequest)
    engine.require_ready()
    fmt = pick_format(engine.config.tool_call_parser, engine.tokenizer.chat_template)
    plan = tool_plan(body, fmt)
    prompt = chat_prompt(engine.tokenizer, body.messages, body.tools if plan is not None else [], fmt)
    per_choice = bootstrap_per_choice(body, 1, body.n)
    inputs = choice_inputs(_chat_input(body, engine, prompt, per_choice, plan), body.n, body,
                           0 if per_choice else None, engine.config)
    await admit(engine, request, inputs)
    created, model = int(time.time()), engine.model_name
    if body.stream:
        return sse_response(_chat_chunks(engine, inputs, body, plan, created, model))
    results = await collect(engine, request, inputs)
    choices = []
    for j, c in enumerate(results):
        message = chat_message(plan, c.text())
        choices.append({"index": j, "message": message,
                        "finish_reason": finish_reason(_finish(c), "tool_calls" in message),
                        "logprobs": _chat_lp(engine, body, c.ids, c.logprobs, c.top_logprobs)})
    return {**_envelope(inputs[0].rid, "chat.completion", created, model, choices), "usage": _usage(results, body.n)}


def _chat_input(body: ChatCompletionRequest, engine: Engine, prompt: list[int], per_choice: bool,
                plan: ToolPlan | None) -> GenerateInput:
    """A required call's schema is the only grammar."""
    max_tokens = body.max_completion_tokens or body.max_tokens or 256
    rid = body.rid or "chatcmpl-" + uuid.uuid4().hex
    if body.top_logprobs and not body.logprobs:
        raise RequestError("top_logprobs needs logprobs: true")
    params = _sampling(body, max_tokens, body.top_logprobs or 0)
    if plan is not None:
        params.stop += plan.stop()
    if plan is not None and plan.required:
        if params.grammar is not None:
            raise RequestError(f"tool_choice and {params.grammar_name} each ask for a grammar: give one of them")
        params = replace(params, json_schema=plan.json_schema(), grammar_field="tools")
    return GenerateInput(rid, prompt, params, False, None if per_choice else bootstrap(body, 0, engine.config))


async def _chat_chunks(engine: Engine, inputs: list[GenerateInput], body: ChatCompletionRequest,
                       plan: ToolPlan | None, created: int, model: str) -> AsyncIterator[dict]:
    """Per choice: role, deltas, finish reason."""

    def chunk(index: int, delta: dict, reason: str | None, logprobs: dict | None = None) -> dict:
        choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        return _envelope(inputs[0].rid, "chat.completion.chunk", created, model, [choice])

    for index in range(len(inputs)):
        yield chunk(index, {"role": "assistant", "content": ""}, None)
    sent, last = [""] * len(inputs), [None] * len(inputs)
    streams = [ChoiceDeltas(plan) for _ in inputs]
    async for index, c, event in interleave(engine, inputs):
        delta = _new_text(c.text(), sent[index], event.finish_reason is not None)
        sent[index] += delta
        last[index] = c
        deltas = streams[index].feed(delta) + (streams[index].finish() if event.finish_reason else [])
        lp = _chat_lp(engine, body, event.token_ids, event.logprobs, event.top_logprobs)
        if lp is not None and not deltas:  # the step's logprobs go with its first delta, or an empty one
            deltas = [{"content": ""}]
        for j, d in enumerate(deltas):
            yield chunk(index, d, None, lp if j == 0 else None)
        if event.finish_reason:
            yield chunk(index, {}, finish_reason(_finish(c), streams[index].called))
    if _include_usage(body):
        yield {**_envelope(inputs[0].rid, "chat.completion.chunk", created, model, []), "usage": _usage(last, body.n)}


async def models(engine: EngineDep) -> dict:
    return {"object": "list", "data": [_card(engine)]}


async def model(request: Request, engine: EngineDep) -> dict:
    """The one served model by id (any string: no 422)."""
    model_id = request.path_params["model_id"]
    card = _card(engine)
    if model_id != card["id"]:
        raise RequestError(f"model {model_id!r} is not served here; this worker serves {card['id']!r}", 404,
                           "not_found_error")
    return card


def _card(engine: Engine) -> dict:
    engine.require_ready()
    return {"id": engine.model_name, "object": "model", "created": engine.started_at, "owned_by": "decode-worker",
            "max_model_len": engine.model_config.max_context}


def _sampling(body: OpenAISampling, max_tokens: int, top_logprobs: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                          top_k=body.top_k, seed=body.seed, stop=stop_list(body.stop),
                          stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
                          frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
                          top_logprobs=top_logprobs, **openai_grammar(body))


def _prompts(body: CompletionRequest) -> list[str | list[int]]:
    """Text or token ids, alone or batched."""
    batch = isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int)
    return body.prompt if batch else [body.prompt]


def _echoes(body: CompletionRequest, inputs: list[GenerateInput], engine: Engine) -> list[str]:
    """Each choice's prompt text with ``echo``, else ''."""
    if not body.echo:
        return [""] * len(inputs)
    texts = [p if isinstance(p, str) else engine.tokenizer.decode(p) for p in _prompts(body)]
    return [texts[i // body.n] for i in range(len(inputs))]


def _completion_lp(engine: Engine, body: CompletionRequest, ids: list[int], logprobs: list[float],
                   top: list[list[tuple[int, float]]], offset: int) -> dict | None:
    if body.logprobs is None:
        return None
    return completion_logprobs(token_text(engine), ids, logprobs, top, body.logprobs, offset)


def _echo_lp(engine: Engine, body: CompletionRequest, inp: GenerateInput, c: Collected) -> dict | None:
    if c.prompt_logprobs is None or body.logprobs is None:
        return None
    return prompt_completion_logprobs(token_text(engine), inp.prompt_ids, c.prompt_logprobs, body.logprobs)


def _joined(head: dict | None, tail: dict | None) -> dict | None:
    """Two logprobs objects, list after list."""
    if head is None or tail is None:
        return head or tail
    return {key: head[key] + tail[key] if head[key] is not None else None for key in head}


def _chat_lp(engine: Engine, body: ChatCompletionRequest, ids: list[int], logprobs: list[float],
             top: list[list[tuple[int, float]]]) -> dict | None:
    return chat_logprobs(token_text(engine), ids, logprobs, top) if body.logprobs else None


def _new_text(text: str, sent: str, finished: bool) -> str:
    """Text past ``sent``; a trailing U+FFFD waits for the end."""
    if not finished:
        text = text.rstrip("\ufffd")
    return text[len(sent):] if text.startswith(sent) else ""


def _envelope(rid: str, kind: str, created: int, model: str, choices: list[dict]) -> dict:
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}


def _usage(results: list[Collected], n: int) -> dict:
    """Each prompt counts once, every sample's output counts."""
    prompts = results[::n]
    prompt_tokens = sum(c.prompt_tokens for c in prompts)
    completion_tokens = sum(len(c.ids) for c in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in prompts)}}


def _include_usage(body: OpenAISampling) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _finish(c: Collected) -> str | None:
    """An aborted choice reads ``content_filter``, OpenAI's cut-short reason."""
    if c.finish_reason is None:
        return None
    return "content_filter" if c.finish_reason["type"] == "abort" else c.finish_reason["type"]


TokenText = Callable[[int], str]


def completion_logprobs(text_of: TokenText, ids: list[int], logprobs: list[float],
                        top: list[list[tuple[int, float]]], k: int, offset: int = 0) -> dict:
    """``tokens``, ``token_logprobs``, ``top_logprobs`` and ``text_offset`` (from ``offset``)."""
    tokens = [text_of(t) for t in ids]
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    alternatives = [{text_of(t): lp for t, lp in row} for row in top] if k else None
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": alternatives, "text_offset": offsets}


def prompt_completion_logprobs(text_of: TokenText, prompt_ids: list[int], scored: PromptLogprobs, k: int) -> dict:
    """The echoed prompt's, offsets from 0, first token's null."""
    out = completion_logprobs(text_of, prompt_ids[scored.start:], scored.logprobs, scored.top, k)
    if k:
        out["top_logprobs"] = [row if lp is not None else None for row, lp in zip(out["top_logprobs"], scored.logprobs)]
    return out


def chat_logprobs(text_of: TokenText, ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]]) -> dict:
    """Per token: text, logprob, UTF-8 bytes, alternatives."""
    rows = top if top else [[] for _ in ids]
    return {"content": [{**_entry(text_of(t), lp), "top_logprobs": [_entry(text_of(a), alp) for a, alp in row]}
                        for t, lp, row in zip(ids, logprobs, rows)]}


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
