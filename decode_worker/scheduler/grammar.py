"""Constrained decoding with xgrammar (docs/structured-outputs.md)."""
from __future__ import annotations

import asyncio
import hashlib
import re
import threading
import time
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
CACHE_BYTES = 64 << 20  # and at most this much grammar text behind them
COMPILE_TIMEOUT_S = 30.0  # how long a request waits for its grammar; the compile goes on and is cached for a retry
MAX_QUEUED_COMPILES = 8  # compiles waiting for the one compile thread
REFUSAL_CHARS = 500  # of a compiler's message kept for a refusal: it may quote the grammar
SLOW_STEPS = 4  # steps in a row over the step budget that end a request (one slow step is no sign)
WHITESPACE_RUN = 16  # most whitespace characters a JSON schema's output may put between two elements
_NOISE = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")  # xgrammar's C++ log prefix


@dataclass(frozen=True)
class GrammarLimits:
    """What one request may ask of grammars (docs/security.md; the ``--grammar-*`` flags): a grammar's text, its
    nesting (a JSON schema's objects and arrays, a regex's groups), and its work in the step every request shares
    (its mask and its accept): over ``step_budget_s`` in ``SLOW_STEPS`` steps in a row, the request ends with an
    abort that says so. Ambiguous shapes (``((x|y)*)*z``) grow that work with every token."""

    max_bytes: int = 256 << 10
    max_nesting: int = 64
    step_budget_s: float = 0.010


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar compiled for this model's tokenizer; shared and read-only."""

    kind: str
    text: str
    compiled: Any  # xgrammar.CompiledGrammar
    step_budget_s: float = GrammarLimits.step_budget_s  # what each row of it may cost a step


@dataclass(frozen=True)
class Refusal:
    """A grammar that cannot compile, cached as its message alone: each request gets an error of its own, so no
    cached exception gathers one traceback frame (and with it that request's grammar text) per re-raise."""

    message: str


@dataclass
class _Entry:
    future: Future[CompiledGrammar | Refusal]
    size: int  # bytes of grammar text it stands for
    waiters: int = 0  # requests awaiting it; a queued compile that none awaits any more is cancelled


class GrammarCompiler:
    """Compiles grammars off the loop, caching results by (kind, text digest), refusals included; bounded in
    entries and in bytes, with a bounded queue of compiles, and what a request may ask checked before it queues."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, limits: GrammarLimits = GrammarLimits(),
                 cache_entries: int = CACHE_ENTRIES, cache_bytes: int = CACHE_BYTES):
        self.tokenizer = tokenizer
        self.limits = limits
        self.vocab_size = vocab_size  # the logits' width; tokens past the tokenizer's are never allowed
        self.cache_entries, self.cache_bytes = cache_entries, cache_bytes
        self._cache: OrderedDict[tuple[str, bytes], _Entry] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._thread = started_pool(1, "grammar")
        self._xgr_compiler: Any = None  # built on the compile thread at first use (xgrammar loads in ~1.5 s)

    async def compile(self, params: SamplingParams, timeout_s: float = COMPILE_TIMEOUT_S) -> CompiledGrammar:
        """``params``' grammar, waiting up to ``timeout_s``; RequestError 400 if invalid, 503 if late or if too
        many compiles are queued. A request that stops waiting leaves a compile nobody awaits, which is dropped."""
        key, entry = self._enter(params)
        try:
            async with asyncio.timeout(timeout_s):
                result = await asyncio.shield(asyncio.wrap_future(entry.future))
        except TimeoutError:
            raise RequestError(f"{params.grammar_name}: the grammar did not compile within {timeout_s:g} s; try "
                               "again shortly", 503, "unavailable") from None
        finally:
            self._leave(key, entry)
        if isinstance(result, Refusal):
            raise RequestError(f"{params.grammar_name}: {result.message}")
        return result

    def compile_now(self, params: SamplingParams) -> CompiledGrammar:
        """Blocking ``compile`` (offline generation); ValueError naming the field."""
        try:
            key, entry = self._enter(params)
        except RequestError as e:
            raise ValueError(str(e)) from None
        try:
            result = entry.future.result()
        finally:
            self._leave(key, entry)
        if isinstance(result, Refusal):
            raise ValueError(f"{params.grammar_name}: {result.message}")
        return result

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _enter(self, params: SamplingParams) -> tuple[tuple[str, bytes], _Entry]:
        """The cache entry for ``params``' grammar, counted as awaited; a compile queued for it if there is none."""
        kind, text = params.grammar
        if refused := too_large(kind, text, self.limits):
            raise RequestError(f"{params.grammar_name}: {refused}")
        key = (kind, hashlib.sha256(text.encode()).digest())
        with self._lock:
            entry = self._cache.get(key)
            if entry is None or entry.future.cancelled():
                if self._queued() >= MAX_QUEUED_COMPILES:
                    raise RequestError(f"{params.grammar_name}: {MAX_QUEUED_COMPILES} grammars are waiting to "
                                       "compile; try again shortly", 503, "unavailable")
                entry = _Entry(self._thread.submit(self._compile, kind, text), len(text))
                self._put(key, entry)
            self._cache.move_to_end(key)
            entry.waiters += 1
            return key, entry

    def _leave(self, key: tuple[str, bytes], entry: _Entry) -> None:
        with self._lock:
            entry.waiters -= 1
            if entry.waiters == 0 and entry.future.cancel() and self._cache.get(key) is entry:
                self._drop(key)  # it was still queued and nobody wants it

    def _queued(self) -> int:
        return sum(not e.future.done() for e in self._cache.values())

    def _put(self, key: tuple[str, bytes], entry: _Entry) -> None:
        if key in self._cache:
            self._drop(key)
        self._cache[key] = entry
        self._cached_bytes += entry.size
        while len(self._cache) > 1 and (len(self._cache) > self.cache_entries
                                        or self._cached_bytes > self.cache_bytes):
            self._drop(next(iter(self._cache)))

    def _drop(self, key: tuple[str, bytes]) -> None:
        self._cached_bytes -= self._cache.pop(key).size

    def _compile(self, kind: str, text: str) -> CompiledGrammar | Refusal:
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
                return Refusal(f"unknown grammar kind {kind!r}")
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse and conversion errors
            return Refusal(f"cannot compile the {kind}: {_NOISE.sub('', str(e)).strip()[:REFUSAL_CHARS]}")
        if not _allows_any(compiled, self.vocab_size):  # e.g. root ::= root, or {"anyOf": []}
            return Refusal(f"the {kind} matches no output at all")
        return CompiledGrammar(kind, text, compiled, self.limits.step_budget_s)

    def _compiler(self) -> Any:
        if self._xgr_compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer.backend, vocab_size=self.vocab_size,
                                                      stop_token_ids=list(self.tokenizer.eos_token_ids))
            self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._xgr_compiler


