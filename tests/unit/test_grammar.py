"""Constrained decoding: the batched token mask, grammars compiled off the loop and cached, and outputs that keep to
their grammar even from random weights (the point of constraining them)."""
from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path

import jsonschema_rs
import pytest
import torch

from decode_worker.core.request import GenerateInput, RequestError
from decode_worker.core.sampling import SamplingParams
from decode_worker.core.sequence import Sequence
from decode_worker.engine.llm import LLM
from decode_worker.model.sampler import make_generator, sample
from decode_worker.scheduler.grammar import (
    MAX_QUEUED_COMPILES,
    BatchMask,
    GrammarCompiler,
    GrammarLimits,
    Refusal,
    RowGrammar,
    fill_mask,
)
from tests.tiny_model import save_tiny_chat_model
from tests.unit.test_scheduler import make_scheduler

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "colour": {"enum": ["red", "green", "blue"]}, "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                           "maxItems": 3}},
    "required": ["ok", "n", "colour"]}
REGEX = r"[a-c]{2,5}-\d{3}"
EBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
EBNF_SHAPE = re.compile(r"\((?:[0-9]|x)(?:,(?:[0-9]|x))*\)")


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-grammar"))


@pytest.fixture(scope="module")
def llm(tiny_chat) -> LLM:
    return LLM(str(tiny_chat), max_total_tokens=8192)


