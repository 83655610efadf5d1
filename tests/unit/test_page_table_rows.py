"""Decode steps through persistent page-table rows lay out exactly what a full rebuild does, send only the pages
added since the last step, and free exactly the rows they took; a reused row never shows an earlier request's
pages."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from decode_worker.model import page_table
from decode_worker.model.forward_batch import ForwardBatch
from decode_worker.model.page_table import PageTableRows

PAGE = 4
CPU = torch.device("cpu")
FIELDS = ("input_ids", "positions", "out_slots", "page_table", "seq_lens", "logits_indices")


def step(rows: PageTableRows, live: dict[str, list[int]], lens: dict[str, int]) -> ForwardBatch:
    keys = list(live)
    return rows.decode_batch(keys, [7] * len(keys), [lens[k] for k in keys], [live[k] for k in keys], PAGE)


def assert_same_as_full_build(fb: ForwardBatch, live: dict[str, list[int]], lens: dict[str, int]) -> None:
    keys = list(live)
    full = ForwardBatch.build([[7]] * len(keys), [lens[k] for k in keys], [live[k] for k in keys], PAGE, CPU)
    assert fb.is_decode and fb.context_slots is None and fb.prefix_lens == full.prefix_lens
    for name in FIELDS:
        assert torch.equal(getattr(fb, name), getattr(full, name)), name


def sent_deltas(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many (row, column, page) triples each step sends."""
    sizes: list[int] = []
    real = page_table.pack_to_device

    def spy(host, device):
        sizes.append(host["d_vals"].numel())
        return real(host, device)

    monkeypatch.setattr(page_table, "pack_to_device", spy)
    return sizes


