"""Constrained decoding with xgrammar (docs/structured-outputs.md)."""
from __future__ import annotations

import asyncio
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from decode_worker.core.request import RequestError
from decode_worker.core.sampling import SamplingParams
from decode_worker.core.sequence import Sequence
from decode_worker.core.threads import started_pool

if TYPE_CHECKING:
    from decode_worker.model.tokenizer import Tokenizer

CACHE_ENTRIES = 256  # compiled grammars (and refusals) kept, least recently used dropped first
COMPILE_TIMEOUT_S = 30.0  # how long a request waits for its grammar; the compile goes on and is cached for a retry
WHITESPACE_RUN = 16  # most whitespace characters a JSON schema's output may put between two elements
_NOISE = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")  # xgrammar's C++ log prefix


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar compiled for this model's tokenizer; shared and read-only."""

    kind: str
    text: str
    compiled: Any  # xgrammar.CompiledGrammar


class GrammarCompiler:
    """Compiles grammars off the loop, caching results by (kind, text), refusals included."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_entries: int = CACHE_ENTRIES):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width; tokens past the tokenizer's are never allowed
        self.cache_entries = cache_entries
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._thread = started_pool(1, "grammar")
        self._xgr_compiler: Any = None  # built on the compile thread at first use (xgrammar loads in ~1.5 s)

    async def compile(self, params: SamplingParams, timeout_s: float = COMPILE_TIMEOUT_S) -> CompiledGrammar:
        """``params``' grammar, waiting up to ``timeout_s``; RequestError 400 if invalid, 503 if late."""
        kind, text = params.grammar
        future = asyncio.wrap_future(self._submit(kind, text))
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(future)
        except TimeoutError:
            raise RequestError(f"{params.grammar_name}: the grammar did not compile within {timeout_s:g} s; try "
                               "again shortly", 503, "unavailable") from None
        except GrammarError as e:
            raise RequestError(f"{params.grammar_name}: {e}") from None

    def compile_now(self, params: SamplingParams) -> CompiledGrammar:
        """Blocking ``compile`` (offline generation); ValueError naming the field."""
        try:
            return self._submit(*params.grammar).result()
        except GrammarError as e:
            raise ValueError(f"{params.grammar_name}: {e}") from None

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _submit(self, kind: str, text: str) -> Future[CompiledGrammar]:
        key = (kind, text)
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(key)
                return future
            future = self._thread.submit(self._compile, kind, text)
            self._cache[key] = future
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
            return future

    def _compile(self, kind: str, text: str) -> CompiledGrammar:
        compiler = self._compiler()
        try:
            if kind == "json_schema":
                compiled = compiler.compile_json_schema(text, any_whitespace=True, max_whitespace_cnt=WHITESPACE_RUN,
                                                        strict_mode=True)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            elif kind == "ebnf":
                compiled = compiler.compile_grammar(text, root_rule_name="root")
            else:
                raise GrammarError(f"unknown grammar kind {kind!r}")
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse and conversion errors
            raise GrammarError(f"cannot compile the {kind}: {_NOISE.sub('', str(e)).strip()}") from None
        if not _allows_any(compiled, self.vocab_size):  # e.g. root ::= root, or {"anyOf": []}
            raise GrammarError(f"the {kind} matches no output at all")
        return CompiledGrammar(kind, text, compiled)

    def _compiler(self) -> Any:
        if self._xgr_compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer.backend, vocab_size=self.vocab_size,
                                                      stop_token_ids=list(self.tokenizer.eos_token_ids))
            self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._xgr_compiler


class GrammarError(ValueError):
    """A grammar that cannot compile."""


class RowGrammar:
    """One request's place in its grammar."""

    def __init__(self, grammar: CompiledGrammar, name: str):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(grammar.compiled)
        self.name = name  # the request field, for the dead-end message

    def advance(self, seq: Sequence) -> None:
        """Feed ``seq``'s newest token; finish ``seq`` at a dead end or the grammar's end."""
        token = seq.output_ids[-1]
        if not self.matcher.accept_token(token):
            seq.finish_reason = {"type": "abort",
                                 "message": f"grammar dead end: token {token} is not allowed by {self.name}"}
        elif self.matcher.is_terminated() and seq.finish_reason is None:
            seq.finish_reason = {"type": "stop", "matched": token}


@dataclass
class BatchMask:
    """A step's ``TokenMask``: bit ``t % 32`` of ``bits[i, t // 32]`` allows token ``t`` in row ``i``."""

    rows: list[int]
    bits: torch.Tensor  # int32 [batch, ceil(vocab / 32)], on the host

    def apply(self, logits: torch.Tensor) -> None:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, self.bits.to(logits.device, non_blocking=True), indices=self.rows)


def fill_mask(grammars: list[RowGrammar | None], vocab_size: int) -> BatchMask | None:
    """The step's bitmask for the rows with a grammar; None when none has one."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    import xgrammar as xgr

    bits = xgr.allocate_token_bitmask(len(grammars), vocab_size)
    filler = xgr.BatchGrammarMatcher(max_threads=1)  # about a microsecond to make: one per call, no shared state
    filler.batch_fill_next_token_bitmask([grammars[i].matcher for i in rows], bits, rows)
    for i, stuck in zip(rows, (bits[rows] == 0).all(dim=1).tolist()):
        if stuck:  # a state with no way on: let the row end, which advance() then reports as a dead end
            _allow(bits, i, grammars[i].matcher.stop_token_ids)
    return BatchMask(rows, bits)


def _allows_any(compiled: Any, vocab_size: int) -> bool:
    import xgrammar as xgr

    bits = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bits)
    return bool(bits.any())


def _allow(bits: torch.Tensor, row: int, tokens: list[int]) -> None:
    """Set ``tokens``' bits in ``row``; every token's when there are none."""
    words = bits[row].numpy().view(np.uint32)
    if not tokens:
        words[:] = np.uint32(0xFFFFFFFF)
    for t in tokens:
        words[t // 32] |= np.uint32(1 << (t % 32))