def mask_allowing(allowed: dict[int, list[int]], batch: int, vocab: int) -> BatchMask:
    """Rows ``allowed`` may pick only their tokens; the other rows' bits say nothing allowed, and must be ignored."""
    bits = torch.zeros(batch, -(-vocab // 32), dtype=torch.int32)
    for row, tokens in allowed.items():
        for t in tokens:
            bits[row, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    return BatchMask(sorted(allowed), bits)


# ---- the sampler's mask ---------------------------------------------------------------------------------------


def test_the_mask_limits_only_its_rows_and_leaves_the_reported_logprobs_alone():
    torch.manual_seed(0)
    vocab = 100
    logits = torch.randn(4, vocab)
    allowed = {0: [3, 31, 32, 99], 2: [64]}  # word edges and the last token
    mask = mask_allowing(allowed, 4, vocab)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, top_k=5)]
    for seed in range(20):
        gens = [None, None, make_generator(seed, torch.device("cpu")), None]
        out = sample(logits.clone(), params, gens, mask=mask)
        assert out.token_ids[0] == max(allowed[0], key=lambda t: logits[0, t])
        assert out.token_ids[1] == int(logits[1].argmax())  # no mask: the plain argmax
        assert out.token_ids[2] == 64
        assert out.token_ids[3] in logits[3].topk(5).indices.tolist()
        raw = torch.log_softmax(logits, -1)
        assert out.logprobs == pytest.approx([float(raw[i, t]) for i, t in enumerate(out.token_ids)], abs=1e-6)


def test_a_mask_row_with_a_sign_bit_word_unpacks_right():
    """Token 31 is the sign bit of its int32 word: an arithmetic shift must not smear it over the others."""
    logits = torch.zeros(1, 64)
    logits[0, 0] = 5.0  # the best token, not allowed
    out = sample(logits, [SamplingParams(temperature=0)], [None], mask=mask_allowing({0: [31]}, 1, 64))
    assert out.token_ids == [31]


# ---- compiling --------------------------------------------------------------------------------------------------


def test_grammars_compile_on_their_own_thread_once_per_text(llm):
    compiler = GrammarCompiler(llm.tokenizer, llm.config.vocab_size)
    threads: list[str] = []
    inner = compiler._compile
    compiler._compile = lambda kind, text: threads.append(threading.current_thread().name) or inner(kind, text)
    params = SamplingParams(regex=REGEX)

    async def twice():
        return await asyncio.gather(compiler.compile(params), compiler.compile(SamplingParams(regex=REGEX)))

    first, second = asyncio.run(twice())
    assert first is second and first.kind == "regex"
    assert compiler.compile_now(params) is first
    assert len(threads) == 1 and threads[0].startswith("grammar") and threads[0] != threading.current_thread().name
    compiler.close()


@pytest.mark.parametrize("kind,text,says", [
    ("json_schema", '{"type": "object", "properties": ', "JSON"),
    ("json_schema", '{"type": "strnig"}', "strnig"),
    ("regex", "(ab", "parenthesis"),
    ("ebnf", "root ::= missing", "missing"),
])
def test_a_grammar_that_cannot_compile_is_a_400_naming_its_field_and_stays_refused(llm, kind, text, says):
    compiler = GrammarCompiler(llm.tokenizer, llm.config.vocab_size)
    params = SamplingParams(**{kind: text}, grammar_field=f"sampling_params.{kind}")
    for _ in range(2):  # the refusal is cached too
        with pytest.raises(RequestError) as e:
            asyncio.run(compiler.compile(params))
        assert e.value.status == 400
        assert str(e.value).startswith(f"sampling_params.{kind}: cannot compile the {kind}: ")
        assert says in str(e.value) and "/project/" not in str(e.value)
    with pytest.raises(ValueError, match=f"^sampling_params.{kind}: "):
        compiler.compile_now(params)
    compiler.close()


def gated_compiler(llm) -> tuple[GrammarCompiler, threading.Event]:
    """A compiler whose compile thread waits for the returned event before each compile."""
    compiler = GrammarCompiler(llm.tokenizer, llm.config.vocab_size)
    gate = threading.Event()
    inner = compiler._compile
    compiler._compile = lambda kind, text: gate.wait() and inner(kind, text)
    return compiler, gate


def test_a_compile_past_its_deadline_is_a_503_and_a_retry_finds_it(llm):
    compiler, gate = gated_compiler(llm)
    params = SamplingParams(regex="a+", grammar_field="regex")
    with pytest.raises(RequestError) as e:
        asyncio.run(compiler.compile(params, timeout_s=0.05))
    assert e.value.status == 503 and str(e.value).startswith("regex: ")
    gate.set()
    assert asyncio.run(compiler.compile(params, timeout_s=10)).kind == "regex"
    compiler.close()


def test_a_refusal_is_cached_as_its_message_and_raised_anew_for_each_request(llm):
    """One cached exception re-raised gathered a traceback frame per request, each holding that request's grammar."""
    compiler = GrammarCompiler(llm.tokenizer, llm.config.vocab_size)
    params = SamplingParams(regex="(" + "a" * 1000, grammar_field="regex")
    raised = []
    for _ in range(3):
        with pytest.raises(RequestError) as e:
            asyncio.run(compiler.compile(params))
        raised.append(e.value)
    assert len({id(e) for e in raised}) == 3
    assert all(isinstance(entry.future.result(), Refusal) for entry in compiler._cache.values())
    compiler.close()


def test_the_cache_is_bounded_by_the_bytes_of_grammar_behind_it(llm):
    compiler = GrammarCompiler(llm.tokenizer, llm.config.vocab_size, cache_bytes=3000)
    for n in range(1, 6):
        compiler.compile_now(SamplingParams(regex=f"a{{{n}}}" + "b" * 1000))
    assert len(compiler._cache) == 2 and compiler._cached_bytes <= 3000
    compiler.close()


@pytest.mark.parametrize("kind,text,says", [
    ("json_schema", '{"type": "array", "items": ' * 200 + "{}" + "}" * 200, "nests deeper than"),
    ("json_schema", json.dumps({"enum": ["[" * 500]}), None),  # brackets inside strings do not nest
    ("regex", "(" * 100 + "a" + ")" * 100, "nests deeper than"),
    ("regex", r"\(" * 100 + "[(]" * 100, None),  # escaped and bracketed parentheses are no groups
    ("ebnf", 'root ::= "' + "a" * GrammarLimits.max_bytes + '"', "longer than"),
])
def test_size_and_nesting_are_checked_before_anything_compiles(llm, kind, text, says):
    compiler = GrammarCompiler(llm.tokenizer, llm.config.vocab_size)
    compiled: list[str] = []
    inner = compiler._compile
    compiler._compile = lambda kind, text: compiled.append(kind) or inner(kind, text)
    params = SamplingParams(**{kind: text})
    if says is None:
        asyncio.run(compiler.compile(params))
        assert compiled == [kind]
    else:
        with pytest.raises(RequestError, match=says) as e:
            asyncio.run(compiler.compile(params))
        assert e.value.status == 400 and not compiled
    compiler.close()


def test_compiles_queue_boundedly_and_one_nobody_awaits_is_dropped(llm):
    compiler, gate = gated_compiler(llm)

    async def waits(n: int, timeout_s: float):
        return await asyncio.gather(*(compiler.compile(SamplingParams(regex=f"a{{{i + 1}}}"), timeout_s=timeout_s)
                                      for i in range(n)), return_exceptions=True)

    gone = asyncio.run(waits(MAX_QUEUED_COMPILES - 1, 0.05))  # their requests stop waiting: 503s
    assert all(isinstance(e, RequestError) and e.status == 503 for e in gone)
    assert len(compiler._cache) == 1  # the running compile stays; the queued ones nobody awaits are gone

    async def flood():
        futures = [asyncio.ensure_future(compiler.compile(SamplingParams(regex=f"b{{{i + 1}}}"), timeout_s=10))
                   for i in range(MAX_QUEUED_COMPILES - 1)]
        await asyncio.sleep(0.05)
        with pytest.raises(RequestError, match="waiting to compile") as e:
            await compiler.compile(SamplingParams(regex="c"), timeout_s=10)
        assert e.value.status == 503
        gate.set()
        return await asyncio.gather(*futures)

    assert all(g.kind == "regex" for g in asyncio.run(flood()))
    compiler.close()


@pytest.mark.parametrize("fields,says", [
    ({"json_schema": "{}", "regex": "a"}, "json_schema and regex are exclusive"),
    ({"regex": "a", "ebnf": "root ::= 'a'"}, "regex and ebnf are exclusive"),
    ({"regex": "a", "min_new_tokens": 2, "max_new_tokens": 4}, "min_new_tokens cannot be combined with regex"),
    ({"ebnf": " "}, "ebnf is empty"),
])
def test_sampling_params_take_one_grammar(fields, says):
    with pytest.raises(ValueError, match=says):
        SamplingParams(**fields).validate()


# ---- outputs from random weights ----------------------------------------------------------------------------------


def sampled(n: int, **grammar) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=300, temperature=1.0, seed=seed, **grammar) for seed in range(n)]


