"""NVIDIA Dynamo's KV indexer (ai-dynamo-runtime 1.6.1's Rust indexer, ``python -m dynamo.indexer``) as a real
consumer of a worker's KV events, in each event encoding. Registered with the worker's PUB and replay endpoints
as a Dynamo deployment would, its match scores for prompts must follow what the worker holds per tier while real
requests fill L1, push a prompt's pages to L2, share a prefix, and a flush clears everything. What the worker holds
is read from the same events by ``Replica`` (whose reading ``tests/unit/test_kv_events.py`` proves equal to the
cache's tiers) and its L1 total from the worker's metrics.

How the indexer reads the events (checked against it): it hashes each stored block's ``token_ids`` itself (and a
query's tokens the same way), taking our block hashes only as identities for parents and removals; its ``scores``
count ``GPU`` blocks only, and its per-instance ``cpu`` figure the longest match over GPU and CPU blocks; a batch
that does not decode is dropped whole, so a wrong field anywhere shows as a score that never comes.

The indexer has no bind address and listens on every interface, so it runs in a network namespace of its own
(``tests/netns.py``); the worker's endpoints are ``ipc://`` sockets, which cross that boundary as files."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from decode_worker.cache.kv_events import MEDIUM_CPU, MEDIUM_GPU
from tests.integration.test_kv_events import prompt_hashes
from tests.netns import REPO, start_isolated, stop_isolated, why_not_isolated
from tests.servers import Proc, start_worker
from tests.tiny_model import save_tiny_chat_model
from tests.unit.test_kv_events import Replica

PS = 16
MODEL = "kv-events-test"
INSTANCE = 1
INDEXER_PORT = 8090  # inside the indexer's own namespace: no other process can hold it
DYNAMO_PYTHON = Path(os.environ.get("DECODE_WORKER_DYNAMO_PYTHON", REPO / ".dynamo-venv" / "bin" / "python"))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not DYNAMO_PYTHON.exists(),
                       reason=f"Dynamo's indexer is not installed at {DYNAMO_PYTHON} (`make test-all` builds it "
                              "from locks/dynamo.txt)"),
]


def prompt(base: int) -> list[int]:
    """200 token ids of the tiny model's vocabulary (12 whole pages); prompts of different ``base`` share no page."""
    return [3 + (base * 97 + i * 31) % 250 for i in range(200)]


@pytest.fixture(scope="module", params=["array", "map"])
def indexed(request, tmp_path_factory):
    """A worker publishing in one encoding (L1 of 32 pages, L2 twice that), Dynamo's indexer following it, and our
    own reader of the same events."""
    reason = why_not_isolated()
    if reason:
        pytest.skip(f"Dynamo's indexer listens on every interface; kept off the network it needs a namespace: {reason}")
    encoding, tmp = request.param, tmp_path_factory.mktemp(f"dynamo-{request.param}")
    events, replay = f"ipc://{tmp}/events", f"ipc://{tmp}/replay"
    config = {"publisher": "zmq", "endpoint": events, "replay_endpoint": replay, "topic": "kv-events",
              "event_encoding": encoding}
    replica = Replica(events, block_size=PS, encoding=encoding)  # connected before the worker binds: misses nothing
    worker = indexer = None
    try:
        worker = start_worker(f"worker-{encoding}", tmp, "colocated", "--model-path",
                              str(save_tiny_chat_model(tmp / "model")), "--page-size", str(PS), "--max-total-tokens",
                              "512", "--disaggregation-decode-hicache-ratio", "2",
                              "--disaggregation-decode-enable-radix-cache", "--disaggregation-decode-enable-hicache",
                              "--kv-events-config", json.dumps(config))
        indexer = start_isolated(f"indexer-{encoding}", [str(DYNAMO_PYTHON), "-m", "dynamo.indexer", "--port",
                                                         str(INDEXER_PORT), "--threads", "1"],
                                 INDEXER_PORT, tmp / "indexer.sock", tmp)
        client = httpx.Client(transport=httpx.HTTPTransport(uds=str(tmp / "indexer.sock")), base_url="http://indexer",
                              timeout=10)
        wait_up(client, indexer)
        r = client.post("/register", json={"instance_id": INSTANCE, "endpoint": events, "replay_endpoint": replay,
                                           "model_name": MODEL, "block_size": PS})
        assert r.status_code == 201, r.text
        yield Indexed(worker, client, replica, indexer)
        client.close()
    finally:
        if indexer is not None:
            stop_isolated(indexer)
        if worker is not None:
            worker.stop()
        replica.close()


