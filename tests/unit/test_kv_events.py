"""KV events: a real ZMQ SUB socket reads what a real HierarchicalCache (L1 + L2) publishes, decodes the frames
with vLLM's message types in the encoding asked for (positional arrays, as llm-d and Dynamo read them, or the tagged
maps of vLLM 0.24+), and must find exactly the cache's own pages per tier after stores, splits, demotion to L2,
load-back, L2 eviction and flush; plus the wire details, replay and the flag."""
from __future__ import annotations

import asyncio
import json
import socket
import struct
import time

import msgpack
import msgspec
import pytest
import zmq

from decode_worker.cache.hicache import LoadBackError
from decode_worker.cache.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    block_hash,
)
from decode_worker.cache.node import token_key
from decode_worker.config import ConfigError, ServerConfig, kv_events_settings
from decode_worker.engine.kv_event_publisher import ZmqEventPublisher
from decode_worker.engine.wiring import open_kv_events
from decode_worker.launch import free_port
from decode_worker.metrics import Metrics
from tests import vllm_kv_events
from tests.unit.test_hicache import PS, make_cache, run, start

TOPIC = "kv@10.0.0.7:30000@smollm2"


class Replica:
    """A router's view of one worker, rebuilt from the events alone: the (hash, medium) pairs present."""

    def __init__(self, endpoint: str, topic: str = "", bind: bool = False, block_size: int = PS,
                 encoding: str = "array"):
        self.block_size, self.encoding = block_size, encoding
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if bind:
            self.sub.bind(endpoint)
        else:
            self.sub.connect(endpoint)
        self.present: set[tuple[int, str]] = set()
        self.pages: dict[int, tuple[int | None, list[int]]] = {}  # hash -> (parent hash, tokens) as stored
        self.cleared = 0
        self.seqs: list[int] = []
        self.topics: set[bytes] = set()

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()

    def apply(self, payload: bytes) -> None:
        batch = vllm_kv_events.decode(payload, self.encoding)
        assert batch.data_parallel_rank == 0
        for event in batch.events:
            if isinstance(event, vllm_kv_events.STORED):
                bs = self.block_size
                assert event.block_size == bs and len(event.token_ids) == bs * len(event.block_hashes)
                assert event.lora_id is event.lora_name is None
                assert all(-(1 << 63) <= h < 1 << 63 for h in event.block_hashes)
                parent = event.parent_block_hash
                assert parent is None or parent in self.pages, "parent never stored"
                for i, h in enumerate(event.block_hashes):
                    self.present.add((h, event.medium))
                    self.pages[h] = (parent, event.token_ids[i * bs : (i + 1) * bs])
                    parent = h
            elif isinstance(event, vllm_kv_events.REMOVED):
                for h in event.block_hashes:
                    assert (h, event.medium) in self.present, "removed a block never stored"
                    self.present.discard((h, event.medium))
            else:
                assert isinstance(event, vllm_kv_events.CLEARED)
                self.present.clear()
                self.cleared += 1

    def drain(self, quiet_s: float = 0.3, deadline_s: float = 10.0) -> None:
        """Apply messages until none arrives for ``quiet_s``."""
        deadline = time.monotonic() + deadline_s
        while self.sub.poll(int(quiet_s * 1000)):
            assert time.monotonic() < deadline, "events never stopped"
            topic, seq, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            self.seqs.append(int.from_bytes(seq, "big"))
            self.apply(payload)

    def join(self, publisher: ZmqEventPublisher) -> None:
        """Wait out ZMQ's slow-joiner window: probe with AllBlocksCleared until one arrives."""
        deadline = time.monotonic() + 10
        while not self.sub.poll(100):
            assert time.monotonic() < deadline, "subscriber never joined"
            publisher.put(AllBlocksCleared())
        self.drain()


