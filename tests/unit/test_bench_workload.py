"""The benchmark's traces and the unbounded-cache ceiling its hit rates are read against."""
from __future__ import annotations

from collections import Counter
from itertools import pairwise

import pytest

from decode_worker.bench.ceiling import unbounded_hit_rate
from decode_worker.bench.workload import ChatSpec, SharedPrefixSpec, conversations, shared_prefix_trace

SPEC = SharedPrefixSpec(groups=5, prompts_per_group=8, prefix_len=32, suffix_len=8, output_len=4, seed=3)
VOCAB = 1000


def test_trace_is_seeded():
    assert shared_prefix_trace(SPEC, VOCAB) == shared_prefix_trace(SPEC, VOCAB)
    other = SharedPrefixSpec(**{**SPEC.__dict__, "seed": 4})
    assert [p.ids for p in shared_prefix_trace(other, VOCAB)] != [p.ids for p in shared_prefix_trace(SPEC, VOCAB)]


def test_shapes_share_no_prefix():
    """Workloads of one run meet in L3, which is never flushed: a prefix of one must not serve another."""
    wide = SharedPrefixSpec(**{**SPEC.__dict__, "groups": SPEC.groups * 2})
    prefixes = {tuple(p.ids[: SPEC.prefix_len]) for p in shared_prefix_trace(SPEC, VOCAB)}
    assert prefixes.isdisjoint(tuple(p.ids[: SPEC.prefix_len]) for p in shared_prefix_trace(wide, VOCAB))


def test_every_group_gets_its_share_of_prompts_with_its_own_prefix():
    trace = shared_prefix_trace(SPEC, VOCAB)
    assert Counter(p.group for p in trace) == {g: SPEC.prompts_per_group for g in range(SPEC.groups)}
    prefixes = {p.group: p.ids[: SPEC.prefix_len] for p in trace}
    assert len({tuple(v) for v in prefixes.values()}) == SPEC.groups
    for p in trace:
        assert len(p.ids) == SPEC.prefix_len + SPEC.suffix_len
        assert p.ids[: SPEC.prefix_len] == prefixes[p.group]
        assert all(0 <= t < VOCAB for t in p.ids)
    assert len({tuple(p.ids[SPEC.prefix_len :]) for p in trace}) == len(trace)  # suffixes are unique


def test_groups_are_interleaved_not_run_in_blocks():
    groups = [p.group for p in shared_prefix_trace(SPEC, VOCAB)]
    assert groups != sorted(groups)
    assert len(set(groups[: SPEC.groups])) > 1  # the first few prompts already mix groups
    switches = sum(a != b for a, b in pairwise(groups))
    assert switches > len(groups) // 2  # a block per group would switch only groups - 1 times


def test_second_round_keeps_prefixes_and_order_with_new_suffixes():
    first, second = shared_prefix_trace(SPEC, VOCAB), shared_prefix_trace(SPEC, VOCAB, 1)
    assert [p.group for p in first] == [p.group for p in second]
    assert all(a.ids[: SPEC.prefix_len] == b.ids[: SPEC.prefix_len] for a, b in zip(first, second))
    assert all(a.ids[SPEC.prefix_len :] != b.ids[SPEC.prefix_len :] for a, b in zip(first, second))


def test_chat_rounds_append_the_previous_answer():
    spec = ChatSpec(clients=2, rounds=3, first_len=10, turn_len=4, output_len=3, seed=1)
    a, b = conversations(spec, VOCAB)
    first = a.next_prompt()
    assert len(first) == 10 and first != b.next_prompt()
    a.answered(first, [7, 8, 9])
    second = a.next_prompt()
    assert second[:13] == first + [7, 8, 9] and len(second) == 17
    assert conversations(spec, VOCAB)[0].next_prompt() == first  # seeded per client


def test_ceiling_on_a_hand_computed_trace():
    # Page size 2. Request 1 finds nothing; it caches pages (1,2), (3,4): its prompt and all its output but the
    # last token, whose KV is never computed (99 is not cached). Request 2 finds both pages, 4 tokens, and adds
    # (5,6). Request 3 shares 3 tokens with the cache, one full page: 2 tokens. 4 + 2 hits over 3 + 6 + 4 tokens.
    requests = [([1, 2, 3], [4, 99]), ([1, 2, 3, 4, 5, 6], [7]), ([1, 2, 3, 9], [5])]
    assert unbounded_hit_rate(requests, page_size=2) == pytest.approx(6 / 13)
    assert unbounded_hit_rate(requests[:1], page_size=2) == 0.0
    assert unbounded_hit_rate([], page_size=2) == 0.0


def test_ceiling_counts_a_warm_store():
    warm = [([1, 2, 3, 4], [5])]
    assert unbounded_hit_rate([([1, 2, 3, 4, 6, 6], [0])], page_size=2, warm=warm) == pytest.approx(4 / 6)


def test_ceiling_of_the_shared_prefix_trace_is_the_reused_prefix_share():
    """Page-aligned prefixes: every prompt but the first of its group hits its whole prefix, suffixes never."""
    trace = [(p.ids, [1, 2, 3, 4]) for p in shared_prefix_trace(SPEC, VOCAB)]
    reused = SPEC.groups * (SPEC.prompts_per_group - 1) * SPEC.prefix_len
    total = SPEC.groups * SPEC.prompts_per_group * (SPEC.prefix_len + SPEC.suffix_len)
    assert unbounded_hit_rate(trace, page_size=16) == pytest.approx(reused / total)
    restart = [(p.ids, [1]) for p in shared_prefix_trace(SPEC, VOCAB, 1)]
    prompt_len = SPEC.prefix_len + SPEC.suffix_len
    assert unbounded_hit_rate(restart, 16, warm=trace) == pytest.approx(SPEC.prefix_len / prompt_len)