def test_json_schema_outputs_are_valid_json_under_the_schema(llm):
    outs = llm.generate(["hi"] * 4, sampled(4, json_schema=json.dumps(SCHEMA)))
    for out in outs:
        assert out.finish_reason["type"] == "stop", out
        jsonschema_rs.validate(SCHEMA, json.loads(out.text))
    assert len({o.text for o in outs}) > 1, "four seeds, one output: sampling is not running under the mask"


def test_regex_and_ebnf_outputs_match(llm):
    for out in llm.generate(["a", "b", "c"], sampled(3, regex=REGEX)):
        assert re.fullmatch(REGEX, out.text) and out.finish_reason["type"] == "stop", out
    for out in llm.generate(["a", "b", "c"], sampled(3, ebnf=EBNF)):
        assert EBNF_SHAPE.fullmatch(out.text) and out.finish_reason["type"] == "stop", out


def test_constrained_and_free_rows_share_a_batch_and_the_free_ones_are_untouched(llm):
    free = SamplingParams(max_new_tokens=12, temperature=0)
    alone = llm.generate(["tell me", "more"], free)
    mixed = llm.generate(["tell me", "x", "more", "y"],
                         [free, SamplingParams(max_new_tokens=40, temperature=0, regex=REGEX), free,
                          SamplingParams(max_new_tokens=300, temperature=0, json_schema=json.dumps(SCHEMA))])
    assert [mixed[0].output_ids, mixed[2].output_ids] == [o.output_ids for o in alone]
    assert re.fullmatch(REGEX, mixed[1].text)
    jsonschema_rs.validate(SCHEMA, json.loads(mixed[3].text))


