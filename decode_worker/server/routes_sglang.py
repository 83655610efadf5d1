"""SGLang's ``/generate``: one or a batch, whole or streamed."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from decode_worker.config import ServerConfig
from decode_worker.core.request import GenerateInput
from decode_worker.core.sampling import SamplingParams
from decode_worker.engine.engine import Engine
from decode_worker.server.generation import (
    Collected,
    admit,
    collect,
    interleave,
    sse_response,
    stream_events,
    token_text,
)
from decode_worker.server.inputs import (
    EngineDep,
    bootstrap,
    bootstrap_per_choice,
    choice_inputs,
    encode,
    generate_grammar,
    parse_body,
    per_prompt,
    pick,
    prompt_logprob_start,
    stop_list,
)
from decode_worker.server.openapi import (
    GENERATE_EXAMPLES,
    GenerateEvent,
    GenerateOutput,
    generation_errors,
    json_body,
    sse_content,
)
from decode_worker.server.schemas import GenerateRequest, SGLangSamplingParams


def router(cfg: ServerConfig) -> APIRouter:
    """``cfg`` picks the declared errors."""
    routes = APIRouter()
    routes.add_api_route("/generate", generate, methods=["POST"], response_model=None,
                         openapi_extra=json_body(GenerateRequest, GENERATE_EXAMPLES),
                         responses={200: {"model": GenerateOutput, "content": sse_content(GenerateEvent)},
                                    **generation_errors(cfg)})
    return routes


async def generate(request: Request, engine: EngineDep) -> dict | list[dict] | StreamingResponse:
    body = await parse_body(request, GenerateRequest)
    engine.require_ready()
    batched = isinstance(body.text, list) or bool(body.input_ids and isinstance(body.input_ids[0], list))
    inputs = _inputs(body, batched, engine)
    batched = batched or len(inputs) > 1  # n > 1 answers a list, as SGLang does
    await admit(engine, request, inputs)
    text_of = token_text(engine) if body.return_text_in_logprobs else None
    if body.stream:
        return sse_response(_chunks(engine, inputs, batched, body.return_text_in_logprobs))
    results = await collect(engine, request, inputs)
    out = [_answer(c, inp, text_of) for c, inp in zip(results, inputs)]
    return out if batched else out[0]


def _inputs(body: GenerateRequest, batched: bool, engine: Engine) -> list[GenerateInput]:
    """One input per prompt and sample."""
    texts = body.text if isinstance(body.text, list) else [body.text]
    ids = body.input_ids if batched and body.input_ids else [body.input_ids]
    n = len(texts) if body.text is not None else len(ids)
    per_prompt(body, ("sampling_params", "rid", "return_logprob", "top_logprobs_num", "logprob_start_len"), n)
    samples = [pick(body.sampling_params, i) or SGLangSamplingParams() for i in range(n)]
    per_choice = bootstrap_per_choice(body, n, sum(sp.n for sp in samples))
    inputs = []
    for i, sp in enumerate(samples):
        rid = pick(body.rid, i) or uuid.uuid4().hex
        prompt = encode(engine.tokenizer, texts[i] if body.text is not None else None,
                        ids[i] if body.text is None else None)
        logprob = bool(pick(body.return_logprob, i))
        params = _sampling(sp, pick(body.top_logprobs_num, i) if logprob else 0)
        start = prompt_logprob_start(pick(body.logprob_start_len, i), len(prompt), "logprob_start_len") \
            if logprob else None
        boot = None if per_choice else bootstrap(body, i, engine.config)
        inp = GenerateInput(rid, prompt, params, logprob, boot, start)
        inputs += choice_inputs(inp, sp.n, body, len(inputs) if per_choice else None, engine.config)
    return inputs


def _sampling(p: SGLangSamplingParams, top_logprobs: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
                          top_k=p.top_k, seed=p.seed, stop=stop_list(p.stop),
                          stop_token_ids=list(p.stop_token_ids or []), ignore_eos=p.ignore_eos,
                          frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
                          repetition_penalty=p.repetition_penalty, min_new_tokens=p.min_new_tokens,
                          top_logprobs=top_logprobs, skip_special_tokens=p.skip_special_tokens,
                          **generate_grammar(p))


async def _chunks(engine: Engine, inputs: list[GenerateInput], batched: bool,
                  text_in_logprobs: bool) -> AsyncIterator[dict]:
    """A batch streams its prompts at once, by index."""
    text_of = token_text(engine) if text_in_logprobs else None
    if not batched:
        async for c, _ in stream_events(engine, inputs[0]):
            yield _answer(c, inputs[0], text_of)
        return
    async for index, c, _ in interleave(engine, inputs):
        yield {**_answer(c, inputs[index], text_of), "index": index}


def _answer(c: Collected, inp: GenerateInput, text_of: Callable[[int], str] | None) -> dict:
    return {"text": c.text(), "output_ids": c.ids, "meta_info": _meta_info(c, inp, text_of)}


def _entry(logprob: float | None, token: int, text_of: Callable[[int], str] | None) -> list:
    """[logprob, token id, text or null]."""
    return [logprob, token, text_of(token) if text_of else None]


def _meta_info(c: Collected, inp: GenerateInput, text_of: Callable[[int], str] | None = None) -> dict:
    meta = {
        "id": c.rid,
        "finish_reason": c.finish_reason,
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": len(c.ids),
        "cached_tokens": c.cached_tokens,
        "cached_tokens_details": {t: c.cached.get(t, 0) for t in ("device", "host", "storage")},
        "e2e_latency": round(c.e2e_latency, 6),
    }
    if inp.return_logprob:
        meta["output_token_logprobs"] = [_entry(lp, t, text_of) for lp, t in zip(c.logprobs, c.ids)]
    if inp.params.top_logprobs:
        meta["output_top_logprobs"] = [[_entry(lp, t, text_of) for t, lp in top] for top in c.top_logprobs]
    if (scored := c.prompt_logprobs) is not None:
        tokens = inp.prompt_ids[scored.start:]
        meta["input_token_logprobs"] = [_entry(lp, t, text_of) for lp, t in zip(scored.logprobs, tokens)]
        if inp.params.top_logprobs:  # the prompt's first token has nothing before it: null, as SGLang has it
            meta["input_top_logprobs"] = [[_entry(lp, t, text_of) for t, lp in top] if lp is not None else None
                                          for top, lp in zip(scored.top, scored.logprobs)]
    return meta
