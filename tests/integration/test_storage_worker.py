"""L3 storage at the worker level: real colocated workers over a file folder and over one shared redis-server.

Colocated workers run the same cache and admission code as the decode role. Prompts are token ids, so the
test can name the L3 page files of each prompt (``page_keys``) and damage exactly the page it means to.
"Identical output" compares greedy tokens with those of a worker that computed the whole prompt itself.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import itertools
import statistics
import threading
import time

import httpx
import pytest

from decode_worker.cache.node import chain_hashes, token_key
from decode_worker.cache.storage import FileStore, encode_record
from decode_worker.cache.storage.base import HEADER_BYTES
from tests.integration.test_redis_store import REDIS_SERVER, RedisServer
from tests.servers import Proc, free_port, pd_generate, start_worker, start_workers, wait_pages_free

PS = 16
HICACHE = ["--page-size", str(PS), "--max-total-tokens", "1024", "--disaggregation-decode-enable-radix-cache",
           "--disaggregation-decode-enable-hicache"]
GREEDY = {"max_new_tokens": 8, "temperature": 0}
PROMPT_PAGES = 12  # whole pages a 200-token prompt can take from cache (its last token is always computed)


def prompt(base: int) -> list[int]:
    """200 token ids; prompts of different ``base`` share no page."""
    return [1000 + (base * 7919 + i * 31) % 30000 for i in range(200)]


def generate(proc: Proc, ids: list[int]) -> tuple[list[int], dict]:
    r = httpx.post(proc.url + "/generate", json={"input_ids": ids, "sampling_params": GREEDY}, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["output_ids"], out["meta_info"]["cached_tokens_details"]


def page_keys(proc: Proc, ids: list[int]) -> list[str]:
    """The L3 keys of the pages the worker would look up for ``ids`` (all tokens but the last)."""
    fingerprint = httpx.get(proc.url + "/server_info", timeout=10).json()["kv_layout_fingerprint"]
    seed = hashlib.sha256(fingerprint.encode()).digest()
    return [h.hex() for h in chain_hashes(token_key(ids[:-1]), PS, seed)]


def assert_every_page_back(proc: Proc) -> None:
    """No request holds L1 pages, and after a flush every L2 page is free: no prefetch kept a page it took."""
    wait_pages_free(proc)
    assert httpx.post(proc.url + "/flush_cache", timeout=30).status_code == 200
    host = {s: proc.metric("decode_worker_cache_pages", tier="host", state=s) for s in ("used", "evictable", "locked")}
    assert host == {"used": 0, "evictable": 0, "locked": 0}, host


def wait_metric(proc: Proc, name: str, at_least: float, timeout_s: float = 30, **labels: str) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.metric(name, **labels) < at_least:
        assert time.monotonic() < deadline, f"{name}{labels} stayed below {at_least}:\n{proc.tail()}"
        time.sleep(0.2)


# -- file backend: restart, a truncated page, a page of another layout --------------------------------------------


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("storage-logs")


@pytest.fixture(scope="module")
def restarted(logs, tmp_path_factory, smollm2_path):
    """Worker A fills an L3 folder with four prompts and stops; worker B starts on the same folder.

    Yields B, the folder and A's outputs per prompt: A computed each prompt whole (an empty L3, no shared pages),
    so its outputs are what a worker without storage gives.
    """
    folder = tmp_path_factory.mktemp("l3")
    # float32: B's outputs from stored pages (batched, queued) are compared token for token with A's, which a bf16
    # near-tie flips with the shape of the pass
    flags = [*HICACHE, "--hicache-storage-backend", "file", "--hicache-storage-url", str(folder),
             "--hicache-storage-prefetch-policy", "wait_complete", "--dtype", "float32"]
    a = start_worker("file-a", logs, "colocated", *flags)
    try:
        reference = {}
        for base in (1, 2, 3, 7):
            reference[base], cached = generate(a, prompt(base))
            assert sum(cached.values()) == 0
    finally:
        a.stop()  # graceful: queued L3 backups are stored before it exits
    assert "Application shutdown complete" in a.tail(), a.tail()
    b = start_worker("file-b", logs, "colocated", *flags)
    yield b, folder, reference
    b.stop()


def test_fresh_worker_on_a_warm_folder_gets_storage_hits(restarted):
    b, _, reference = restarted
    out, cached = generate(b, prompt(1))
    assert cached == {"device": 0, "host": 0, "storage": PROMPT_PAGES * PS}
    assert out == reference[1]
    assert b.metric("decode_worker_prefetch_tokens_total") >= PROMPT_PAGES * PS
    assert b.metric("decode_worker_cached_tokens_total", tier="storage") == PROMPT_PAGES * PS
    again, cached = generate(b, prompt(1))  # now an L1 hit
    assert again == out and cached["device"] == PROMPT_PAGES * PS and cached["storage"] == 0
    assert_every_page_back(b)


def test_queued_requests_share_one_prefetch(restarted):
    """Requests queued on one prefix in L3: the first fetches it, the others find it in the tree."""
    b, _, reference = restarted
    before = b.metric("decode_worker_prefetch_tokens_total")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: generate(b, prompt(7)), range(4)))
    assert [out for out, _ in results] == [reference[7]] * 4
    assert sum(cached["storage"] for _, cached in results) == PROMPT_PAGES * PS
    assert b.metric("decode_worker_prefetch_tokens_total") - before == PROMPT_PAGES * PS
    assert_every_page_back(b)


def test_truncated_page_file_is_a_miss(restarted):
    b, folder, reference = restarted
    ids = prompt(2)
    path = FileStore(folder, 1 << 30).path(page_keys(b, ids)[5])
    path.write_bytes(path.read_bytes()[:1000])  # a writer that crashed mid-page
    out, cached = generate(b, ids)
    assert cached["storage"] == 5 * PS  # the pages before it, and nothing from it on
    assert out == reference[2]
    assert b.metric("decode_worker_storage_failures_total", op="prefetch", reason="short") >= 1
    assert_every_page_back(b)


def test_page_of_another_layout_is_a_miss(restarted):
    b, folder, reference = restarted
    ids = prompt(3)
    key = page_keys(b, ids)[3]
    path = FileStore(folder, 1 << 30).path(key)
    payload = path.read_bytes()[HEADER_BYTES:]
    path.write_bytes(encode_record(key, "ab" * 16, payload))  # intact, but sealed by another model's layout
    out, cached = generate(b, ids)
    assert cached["storage"] == 3 * PS
    assert out == reference[3]
    assert b.metric("decode_worker_storage_failures_total", op="prefetch", reason="foreign") >= 1
    assert path.exists()  # a foreign page is someone else's: left alone
    assert_every_page_back(b)


# -- decode role: a restarted decode pod over a warm L3, default prefetch policy ------------------------------------


@pytest.fixture(scope="module")
def pd_restarted(logs, tmp_path_factory, smollm2_path):
    """A prefill worker and decode A (file L3, the default best_effort prefetch) serve two prompts whole: their
    outputs are what a decode without any cache gives. Then the whole pair restarts (a rollout): decode B on A's
    folder with the same flags, a fresh prefill, and beside them decode C, which has no L3."""
    folder = tmp_path_factory.mktemp("pd-l3")
    storage = ["--hicache-storage-backend", "file", "--hicache-storage-url", str(folder)]
    prefill, a = start_workers({"pd-prefill": ("prefill", ("--page-size", str(PS)), None),
                                "pd-decode-a": ("decode", (*HICACHE, *storage), None)}, logs).values()
    reference = {}
    try:
        for base in (11, 12):
            reference[base], cached = pd_tokens(prefill, a, prompt(base))
            assert sum(cached.values()) == 0
    finally:
        a.stop()  # graceful: queued L3 backups are stored before it exits
        prefill.stop()
    procs = list(start_workers({"pd-prefill-2": ("prefill", ("--page-size", str(PS)), None),
                                "pd-decode-b": ("decode", (*HICACHE, *storage), None),
                                "pd-decode-c": ("decode", tuple(HICACHE), None)}, logs).values())
    yield *procs, reference
    for proc in procs:
        proc.stop()


def pd_tokens(prefill: Proc, decode: Proc, ids: list[int], max_new_tokens: int = GREEDY["max_new_tokens"]):
    body = {"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens}}
    r = pd_generate(prefill, decode, body, next(PD_ROOMS))
    assert r.status_code == 200, r.text
    return r.json()["output_ids"], r.json()["meta_info"]["cached_tokens_details"]


PD_ROOMS = itertools.count(7000)


@pytest.mark.slow  # a PD pair started twice (~40 s); a restarted worker's storage hits stay in the default run above
def test_restarted_decode_gets_storage_hits_by_default(pd_restarted):
    """The handshake goes out while the request is queued, and prefill computes the prompt meanwhile: best_effort
    lets the prefetch land in that time, so the request reads only the delta from prefill."""
    prefill, b, _, reference = pd_restarted
    received = b.metric("decode_worker_kv_received_tokens_total")
    out, cached = pd_tokens(prefill, b, prompt(11))
    assert cached == {"device": 0, "host": 0, "storage": PROMPT_PAGES * PS}
    assert out == reference[11]
    assert b.metric("decode_worker_kv_received_tokens_total") - received == 200 - PROMPT_PAGES * PS  # the delta
    out, cached = pd_tokens(prefill, b, prompt(12))
    assert cached["storage"] == PROMPT_PAGES * PS and out == reference[12]
    wait_pages_free(b)


@pytest.mark.slow
def test_cold_prompt_ttft_with_l3_is_that_without(pd_restarted):
    """A prompt the store does not hold waits for nothing: its first token comes as fast as on a decode without L3
    (alternating, so both see the same machine; a generous margin for this shared machine's noise).
    Timed, so it runs with ``-m slow`` only: the default suite asserts behaviour, benchmarks measure time."""
    prefill, b, c, _ = pd_restarted
    hits = b.metric("decode_worker_cached_tokens_total", tier="storage")
    times: dict[str, list[float]] = {"l3": [], "off": []}
    bases = itertools.count(100)  # a new prompt each time: prefill computes each one whole too
    for i in range(6):
        for name, decode in ((("l3", b), ("off", c)) if i % 2 else (("off", c), ("l3", b))):
            t = time.monotonic()
            pd_tokens(prefill, decode, prompt(next(bases)), max_new_tokens=1)
            times[name].append(time.monotonic() - t)
    l3, off = (statistics.median(times[k]) for k in ("l3", "off"))
    assert l3 <= off * 1.3 + 0.05, times
    assert b.metric("decode_worker_cached_tokens_total", tier="storage") == hits  # nothing of them was in L3


# -- redis backend: two workers sharing one server, a slow link, the server stopped ----------------------------------


class SlowProxy:
    """TCP relay to a local port that sleeps ``delay_s`` before passing on each chunk the server sends back."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.port = free_port()
        self.delay_s = 0.0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._relay, "127.0.0.1", self.port), self.loop).result(10)

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(self._pipe(client_r, server_w, slow=False), self._pipe(server_r, client_w, slow=True),
                             return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slow: bool) -> None:
        try:
            while data := await reader.read(1 << 16):
                if slow and self.delay_s:
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def close(self) -> None:
        self.server.close()
        self.loop.call_soon_threadsafe(self.loop.stop)