def cache_state(cache) -> tuple[set[tuple[int, str]], dict[int, tuple[int | None, list[int]]]]:
    """What the cache itself holds, in event hashes: (hash, medium) per tier, and each page's parent and tokens."""
    tree, present, pages = cache.tree, set(), {}
    for node in tree.nodes():
        hashes = [block_hash(h) for h in tree.page_hashes(node)]
        parent = None if node.parent is tree.root else block_hash(tree.page_hashes(node.parent)[-1])
        tokens = list(struct.unpack(f"<{len(node.key) // 4}i", node.key))
        for i, h in enumerate(hashes):
            pages[h] = (parent, tokens[i * PS : (i + 1) * PS])
            parent = h
        for medium, here in ((MEDIUM_GPU, node.on_device), (MEDIUM_CPU, node.on_host)):
            if here:
                present.update((h, medium) for h in hashes)
    return present, pages


@pytest.fixture(params=["array", "map"])
def wire(request):
    """``wire(**cache_flags)``: a cache with L2 (8 usable L1 pages, 12 L2 pages), its publisher and a subscriber,
    all real, in each event encoding; the subscriber binds and the worker connects, as in llm-d's centralised
    mode."""
    made = []

    def factory(**kw):
        cache, dev, _ = make_cache(device_pages=9, host_pages=12, **kw)
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        cfg = ServerConfig(kv_events_config=json.dumps({"publisher": "zmq", "endpoint": endpoint, "topic": TOPIC,
                                                        "event_encoding": request.param}))
        replica = Replica(endpoint, "kv@", bind=True, encoding=request.param)
        publisher = open_kv_events(cfg, cache, Metrics())
        made.append((cache, publisher, replica))
        replica.join(publisher)
        return cache, dev, replica, publisher

    yield factory
    for cache, publisher, replica in made:
        cache.engine.gate.set()
        cache.close()
        publisher.close()
        replica.close()


def checker(cache, replica):
    """Once copies landed and events stopped: the replica holds exactly the cache's pages, parents and tokens."""
    def check():
        cache.drain()
        replica.drain()
        present, pages = cache_state(cache)
        assert replica.present == present
        assert {h: replica.pages[h] for h, _ in present} == {h: pages[h] for h, _ in present}
    return check


def test_events_rebuild_the_cache_tiers(wire):
    cache, dev, replica, publisher = wire()
    check = checker(cache, replica)

    a = tuple(range(8))  # 4 pages
    run(cache, dev, a)  # write_through: on L1 and L2
    check()
    assert {m for _, m in replica.present} == {MEDIUM_GPU, MEDIUM_CPU}
    assert [replica.pages[block_hash(h)][1] for h in cache.tree.page_hashes(cache.tree.match(token_key(a))[0][-1])] \
        == [[0, 1], [2, 3], [4, 5], [6, 7]]
    run(cache, dev, a[:4] + (50, 51, 52, 53))  # splits a's node: no hash changes, new pages stored
    check()
    cache.evict_device(100)  # every L1 page demoted: only L2 remains
    check()
    assert {m for _, m in replica.present} == {MEDIUM_CPU}
    run(cache, dev, a)  # loaded back from L2
    check()
    for i in range(4):  # L2 holds 12 pages: new prompts push the old ones out of L2
        run(cache, dev, tuple(range(100 * (i + 1), 100 * (i + 1) + 8)))
        cache.drain()
        cache.evict_device(100)
        check()
    assert cache.stats().tokens.evicted_host > 0
    cleared = replica.cleared
    assert cache.flush() > 0
    check()
    assert replica.cleared == cleared + 1  # nothing was locked: the flush emptied every tier
    first = replica.seqs[0]  # the probes' first messages may fall in the slow-joiner window
    assert replica.present == set() and replica.seqs == list(range(first, first + len(replica.seqs)))
    assert replica.topics == {TOPIC.encode()} and publisher.dropped == 0


WIRE_EVENTS = [BlockStored([5, -7], None, [1, 2, 3, 4], 2, MEDIUM_GPU), BlockRemoved([-7], MEDIUM_CPU),
               AllBlocksCleared()]
