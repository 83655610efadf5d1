"""Offline generation on the server's own ``Scheduler`` (``step_sync``), colocated, without L2."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from decode_worker.cache.hicache import HierarchicalCache
from decode_worker.cache.prefix_cache import NoPrefixReuse
from decode_worker.core.request import GenerateInput, RequestStream
from decode_worker.core.sampling import SamplingParams
from decode_worker.core.sequence import check_fits, trim_stop_string
from decode_worker.engine.startup_gc import freeze_startup_objects
from decode_worker.metrics import Metrics
from decode_worker.model.loader import load_model
from decode_worker.model.runner import ModelRunner
from decode_worker.scheduler.grammar import CompiledGrammar, GrammarCompiler
from decode_worker.scheduler.scheduler import Scheduler

LOAD_BACK_TIMEOUT_S = 30.0  # never reached: without L2 there is nothing to load back


@dataclass
class GenerationOutput:
    text: str
    output_ids: list[int]
    prompt_tokens: int
    finish_reason: dict


class LLM:
    """Loads a model and generates for a list of prompts."""

    def __init__(
        self,
        model_path: str,
        max_total_tokens: int = 16384,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        max_running: int = 64,
        load_tokenizer: bool = True,
        prefix_cache: bool = True,
        low_bit_float32: bool = False,
    ):
        """Without a tokenizer, prompts are token ids and no text comes back; ``low_bit_float32`` as in
        ``load_model`` (what ``--dtype auto`` loads on a CPU without native bf16)."""
        self.loaded = load_model(model_path, dtype=dtype, device=device, tokenizer=load_tokenizer,
                                 low_bit_float32=low_bit_float32)
        self.tokenizer = self.loaded.tokenizer
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else self.loaded.config.eos_token_ids
        self.runner = ModelRunner(self.loaded, max_total_tokens, page_size)
        self.cache = HierarchicalCache(self.runner.pool)
        self.allocator = self.cache.device_alloc  # L1 pages; none are in use between generate calls
        self.scheduler = Scheduler(
            self.runner, self.cache if prefix_cache else NoPrefixReuse(self.cache), Metrics(),
            eos_token_ids=self.eos_token_ids, decode_text=self._decode_text, max_running=max_running,
            max_prefill_tokens=max_total_tokens, load_back_timeout_s=LOAD_BACK_TIMEOUT_S,
        )
        self._ids = itertools.count()
        self.grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size) if self.tokenizer else None
        freeze_startup_objects()

    @property
    def config(self):
        return self.loaded.config

    def encode_prompt(self, prompt: str | list[int] | list[dict]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.tokenizer.apply_chat_template(prompt)
        return list(prompt)

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[GenerationOutput]:
        """Checks every prompt first (ValueError); drops cached prefixes after, so calls are independent."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        inputs, grammars = [], []
        for prompt, p in zip(prompts, plist):
            ids = self.encode_prompt(prompt)
            check_fits(ids, p, max_context=self.config.max_context, vocab_size=self.config.vocab_size,
                       page_size=self.runner.page_size, total_pages=self.allocator.total)
            inputs.append(GenerateInput(str(next(self._ids)), ids, p))
            grammars.append(self._grammar(p))
        streams = [self.scheduler.submit(inp, grammar) for inp, grammar in zip(inputs, grammars)]
        while not self.scheduler.idle():
            self.scheduler.step_sync()
        self.cache.flush()
        return [self._output(inp, stream) for inp, stream in zip(inputs, streams)]

    def _grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        if params.grammar is None:
            return None
        if self.grammars is None:
            raise ValueError(f"{params.grammar_name}: constrained decoding needs the model's tokenizer")
        return self.grammars.compile_now(params)

    def _decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer else ""

    def _output(self, inp: GenerateInput, stream: RequestStream) -> GenerationOutput:
        ids, finish_reason = [], None
        while (event := stream.queue.get_nowait()) is not None:
            if event.error is not None:
                raise event.error
            ids += event.token_ids
            finish_reason = event.finish_reason or finish_reason
        text = trim_stop_string(self._decode_text(ids), finish_reason)
        return GenerationOutput(text, ids, len(inp.prompt_ids), finish_reason)