@dataclass
class Indexed:
    worker: Proc
    client: httpx.Client
    replica: Replica
    indexer: Proc

    def scores(self, ids: list[int]) -> tuple[int, int]:
        """The indexer's longest match for ``ids`` on the worker, in tokens: (on GPU, on GPU or CPU)."""
        r = self.client.post("/query", json={"token_ids": ids, "model_name": MODEL})
        if r.status_code == 404:  # no event decoded yet: the model has no index
            return 0, 0
        assert r.status_code == 200, r.text
        answer = r.json()
        gpu = answer["scores"].get(str(INSTANCE), {}).get("0", 0)
        return gpu, answer["instances"].get(str(INSTANCE), {}).get("cpu", 0)

    def held(self, hashes: list[int]) -> tuple[int, int]:
        """What the worker holds of a prompt, in the indexer's terms: its longest run of whole pages from the
        start, in tokens, on L1 and on L1 or L2."""
        def run(media: set[str]) -> int:
            have = {h for h, medium in self.replica.present if medium in media}
            return PS * next((i for i, h in enumerate(hashes) if h not in have), len(hashes))
        return run({MEDIUM_GPU}), run({MEDIUM_GPU, MEDIUM_CPU})

    def agree(self, ids: list[int]) -> tuple[int, int]:
        """Within 30 s (events travel after the answer), the indexer scores ``ids`` as the worker holds them."""
        hashes = prompt_hashes(self.worker, ids)
        deadline = time.monotonic() + 30
        while True:
            self.replica.drain(quiet_s=0.2)
            held, seen = self.held(hashes), self.scores(ids)
            if held == seen:
                return held
            assert time.monotonic() < deadline, f"the worker holds {held}, the indexer scores {seen}:\n" \
                                                f"{self.indexer.tail()}"
            time.sleep(0.2)


def wait_up(client: httpx.Client, indexer: Proc) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert indexer.alive(), indexer.tail()
        try:
            if client.get("/workers").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"the indexer never answered:\n{indexer.tail()}"
        time.sleep(0.3)


def generate(worker: Proc, ids: list[int]) -> None:
    r = httpx.post(worker.url + "/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200, r.text


def test_the_indexer_scores_what_the_worker_holds_per_tier(indexed):
    first = prompt(1)
    generate(indexed.worker, first)
    assert indexed.agree(first) == (192, 192)  # 12 whole pages, on L1 and (write_through) on L2
    assert indexed.agree(first[:96] + prompt(9)[96:]) == (96, 96)  # the indexer walks the chain our parents make
    for base in range(2, 5):  # 13 pages each in a 32-page L1: the oldest prompts leave it, L2 keeps them
        generate(indexed.worker, prompt(base))
    held = [indexed.agree(prompt(base)) for base in range(1, 5)]
    assert held[0][0] < 192 and held[-1] == (192, 192) and all(cpu == 192 for _, cpu in held), held
    on_gpu = sum(medium == MEDIUM_GPU for _, medium in indexed.replica.present)
    assert on_gpu == indexed.worker.metric("decode_worker_cache_pages", tier="device", state="evictable")
    assert httpx.post(indexed.worker.url + "/flush_cache", timeout=30).status_code == 200
    for base in range(1, 5):
        assert indexed.agree(prompt(base)) == (0, 0)  # AllBlocksCleared
