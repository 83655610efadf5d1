"""Offline generation with continuous batching: the command-line path and the benchmark's engine."""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import torch

from decode_worker.cache.pool import OutOfPages, PageAllocator
from decode_worker.core.sampling import SamplingParams
from decode_worker.core.sequence import (
    Sequence,
    check_finish,
    check_fits,
    trim_stop_string,
)
from decode_worker.model.loader import load_model
from decode_worker.model.runner import ModelRunner
from decode_worker.model.sampler import make_generator, sample


@dataclass
class GenerationOutput:
    text: str
    output_ids: list[int]
    prompt_tokens: int
    finish_reason: dict


class LLM:
    """Loads a model and generates for a list of prompts, batching decode steps across them."""

    def __init__(
        self,
        model_path: str,
        max_total_tokens: int = 16384,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        max_running: int = 64,
        load_tokenizer: bool = True,
    ):
        """Without a tokenizer (random-weight test models) prompts must be token ids and no text is returned."""
        self.loaded = load_model(model_path, dtype=dtype, device=device, tokenizer=load_tokenizer)
        self.tokenizer = self.loaded.tokenizer
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else self.loaded.config.eos_token_ids
        self.runner = ModelRunner(self.loaded, max_total_tokens, page_size)
        self.allocator = PageAllocator(self.runner.num_pages, reserved=1)
        self.max_running = max_running
        self._ids = itertools.count()

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
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = []
        for prompt, p in zip(prompts, plist):
            ids = self.encode_prompt(prompt)
            check_fits(ids, p, max_context=self.config.max_context, vocab_size=self.config.vocab_size,
                       page_size=self.runner.page_size, total_pages=self.allocator.total)
            seqs.append(Sequence(str(next(self._ids)), ids, p, generator=make_generator(p.seed, self.runner.device)))
        waiting, running = deque(seqs), []
        while waiting or running:
            self._admit(waiting, running)
            if running:
                self._decode(running, waiting)
        return [self._output(s) for s in seqs]

    def _admit(self, waiting: deque, running: list) -> None:
        """Prefill waiting sequences (FIFO) while pages and batch slots allow, in one extend step."""
        batch = []
        while waiting and len(running) + len(batch) < self.max_running:
            seq = waiting[0]
            try:
                seq.pages = self.allocator.alloc(seq.pages_needed(self.runner.page_size)).tolist()
            except OutOfPages:
                break
            batch.append(waiting.popleft())
        if not batch:
            return
        fb = self.runner.build_batch([s.token_ids for s in batch], [0] * len(batch), [s.pages for s in batch])
        self._sample_and_finish(batch, self.runner.forward(fb))
        running.extend(s for s in batch if not self._retire_if_done(s))

    def _decode(self, running: list, waiting: deque) -> None:
        for seq in list(running):
            if seq in running and not self._grow(seq, running, waiting):
                break
        if not running:
            return
        fb = self.runner.build_batch([[s.token_ids[-1]] for s in running], [s.num_tokens - 1 for s in running], [s.pages for s in running])
        self._sample_and_finish(running, self.runner.forward(fb))
        running[:] = [s for s in running if not self._retire_if_done(s)]

    def _grow(self, seq: Sequence, running: list, waiting: deque) -> bool:
        """Give ``seq`` the page its next token needs, preempting the newest sequence if the pool is full."""
        while len(seq.pages) < seq.pages_needed(self.runner.page_size):
            try:
                seq.pages += self.allocator.alloc(1).tolist()
            except OutOfPages:
                victim = running.pop()
                self.allocator.free(torch.tensor(victim.pages))
                victim.pages = []
                waiting.appendleft(victim)  # re-admission prefills prompt + output so far, then goes on
                if victim is seq:
                    return False
        return True

    def _sample_and_finish(self, batch: list[Sequence], logits: torch.Tensor) -> None:
        result = sample(logits, [s.params for s in batch], [s.generator for s in batch])
        for seq, tok, lp in zip(batch, result.token_ids, result.logprobs):
            seq.output_ids.append(tok)
            seq.output_logprobs.append(lp)
            check_finish(seq, self.eos_token_ids, self.config.max_context, self._decode_text)

    def _retire_if_done(self, seq: Sequence) -> bool:
        if seq.finished:
            self.allocator.free(torch.tensor(seq.pages, dtype=torch.int64))
            seq.pages = []
        return seq.finished

    def _decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer else ""

    def _output(self, seq: Sequence) -> GenerationOutput:
        text = trim_stop_string(self._decode_text(seq.output_ids), seq.finish_reason)
        return GenerationOutput(text, seq.output_ids, len(seq.prompt_ids), seq.finish_reason)


