"""A batch the scheduler picked: its requests and their forward."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from decode_worker.core.sequence import Sequence
from decode_worker.model.forward_batch import ForwardBatch
from decode_worker.model.runner import ModelRunner
from decode_worker.model.sampler import Shaping
from decode_worker.scheduler.req import Req
from decode_worker.scheduler.scoring import ScoredExtend, plan_scoring


class BatchKind(Enum):
    EXTEND = "extend"  # each request's uncomputed tokens (a prompt, or a resumed request's lost KV)
    DECODE = "decode"  # one token per running request


@dataclass(eq=False)
class Batch:
    kind: BatchKind
    reqs: list[Req]
    forward: ForwardBatch  # what ``ModelRunner.forward_sample`` runs; its sampled tokens go to ``postprocess``
    shaping: list[Shaping | None]  # per request, taken on the loop: the forward thread reads no live sequence
    scoring: ScoredExtend | None = None  # an extend whose requests score their prompts (``scoring.py``)


def extend_batch(runner: ModelRunner, reqs: list[Req], eos_token_ids: tuple[int, ...]) -> Batch:
    seqs = [r.seq for r in reqs]
    fb = runner.build_batch([s.token_ids[s.num_computed:] for s in seqs], [s.num_computed for s in seqs],
                            [s.pages for s in seqs])
    return Batch(BatchKind.EXTEND, reqs, fb, [shaping(s, eos_token_ids) for s in seqs], plan_scoring(reqs, fb))


def decode_batch(runner: ModelRunner, reqs: list[Req], eos_token_ids: tuple[int, ...]) -> Batch:
    """Each request's last token; only pages added since the last step go to the device."""
    seqs = [r.seq for r in reqs]
    last = [s.output_ids[-1] if s.output_ids else s.prompt_ids[-1] for s in seqs]
    fb = runner.build_decode([r.rid for r in reqs], last, [s.num_tokens - 1 for s in seqs], [s.pages for s in seqs])
    return Batch(BatchKind.DECODE, reqs, fb, [shaping(s, eos_token_ids) for s in seqs])


def shaping(seq: Sequence, eos_token_ids: tuple[int, ...]) -> Shaping | None:
    """What the sampler adjusts for ``seq``'s next token; None for most requests."""
    p = seq.params
    if not p.shapes_logits:
        return None
    early = len(seq.output_ids) < p.min_new_tokens
    banned = [*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)] if early else []
    return Shaping(list(seq.output_ids), seq.token_ids if p.repetition_penalty != 1 else [], banned)