ON_THE_WIRE = {  # what msgpack carries for WIRE_EVENTS, as vLLM's own structs encode them
    "array": [["BlockStored", [5, -7], None, [1, 2, 3, 4], 2, None, "GPU", None], ["BlockRemoved", [-7], "CPU"],
              ["AllBlocksCleared"]],
    "map": [{"type": "BlockStored", "block_hashes": [5, -7], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
             "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None},
            {"type": "BlockRemoved", "block_hashes": [-7], "medium": "CPU"}, {"type": "AllBlocksCleared"}],
}


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_wire_format_and_replay(tmp_path, encoding):
    """The exact frames and msgpack a vLLM consumer parses in each encoding (the batch an array in both, its events
    arrays or tagged maps), and the ROUTER replay of missed batches, each reply framed as on the PUB socket."""
    pub_ep, replay_ep = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    publisher = ZmqEventPublisher(pub_ep, topic=TOPIC, replay_endpoint=replay_ep, event_encoding=encoding)
    replica = Replica(pub_ep, encoding=encoding)
    try:
        replica.join(publisher)
        for event in WIRE_EVENTS:
            publisher.put(event)
        assert replica.sub.poll(5000)
        topic, seq, payload = replica.sub.recv_multipart()
        assert topic == TOPIC.encode() and len(seq) == 8
        ts, events, rank = msgpack.unpackb(payload)
        assert abs(ts - time.time()) < 60 and rank == 0
        assert events == ON_THE_WIRE[encoding]
        other = "map" if encoding == "array" else "array"
        with pytest.raises(msgspec.ValidationError):  # the two encodings are not interchangeable
            vllm_kv_events.decode(payload, other)
        last = int.from_bytes(seq, "big")
        replayed = replay(replica.ctx, replay_ep, last - 1)
        assert replayed[0][:2] == (TOPIC.encode(), last - 1) and replayed[-1] == (TOPIC.encode(), last, payload)
    finally:
        publisher.close()
        replica.close()


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[bytes, int, bytes]]:
    """Ask the ROUTER for the batches from ``start``, in vLLM's replay protocol: each answer is (topic, sequence,
    payload) as on the PUB socket (vLLM 0.26+), the end an empty topic and sequence -1. A DEALER, not vLLM
    example's REQ: a REQ socket takes one reply per request, and a replay is many."""
    req = ctx.socket(zmq.DEALER)
    try:
        req.connect(endpoint)
        req.send_multipart([b"", start.to_bytes(8, "big")])
        replayed = []
        while True:
            assert req.poll(5000), "no replay answer"
            empty, topic, seq_bytes, body = req.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq_bytes, "big", signed=True) == -1:
                assert topic == body == b""
                return replayed
            replayed.append((topic, int.from_bytes(seq_bytes, "big"), body))
    finally:
        req.close(linger=0)


def test_put_never_blocks_and_counts_what_a_full_queue_drops(tmp_path):
    publisher = ZmqEventPublisher(f"ipc://{tmp_path}/events", max_queue_size=1)
    try:
        start = time.monotonic()
        for _ in range(20_000):
            publisher.put(AllBlocksCleared())
        assert time.monotonic() - start < 2 and publisher.dropped > 0
    finally:
        publisher.close()


def test_an_endpoint_in_use_is_refused_by_name(tmp_path):
    publisher = ZmqEventPublisher(f"ipc://{tmp_path}/events")
    port = free_port()
    with socket.socket() as s:
        s.bind(("0.0.0.0", port))
        s.listen()
        with pytest.raises(OSError, match=f"tcp://\\*:{port}"):
            ZmqEventPublisher(f"tcp://*:{port}")
    publisher.close()


def test_block_hash_is_the_signed_first_8_bytes():
    assert block_hash("00" * 7 + "01" + "ab" * 24) == 1
    assert block_hash("ff" * 32) == -1
    assert block_hash("80" + "00" * 31) == -(1 << 63)


@pytest.mark.parametrize("raw, on", [
    (None, False),
    ('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv@a@m"}', True),
    ('{"publisher": "zmq", "replay_endpoint": "tcp://*:5558", "buffer_steps": 10, "hwm": 5}', True),
    ("{}", True),
    ('{"enable_kv_cache_events": false}', False),
    ('{"publisher": "null", "endpoint": "tcp://*:5557"}', False),
    ('{"event_encoding": "map"}', True),
])
def test_the_flag_reads_vllm_and_sglang_configs(raw, on):
    assert (kv_events_settings(raw) is not None) == on