def too_large(kind: str, text: str, limits: GrammarLimits) -> str | None:
    """Why a grammar is more than a request may ask the compiler for, or None: its bytes, or its nesting (a JSON
    schema's objects and arrays; a regex's groups). Checked before it queues, in time linear in its length."""
    if len(text.encode()) > limits.max_bytes:
        return f"the {kind} is longer than {limits.max_bytes} bytes (--grammar-max-bytes)"
    nesting = _NESTING.get(kind)
    if nesting is not None and _deepest(text, *nesting) > limits.max_nesting:
        return f"the {kind} nests deeper than {limits.max_nesting} levels (--grammar-max-nesting)"
    return None


# What nests in each kind: a pattern whose matches are its tokens, and the tokens that open and close a level. A
# JSON schema's objects and arrays (strings matched whole, so brackets inside them are no tokens of their own); a
# regex's groups (escapes and character classes matched whole, so their parentheses are not groups).
_NESTING = {
    "json_schema": (re.compile(r'"(?:[^"\\]|\\.)*"|[\[{\]}]'), frozenset("[{"), frozenset("]}")),
    "regex": (re.compile(r"\\.|\[(?:[^\]\\]|\\.)*\]|[()]"), frozenset("("), frozenset(")")),
}


def _deepest(text: str, tokens: re.Pattern, opens: frozenset[str], closes: frozenset[str]) -> int:
    """The deepest nesting in ``text``, read as a flat run of tokens (no recursion)."""
    depth = deepest = 0
    for token in tokens.finditer(text):
        if token[0] in opens:
            depth += 1
            deepest = max(deepest, depth)
        elif token[0] in closes:
            depth -= 1
    return deepest


class RowGrammar:
    """One request's place in its grammar."""

    def __init__(self, grammar: CompiledGrammar, name: str):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(grammar.compiled)
        self.name = name  # the request field, for the dead-end message
        self.budget_s = grammar.step_budget_s
        self.step_s = 0.0  # this step's work so far: its mask, then its accept
        self.slow_steps = 0  # steps in a row over the budget
        self._accepted: tuple[int, bool] | None = None  # the step's token, fed by the forward thread, not yet taken

    def fill(self, bits: torch.Tensor, row: int) -> None:
        start = time.perf_counter()
        self.matcher.fill_next_token_bitmask(bits, row)
        self.step_s += time.perf_counter() - start

    def accept(self, token: int) -> None:
        """Feed ``token`` to the matcher, timed with this step's mask. The forward thread calls it right after
        sampling, so a slow accept (it grows with ambiguous shapes) holds only that thread, not the event loop."""
        start = time.perf_counter()
        self._accepted = (token, self.matcher.accept_token(token))
        step_s, self.step_s = self.step_s + time.perf_counter() - start, 0.0
        self.slow_steps = self.slow_steps + 1 if step_s > self.budget_s else 0

    def advance(self, seq: Sequence) -> None:
        """Take ``seq``'s newest token (accepting it here unless the step already did); finish ``seq`` at a dead end,
        the grammar's end, or past its budget."""
        token = seq.output_ids[-1]
        if self._accepted is None or self._accepted[0] != token:
            self.accept(token)
        accepted, self._accepted = self._accepted[1], None
        if not accepted:
            seq.finish_reason = {"type": "abort",
                                 "message": f"grammar dead end: token {token} is not allowed by {self.name}"}
        elif self.matcher.is_terminated() and seq.finish_reason is None:
            seq.finish_reason = {"type": "stop", "matched": token}
        elif self.slow_steps >= SLOW_STEPS and seq.finish_reason is None:
            seq.finish_reason = {"type": "abort", "message": (
                f"{self.name}: the grammar took over {self.budget_s * 1000:g} ms a token for {SLOW_STEPS} tokens "
                "in a row, in the step other requests share; a grammar without nested repetition (such as "
                "(a*)* or ((a|b)+)+) avoids that")}


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
    for i in rows:  # one at a time, so that each row's work is timed against its budget
        grammars[i].fill(bits, i)
    for i, stuck in zip(rows, (bits[rows] == 0).all(dim=1).tolist()):
        if stuck:  # a state with no way on: let the row end, which advance() then reports as a dead end
            _allow(bits, i, grammars[i].matcher.stop_token_ids)
    return BatchMask(rows, bits)


def accept_tokens(grammars: list[RowGrammar | None], tokens: list[int]) -> None:
    """Feed each row with a grammar its sampled token (on the forward thread: see ``RowGrammar.accept``)."""
    for grammar, token in zip(grammars, tokens):
        if grammar is not None:
            grammar.accept(token)


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
