"""SGLang's native ``/generate``: one prompt or a batch, as text or token ids, answered whole or streamed as
chunks that each carry the output so far."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from decode_worker.config import ServerConfig
from decode_worker.core.request import GenerateInput
from decode_worker.core.sampling import SamplingParams
from decode_worker.engine.engine import Engine
from decode_worker.server.dependencies import EngineDep
from decode_worker.server.errors import parse_body
from decode_worker.server.examples import GENERATE_EXAMPLES
from decode_worker.server.generation import Collected, admit, collect, interleave, stream_events
from decode_worker.server.inputs import BOOTSTRAP, bootstrap, encode, fan_out, per_prompt, pick, stop_list
from decode_worker.server.openapi import json_body
from decode_worker.server.responses import GenerateChunk, GenerateOutput, generation_errors, sse_content
from decode_worker.server.schemas import GenerateRequest, SGLangSamplingParams
from decode_worker.server.sse import sse_response


def router(cfg: ServerConfig) -> APIRouter:
    """``cfg`` decides which errors the schema declares. No response_model: answers are plain dicts, which the
    declared models document without re-validating each one."""
    routes = APIRouter()
    routes.add_api_route("/generate", generate, methods=["POST"], response_model=None,
                         openapi_extra=json_body(GenerateRequest, GENERATE_EXAMPLES),
                         responses={200: {"model": GenerateOutput, "content": sse_content(GenerateChunk)},
                                    **generation_errors(cfg)})
    return routes


async def generate(request: Request, engine: EngineDep) -> dict | list[dict] | StreamingResponse:
    body = await parse_body(request, GenerateRequest)
    engine.require_ready()
    batched = isinstance(body.text, list) or bool(body.input_ids and isinstance(body.input_ids[0], list))
    inputs = _inputs(body, batched, engine)
    batched = batched or len(inputs) > 1  # n > 1 answers a list, as SGLang does
    admit(engine, inputs)
    if body.stream:
        return sse_response(_chunks(engine, inputs, batched))
    results = await collect(engine, request, inputs)
    out = [_answer(c, inp) for c, inp in zip(results, inputs)]
    return out if batched else out[0]


def _inputs(body: GenerateRequest, batched: bool, engine: Engine) -> list[GenerateInput]:
    """One input per prompt and sample (``n`` of them), each with its own entry of every list-valued field."""
    texts = body.text if isinstance(body.text, list) else [body.text]
    ids = body.input_ids if batched and body.input_ids else [body.input_ids]
    n = len(texts) if body.text is not None else len(ids)
    per_prompt(body, BOOTSTRAP + ("sampling_params", "rid", "return_logprob", "top_logprobs_num"), n)
    inputs = []
    for i in range(n):
        sp = pick(body.sampling_params, i) or SGLangSamplingParams()
        rid = pick(body.rid, i) or uuid.uuid4().hex
        prompt = encode(engine.tokenizer, texts[i] if body.text is not None else None,
                        ids[i] if body.text is None else None)
        logprob = bool(pick(body.return_logprob, i))
        params = _sampling(sp, pick(body.top_logprobs_num, i) if logprob else 0)
        inputs += fan_out(GenerateInput(rid, prompt, params, logprob, bootstrap(body, i, engine.config)), sp.n)
    return inputs


def _sampling(p: SGLangSamplingParams, top_logprobs: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
                          top_k=p.top_k, seed=p.seed, stop=stop_list(p.stop),
                          stop_token_ids=list(p.stop_token_ids or []), ignore_eos=p.ignore_eos,
                          frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
                          repetition_penalty=p.repetition_penalty, min_new_tokens=p.min_new_tokens,
                          top_logprobs=top_logprobs, skip_special_tokens=p.skip_special_tokens)


async def _chunks(engine: Engine, inputs: list[GenerateInput], batched: bool) -> AsyncIterator[dict]:
    """A batch streams all its prompts at once, each chunk naming its prompt's index."""
    if not batched:
        async for c, _ in stream_events(engine, inputs[0]):
            yield _answer(c, inputs[0])
        return
    async for index, c, _ in interleave(engine, inputs):
        yield {**_answer(c, inputs[index]), "index": index}


def _answer(c: Collected, inp: GenerateInput) -> dict:
    return {"text": c.text(), "output_ids": c.ids, "meta_info": _meta_info(c, inp)}


def _meta_info(c: Collected, inp: GenerateInput) -> dict:
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
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.ids)]
    if inp.params.top_logprobs:
        meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in top] for top in c.top_logprobs]
    return meta