@pytest.mark.parametrize("raw, message", [
    ('{"endpont": "tcp://*:5557"}', "unknown key 'endpont'"),
    ('{"hwm": "lots"}', "hwm cannot be 'lots'"),
    ('{"buffer_steps": 0}', "buffer_steps cannot be 0"),
    ('{"publisher": "nats"}', "publisher must be zmq or null"),
    ('{"event_encoding": "json"}', "event_encoding must be one of array, map, not 'json'"),
    ("[1]", "must be a JSON object"),
    ("{", "is not JSON"),
])
def test_the_flag_refuses_what_it_cannot_honour(raw, message):
    with pytest.raises(ConfigError, match=message):
        kv_events_settings(raw)


def test_off_by_default_and_refused_without_prefix_reuse():
    cache, _, _ = make_cache(host_pages=None)
    try:
        assert open_kv_events(ServerConfig(), cache, Metrics()) is None and cache.tree.events is None
    finally:
        cache.close()
    with pytest.raises(ConfigError, match="--kv-events-config needs"):
        ServerConfig(role="decode", kv_events_config="{}").validate()


def test_failed_copies_withdraw_what_they_announced(wire):
    """Pages are announced when their copy is queued; a failed demotion or load-back takes them back."""
    cache, dev, replica, _ = wire(write_policy="write_back", eviction="lru")
    check = checker(cache, replica)
    prompt = tuple(range(10))
    run(cache, dev, prompt)
    cache.engine.fail_next = 1
    cache.evict_device(100)  # write_back demotion to L2 fails: the node leaves both tiers
    check()
    assert replica.present == set()
    run(cache, dev, prompt)
    cache.evict_device(100)  # this demotion lands: L2 only
    check()
    cache.engine.fail_next = 1
    handle = start(cache, prompt + (1,))  # the load-back fails: L1 is withdrawn, L2 stays
    with pytest.raises(LoadBackError):
        asyncio.run(handle.wait())
    cache.release(handle)
    check()
    assert {m for _, m in replica.present} == {MEDIUM_CPU}


def test_a_full_queue_shows_as_a_sequence_gap_then_a_clear_and_is_counted(tmp_path):
    """Blocks stored then removed, far faster than a 4-event queue drains: events are dropped, and a subscriber
    must be able to tell: the sequence numbers skip one where events went missing, an AllBlocksCleared comes
    right after the gap, and the view rebuilt from what follows it is never wrong (here: empty at the end)."""
    counted = []
    endpoint = f"ipc://{tmp_path}/events"
    publisher = ZmqEventPublisher(endpoint, max_queue_size=4, on_drop=lambda: counted.append(1))
    replica = Replica(endpoint)
    batches: list[tuple[int, list]] = []
    try:
        replica.join(publisher)
        for i in range(3000):
            publisher.put(BlockStored([i], None, [i, i], 2, MEDIUM_GPU))
            publisher.put(BlockRemoved([i], MEDIUM_GPU))
        time.sleep(0.2)
        publisher.put(BlockStored([10**6], None, [1, 1], 2, MEDIUM_GPU))  # after the flood: arrives whole
        while replica.sub.poll(500):
            _, seq, payload = replica.sub.recv_multipart()
            batches.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1]))
    finally:
        publisher.close()
        replica.close()
    assert publisher.dropped > 0 and len(counted) == publisher.dropped
    seqs = [s for s, _ in batches]
    gaps = [i for i in range(1, len(seqs)) if seqs[i] != seqs[i - 1] + 1]
    assert gaps, seqs
    assert all(batches[i][1][0] == ["AllBlocksCleared"] for i in gaps)  # every gap is followed by a clear
    present: set[int] = set()  # a router's view, lenient as routers are about removals of unknown blocks
    for _, events in batches:
        for tag, *fields in events:
            if tag == "AllBlocksCleared":
                present.clear()
            elif tag == "BlockStored":
                present.update(fields[0])
            else:
                present.difference_update(fields[0])
    assert present == {10**6}


def test_dropped_events_are_a_metric():
    metrics = Metrics()
    metrics.kv_events_dropped.inc()
    assert b"decode_worker_kv_events_dropped_total" in metrics.render()
    assert metrics.kv_events_dropped._value.get() == 1