SHARED_REDIS_IS_SLOW = pytest.mark.slow
"""Two more workers on one redis-server (~25 s to start): prefetch deadlines and a store that stops. Pods sharing
one redis are checked in tests/integration/test_scale_out.py (also -m slow); the redis store itself in
tests/integration/test_redis_store.py."""


@pytest.fixture(scope="module")
def shared_redis(logs, tmp_path_factory, smollm2_path):
    """A redis-server, worker R1 on it (best_effort prefetch), and worker R2 on it through a SlowProxy (timeout
    prefetch policy: 1.5 s)."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (`make system-deps` installs it: apt-get install redis-server)")
    server = RedisServer(REDIS_SERVER, free_port(), tmp_path_factory.mktemp("redis"))
    server.start()
    proxy = SlowProxy(server.port)
    redis = ["--hicache-storage-backend", "redis"]
    r2_deadline = ["--hicache-storage-prefetch-policy", "timeout",
                   "--hicache-storage-prefetch-timeout-base-s", "1.5",
                   "--hicache-storage-prefetch-timeout-per-1k-tokens-s", "0",
                   "--hicache-storage-prefetch-timeout-cap-s", "1.5"]
    workers = list(start_workers({
        "redis-1": ("colocated", (*HICACHE, *redis, "--hicache-storage-url", server.url), None),
        "redis-2": ("colocated", (*HICACHE, *redis, *r2_deadline, "--hicache-storage-url",
                                  f"redis://127.0.0.1:{proxy.port}"), None),
    }, logs).values())
    yield server, proxy, *workers
    for proc in workers:
        proc.stop()
    proxy.close()
    server.stop()


def backed_up(proc: Proc, ids: list[int]) -> list[int]:
    """Serve ``ids`` on ``proc`` and wait until its pages are in the store."""
    before = proc.metric("decode_worker_backup_tokens_total", tier="storage")
    out, cached = generate(proc, ids)
    assert sum(cached.values()) == 0
    wait_metric(proc, "decode_worker_backup_tokens_total", before + PROMPT_PAGES * PS, tier="storage")
    return out


@SHARED_REDIS_IS_SLOW
def test_two_workers_share_one_redis(shared_redis):
    _, _, r1, r2 = shared_redis
    reference = backed_up(r1, prompt(4))
    out, cached = generate(r2, prompt(4))
    assert cached == {"device": 0, "host": 0, "storage": PROMPT_PAGES * PS}
    assert out == reference
    assert_every_page_back(r2)


@SHARED_REDIS_IS_SLOW
def test_prefetch_slower_than_its_deadline(shared_redis):
    """Each 4-page get takes over a second through the proxy: 12 pages cannot arrive within R2's 1.5 s."""
    _, proxy, r1, r2 = shared_redis
    reference = backed_up(r1, prompt(5))
    proxy.delay_s = 0.025  # per 64 KiB chunk: a 4-page batch (2.9 MB) takes more than 1.1 s
    try:
        out, cached = generate(r2, prompt(5))
    finally:
        proxy.delay_s = 0.0
    assert cached["storage"] < PROMPT_PAGES * PS  # it went on with what had arrived (wait_complete: all 12)
    assert out == reference
    assert_every_page_back(r2)


@SHARED_REDIS_IS_SLOW
def test_redis_stopped_mid_run(shared_redis):
    server, _, r1, r2 = shared_redis
    server.stop()
    outputs = [generate(proc, prompt(6))[0] for proc in (r1, r2)]  # each still a 200, computed whole
    assert outputs[0] == outputs[1]
    generate(r1, prompt(4))
    assert r1.metric("decode_worker_storage_failures_total") > 0
    assert r2.metric("decode_worker_storage_failures_total") > 0
    assert_every_page_back(r1)
    assert_every_page_back(r2)
