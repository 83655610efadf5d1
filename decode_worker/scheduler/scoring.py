"""Prompt logprobs, scored by the extend that computes the prompt."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decode_worker.core.request import PromptLogprobs
from decode_worker.core.sampling import SamplingParams
from decode_worker.model.forward_batch import ForwardBatch, int_tensor
from decode_worker.model.runner import ModelRunner
from decode_worker.model.sampler import SampleResult, Shaping, TokenMask, sample, score
from decode_worker.scheduler.req import Req

SCORE_ROWS = 256
"""Prompt positions whose logits exist at once: a prompt scored from position 0 holds ``SCORE_ROWS`` x vocabulary
float32 logits (and their log-softmax) at a time, whatever its length, instead of its whole length's."""


def computed_before(req: Req) -> int | None:
    """The last prompt position whose KV may come from the cache; None unless ``req`` scores now."""
    start = req.inp.logprob_start
    if start is None or req.seq.output_ids:
        return None
    return max(min(start, len(req.seq.prompt_ids) - 1), 1) - 1


@dataclass
class _Scored:
    index: int  # the request's place in the batch
    start: int  # first prompt position reported
    first_row: int  # its first scoring row in the step's logits
    targets: list[int]  # the prompt tokens scored: positions max(start, 1) .. end
    top: int


@dataclass
class ScoredExtend:
    """An extend that also scores prompts: which logits rows it keeps."""

    sample_rows: list[int]  # per request, the logits row of its last token
    scored: list[_Scored]

    def forward_sample(self, runner: ModelRunner, fb: ForwardBatch, params: list[SamplingParams],
                       generators: list[torch.Generator | None], shaping: list[Shaping | None],
                       mask: TokenMask | None = None) -> SampleResult:
        hidden = runner.hidden(fb)
        result = sample(runner.logits(hidden[self.sample_rows]), params, generators, shaping, mask)
        result.prompt = [None] * len(params)
        for s in self.scored:
            chosen, top = ([None], [[]]) if s.start == 0 else ([], [])
            for at in range(0, len(s.targets), SCORE_ROWS):
                rows = hidden[s.first_row + at: s.first_row + min(at + SCORE_ROWS, len(s.targets))]
                part_chosen, part_top = score(runner.logits(rows), s.targets[at: at + SCORE_ROWS], s.top)
                chosen += part_chosen
                top += part_top
            result.prompt[s.index] = PromptLogprobs(s.start, chosen, top)
        return result


def plan_scoring(reqs: list[Req], fb: ForwardBatch) -> ScoredExtend | None:
    """Point ``fb``'s logits at the rows scoring needs; None when no request scores."""
    rows: list[int] = []
    sample_rows: list[int] = []
    scored: list[_Scored] = []
    offset = 0
    for i, req in enumerate(reqs):
        seq = req.seq
        new = seq.num_tokens - seq.num_computed
        first = computed_before(req)
        if first is not None:
            if first < seq.num_computed:
                raise RuntimeError(f"request {req.rid}: prompt position {first} is needed for its logprobs but its "
                                   f"KV came from the cache ({seq.num_computed} tokens)")
            start = min(req.inp.logprob_start, len(seq.prompt_ids) - 1)
            targets = seq.prompt_ids[max(start, 1):]
            scored.append(_Scored(i, start, len(rows), targets, seq.params.top_logprobs))
            rows += range(offset + first - seq.num_computed, offset + new - 1)
        sample_rows.append(len(rows))
        rows.append(offset + new - 1)
        offset += new
    if not scored:
        return None
    fb.logits_indices = int_tensor(rows).to(fb.input_ids.device)
    return ScoredExtend(sample_rows, scored)