def test_steps_match_a_full_rebuild_through_growth_new_lists_and_reuse():
    rng = random.Random(3)
    rows = PageTableRows(max_pages=80, device=CPU, capacity=2)  # grows twice
    free = list(range(1, 2000))
    rng.shuffle(free)
    live: dict[str, list[int]] = {}
    lens: dict[str, int] = {}
    for n in range(200):
        if len(live) < 6 and rng.random() < 0.3:
            key, lens_new = f"r{n}", rng.randrange(1, 60)
            live[key], lens[key] = [free.pop() for _ in range(lens_new // PAGE + 1 + rng.randrange(2))], lens_new
        if live and rng.random() < 0.1:  # finished: its row goes back, zeroed
            gone = rng.choice(list(live))
            rows.release(gone)
            del live[gone], lens[gone]
        if live and rng.random() < 0.1:  # a new list object (the tree swapped a prefix page): whole row again
            key = rng.choice(list(live))
            live[key] = [free.pop()] + live[key][1:]
        if not live:
            continue
        assert_same_as_full_build(step(rows, live, lens), live, lens)
        for key in live:
            lens[key] += 1
            if len(live[key]) * PAGE < lens[key] + 1:
                live[key] += [free.pop()]  # grows in place, as the scheduler does
    assert rows.capacity == 8 and len(rows) == len(live)


def test_only_pages_added_since_the_last_step_are_sent(monkeypatch: pytest.MonkeyPatch):
    sizes = sent_deltas(monkeypatch)
    rows = PageTableRows(max_pages=16, device=CPU)
    live, lens = {"a": [3, 4, 5], "b": [6]}, {"a": 10, "b": 1}
    step(rows, live, lens)  # a new row carries its pages up to what the step needs (3 and 1)
    lens = {"a": 11, "b": 2}
    step(rows, live, lens)  # nothing new
    live["a"] += [9]
    lens = {"a": 12, "b": 3}
    fb = step(rows, live, lens)  # a's fourth page is needed now
    assert sizes == [4, 0, 1]
    assert fb.page_table.tolist() == [[3, 4, 5, 9], [6, 0, 0, 0]]


def test_a_reused_row_never_shows_the_previous_requests_pages():
    rows = PageTableRows(max_pages=8, device=CPU, capacity=1)
    step(rows, {"old": [11, 12, 13, 14, 15]}, {"old": 18})
    row = rows.row_of("old")
    rows.release("old")
    assert rows.table[row].tolist() == [0] * 8  # zeroed at release, before anyone reuses it
    fb = step(rows, {"new": [21, 22]}, {"new": 5})
    assert rows.row_of("new") == row and rows.table[row].tolist() == [21, 22] + [0] * 6
    assert fb.page_table.tolist() == [[21, 22]]


def test_a_failed_step_frees_exactly_the_rows_it_took(monkeypatch: pytest.MonkeyPatch):
    rows = PageTableRows(max_pages=8, device=CPU, capacity=4)
    live, lens = {"kept": [1, 2]}, {"kept": 5}
    step(rows, live, lens)
    kept_row = rows.row_of("kept")
    with pytest.raises(ValueError, match="9 tokens need 3 pages, request has 2"):
        step(rows, {**live, "short": [3, 4]}, {**lens, "short": 8})
    assert "short" not in rows and len(rows) == 1
    live["kept"] += [5]
    lens["kept"] = 8

    def broken(host, device):
        raise RuntimeError("copy failed")

    real = page_table.pack_to_device
    monkeypatch.setattr(page_table, "pack_to_device", broken)
    with pytest.raises(RuntimeError, match="copy failed"):
        step(rows, {**live, "new": [6]}, {**lens, "new": 0})
    assert "new" not in rows and rows.row_of("kept") == kept_row and len(rows) == 1
    monkeypatch.setattr(page_table, "pack_to_device", real)
    assert_same_as_full_build(step(rows, live, lens), live, lens)  # kept's third page is resent


def test_a_step_refuses_a_request_twice_or_past_a_row():
    rows = PageTableRows(max_pages=2, device=CPU)
    with pytest.raises(ValueError, match="twice"):
        rows.decode_batch(["a", "a"], [1, 1], [0, 0], [[1], [1]], PAGE)
    with pytest.raises(ValueError, match="a page-table row holds 2"):
        rows.decode_batch(["a"], [1], [8], [[1, 2, 3]], PAGE)
    assert len(rows) == 0


class RowLifecycle(RuleBasedStateMachine):
    """Requests start, grow, get a new page list, finish or fail in any order; every step matches a full rebuild,
    and rows held match the live requests exactly, free rows all zero."""

    def __init__(self):
        super().__init__()
        self.rows = PageTableRows(max_pages=12, device=CPU, capacity=2)
        self.live: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}
        self.next_page, self.next_key = 1, 0

    def _pages(self, n: int) -> list[int]:
        self.next_page += n
        return list(range(self.next_page - n, self.next_page))

    @rule(length=st.integers(0, 30))
    def start(self, length: int):
        key = f"r{self.next_key}"
        self.next_key += 1
        self.live[key], self.lens[key] = self._pages(length // PAGE + 1), length

    @precondition(lambda self: self.live)
    @rule()
    def decode(self):
        assert_same_as_full_build(step(self.rows, self.live, self.lens), self.live, self.lens)
        for key in self.live:
            self.lens[key] = min(self.lens[key] + 1, 40)
            if len(self.live[key]) * PAGE < self.lens[key] + 1:
                self.live[key] += self._pages(1)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def new_list(self, data):
        key = data.draw(st.sampled_from(sorted(self.live)))
        self.live[key] = self._pages(1) + self.live[key][1:]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        key = data.draw(st.sampled_from(sorted(self.live)))
        self.rows.release(key)
        del self.live[key], self.lens[key]

    @rule()
    def failing_step(self):
        """A request short of pages joins: the step fails and takes nothing."""
        before = {k: self.rows.row_of(k) for k in self.live if k in self.rows}
        with pytest.raises(ValueError):
            step(self.rows, {**self.live, "short": []}, {**self.lens, "short": 3})
        assert {k: self.rows.row_of(k) for k in self.live if k in self.rows} == before and "short" not in self.rows

    @invariant()
    def rows_are_exactly_the_live_requests(self):
        held = {self.rows.row_of(k) for k in self.live if k in self.rows}
        assert len(self.rows) == len(held) and all(k in self.live for k in self.rows._rows)
        for r in range(self.rows.capacity):
            if r not in held:
                assert not self.rows.table[r].any(), f"free row {r} shows pages"


TestRowLifecycle = RowLifecycle.TestCase
TestRowLifecycle.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
