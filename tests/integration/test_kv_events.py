"""KV events from a real worker process: a ZMQ SUB socket bound on loopback (llm-d's centralised mode: the
worker connects to it) follows real /generate requests, L1 -> L2 demotion and a flush, and must match the
worker's own page counts and the page hashes a router can compute from the prompt."""
from __future__ import annotations

import hashlib
import json
import time

import httpx
import pytest

from decode_worker.cache.kv_events import MEDIUM_CPU, MEDIUM_GPU, block_hash
from decode_worker.cache.node import chain_hashes, token_key
from tests.servers import Proc, free_port, start_worker
from tests.unit.test_kv_events import Replica

PS = 16
TOPIC = "kv@127.0.0.1@smollm2"


def prompt(base: int) -> list[int]:
    """200 token ids; prompts of different ``base`` share no page."""
    return [1000 + (base * 7919 + i * 31) % 30000 for i in range(200)]


@pytest.fixture(scope="module")
def worker(tmp_path_factory, smollm2_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replica = Replica(endpoint, "kv@", bind=True, block_size=PS)
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": TOPIC})
    proc = None
    try:
        proc = start_worker("kv-events", tmp_path_factory.mktemp("logs"), "colocated", "--page-size", str(PS),
                            "--max-total-tokens", "512", "--disaggregation-decode-hicache-ratio", "2",
                            "--disaggregation-decode-enable-radix-cache", "--disaggregation-decode-enable-hicache",
                            "--kv-events-config", config)
        replica.drain(quiet_s=1.0)  # a bound ZMQ socket takes in a new connection only when used: subscribe now
        yield proc, replica
    finally:
        if proc is not None:
            proc.stop()
        replica.close()


def generate(proc: Proc, ids: list[int]) -> None:
    r = httpx.post(proc.url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 4,
                                                                                        "temperature": 0}}, timeout=120)
    assert r.status_code == 200, r.text


def prompt_hashes(proc: Proc, ids: list[int]) -> list[int]:
    """The event hashes of the prompt's whole pages, computed from the tokens and the layout fingerprint alone."""
    fingerprint = httpx.get(proc.url + "/server_info", timeout=10).json()["kv_layout_fingerprint"]
    seed = hashlib.sha256(fingerprint.encode()).digest()
    return [block_hash(h.hex()) for h in chain_hashes(token_key(ids[: len(ids) // PS * PS]), PS, seed)]


def settle(proc: Proc, replica: Replica) -> None:
    """Until the worker holds no request and its last events arrived."""
    deadline = time.monotonic() + 30
    while proc.metric("decode_worker_cache_pages", tier="device", state="locked") or \
            proc.metric("decode_worker_cache_pages", tier="device", state="used"):
        assert time.monotonic() < deadline, proc.tail()
        time.sleep(0.2)
    replica.drain(quiet_s=1.0)


def on(replica: Replica, medium: str) -> set[int]:
    return {h for h, m in replica.present if m == medium}


@pytest.mark.slow  # a minute here, most of it the worker's start-up; tests/unit/test_kv_events.py is the fast check
def test_events_follow_requests_demotion_and_flush(worker):
    proc, replica = worker
    first = prompt(1)
    generate(proc, first)
    settle(proc, replica)
    hashes = prompt_hashes(proc, first)
    assert set(hashes) <= on(replica, MEDIUM_GPU) and set(hashes) <= on(replica, MEDIUM_CPU)  # write_through
    assert replica.pages[hashes[1]] == (hashes[0], first[PS : 2 * PS])
    gpu_pages = proc.metric("decode_worker_cache_pages", tier="device", state="evictable")
    assert len(on(replica, MEDIUM_GPU)) == gpu_pages
    for base in range(2, 5):  # 3 more prompts of 13 pages overflow the 31-page L1: the first one goes to L2 only
        generate(proc, prompt(base))
    settle(proc, replica)
    assert not set(hashes) & on(replica, MEDIUM_GPU) and set(hashes) <= on(replica, MEDIUM_CPU)
    assert len(on(replica, MEDIUM_GPU)) == proc.metric("decode_worker_cache_pages", tier="device", state="evictable")
    assert httpx.post(proc.url + "/flush_cache", timeout=30).status_code == 200
    cleared = replica.cleared
    replica.drain(quiet_s=1.0)
    assert replica.present == set() and replica.cleared == cleared + 1
    assert replica.topics == {TOPIC.encode()}
    seqs = replica.seqs
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