def test_with_ignore_eos_a_terminated_grammar_still_ends_the_request(llm):
    out = llm.generate(["hi"], SamplingParams(max_new_tokens=50, temperature=0, regex="[0-9]{3}", ignore_eos=True))[0]
    assert re.fullmatch("[0-9]{3}", out.text) and out.finish_reason["type"] == "stop"
    assert len(out.output_ids) == 4  # three digits and the end-of-sequence token that terminated the grammar


def test_a_token_the_grammar_refuses_is_a_dead_end_finish(llm):
    compiled = GrammarCompiler(llm.tokenizer, llm.config.vocab_size).compile_now(SamplingParams(regex="[0-9]+"))
    row = RowGrammar(compiled, "response_format")
    seq = Sequence("r", [1], SamplingParams())
    seq.output_ids = llm.tokenizer.encode("4")
    row.advance(seq)
    assert seq.finish_reason is None
    seq.output_ids += llm.tokenizer.encode("x")
    row.advance(seq)
    assert seq.finish_reason["type"] == "abort"
    assert seq.finish_reason["message"].startswith("grammar dead end: token ") and "response_format" in \
        seq.finish_reason["message"]


def test_fill_mask_covers_only_rows_with_a_grammar(llm):
    compiled = GrammarCompiler(llm.tokenizer, llm.config.vocab_size).compile_now(SamplingParams(regex="[0-9]"))
    assert fill_mask([None, None], llm.config.vocab_size) is None
    mask = fill_mask([None, RowGrammar(compiled, "regex"), None], llm.config.vocab_size)
    assert mask.rows == [1] and mask.bits.shape == (3, -(-llm.config.vocab_size // 32))
    digits = {llm.tokenizer.encode(str(d))[0] for d in range(10)}
    allowed = {t for t in range(llm.config.vocab_size) if int(mask.bits[1, t // 32]) >> (t % 32) & 1}
    assert allowed == digits


@pytest.mark.parametrize("first,ends", [("7", "stop"), ("x", "abort")])
def test_a_decode_worker_replays_prefill_first_token_into_the_grammar(llm, tiny_chat, first, ends):
    """PD: prefill sampled the first token; decode feeds it to its own matcher and goes on in the grammar from there.
    A first token the grammar refuses (a prefill that ignored the grammar) is a dead end, not a silent pass."""
    token = llm.tokenizer.encode(first)[0]

    async def from_prefill(req, pages):
        return token, -0.5

    async def run() -> list:
        scheduler = make_scheduler(tiny_chat, 2048, kv_source=from_prefill)
        params = SamplingParams(max_new_tokens=10, temperature=0, regex="[0-9]{3}")
        compiled = GrammarCompiler(llm.tokenizer, llm.config.vocab_size).compile_now(params)
        scheduler.start()
        try:
            return [e async for e in scheduler.submit(GenerateInput("r", [5, 6, 7, 8, 9], params), compiled)]
        finally:
            await scheduler.stop(grace_s=0)

    events = asyncio.run(run())
    ids = [t for e in events for t in e.token_ids]
    reason = events[-1].finish_reason
    assert ids[0] == token and reason["type"] == ends, reason
    if ends == "stop":
        assert re.fullmatch("[0-9]{3}", llm.tokenizer.decode(ids)), llm.tokenizer.decode(ids)
    else:
        assert ids == [token] and reason["message"].startswith(f"grammar dead end: token {token} is not allowed")


class ThreadSpy:
    """A matcher that notes the thread each token is fed on."""

    def __init__(self, matcher, fed_on: list[str]):
        self.matcher, self.fed_on = matcher, fed_on

    def __getattr__(self, name: str):
        return getattr(self.matcher, name)

    def accept_token(self, token: int) -> bool:
        self.fed_on.append(threading.current_thread().name)
        return self.matcher.accept_token(token)


def test_the_matcher_takes_sampled_tokens_on_the_forward_thread_not_the_event_loop(llm, tiny_chat):
    """xgrammar's accept grows with an ambiguous shape as its mask does (30 ms a token after 150 with SmolLM2's
    tokenizer for ``((x|y)*)*``): on the event loop it stalled every stream of the worker. Both release the GIL, so
    the forward thread feeds each decoded token; only a token that came from elsewhere (prefill's first) is fed on
    the loop, one per request."""
    fed_on: list[str] = []

    async def run() -> list:
        scheduler = make_scheduler(tiny_chat, 2048)
        params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, regex="((x|y)*)*")
        compiled = GrammarCompiler(llm.tokenizer, llm.config.vocab_size).compile_now(params)
        scheduler.start()
        try:
            stream = scheduler.submit(GenerateInput("r", [5, 6, 7, 8, 9], params), compiled)
            row = scheduler.requests["r"].grammar
            row.matcher = ThreadSpy(row.matcher, fed_on)
            return [e async for e in stream]
        finally:
            await scheduler.stop(grace_s=0)

    events = asyncio.run(run())
    assert sum(len(e.token_ids) for e in events) == 6 and events[-1].finish_reason["type"] == "length"
    assert len(fed_on) == 6 and all(name.startswith("forward") for name in fed_on), fed_on


STUCK = 'root ::= "a" dead | "b"\ndead ::= dead'  # after "a" no token can follow, not even end-of-sequence


def test_a_grammar_that_matches_nothing_is_refused(llm):
    with pytest.raises(ValueError, match="^ebnf: the ebnf matches no output at all"):
        GrammarCompiler(llm.tokenizer, llm.config.vocab_size).compile_now(SamplingParams(ebnf="root ::= root"))


def test_a_row_stuck_in_its_grammar_may_only_end_and_ends_as_a_dead_end(llm):
    import xgrammar as xgr

    vocab, eos = llm.config.vocab_size, llm.tokenizer.eos_token_ids[0]
    row = RowGrammar(GrammarCompiler(llm.tokenizer, vocab).compile_now(SamplingParams(ebnf=STUCK)), "ebnf")
    seq = Sequence("r", [1], SamplingParams())
    seq.output_ids = llm.tokenizer.encode("a")
    row.advance(seq)
    raw = xgr.allocate_token_bitmask(1, vocab)
    row.matcher.fill_next_token_bitmask(raw)
    assert not raw.any(), "xgrammar allows something here after all: the guard is not what this tests"
    mask = fill_mask([None, row], vocab)
    assert [t for t in range(vocab) if int(mask.bits[1, t // 32]) >> (t % 32) & 1] == [eos]
    out = sample(torch.randn(2, vocab), [SamplingParams(temperature=1.0)] * 2, [None, None], mask=mask)
    assert out.token_ids[1] == eos
    seq.output_ids.append(eos)
    row.advance(seq)
    assert seq.finish_reason["type"] == "abort" and seq.finish_reason["message"].startswith("grammar dead end")


def test_rows_that_get_stuck_end_without_failing_the_batch(llm):
    outs = llm.generate(["a"] * 7, sampled(6, ebnf=STUCK) + [SamplingParams(max_new_tokens=5, temperature=0)])
    for out in outs[:6]:
        assert (out.text, out.finish_reason["type"]) in {("a", "abort"), ("b", "stop")}, out
    assert len(outs[6].output_ids) == 5


def test_the_limits_are_the_deployments_to_set(llm):
    """``--grammar-max-nesting`` and ``--grammar-max-bytes`` move the bounds, and a refusal names the flag."""
    compiler = GrammarCompiler(llm.tokenizer, llm.config.vocab_size, GrammarLimits(max_bytes=256, max_nesting=3))
    three = '{"type": "array", "items": ' * 2 + "{}" + "}" * 2  # three objects deep
    assert compiler.compile_now(SamplingParams(json_schema=three)).kind == "json_schema"
    with pytest.raises(ValueError, match=r"nests deeper than 3 levels \(--grammar-max-nesting\)"):
        compiler.compile_now(SamplingParams(json_schema='{"type": "array", "items": ' + three + "}"))
    with pytest.raises(ValueError, match=r"longer than 256 bytes \(--grammar-max-bytes\)"):
        compiler.compile_now(SamplingParams(regex="a" * 257))
    compiler.close()
