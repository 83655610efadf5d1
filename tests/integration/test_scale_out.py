"""Several decode pods behind one router: a prefix one pod computed reaches another through the shared L3 (Redis),
and pods of different models never read each other's pages.

The deployment is the product's own: `decode-worker up --decode-replicas 2` (router in round robin, one prefill,
two decode workers, a redis-server it starts). Round robin sends the second request to the other pod, so what
that pod finds cached can only have come through Redis. The reference output is a cache-free offline run.
"""
from __future__ import annotations

import shutil
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from decode_worker.launch import ROUTER_READY_PATH
from tests.integration.test_redis_store import REDIS_SERVER, RedisServer
from tests.servers import Proc, free_port, start, start_workers, wait_pages_free
from tests.tiny_model import save_tiny_chat_model

PS = 16
SHARED = ("You are a helpful assistant for a library. The library opens at nine in the morning and closes at six "
          "in the evening, every day but Sunday. Members may borrow up to five books for three weeks. ") * 2
QUESTIONS = ("Question: when does the library open?", "Question: how many books may a member borrow?")
GREEDY = {"max_new_tokens": 8, "temperature": 0}
# float32: the pods' outputs are compared token for token with a cache-free run, which a bf16 near-tie flips
STORAGE_POLICY = {"DECODE_WORKER_HICACHE_STORAGE_PREFETCH_POLICY": "timeout",  # see docs/scale-out.md
                  "DECODE_WORKER_DTYPE": "float32"}

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed (apt-get install "
                                                            "redis-server)")


def ports_in_a_row(n: int) -> int:
    """A port p with p .. p+n-1 all free (the decode replicas listen on --decode-port + i)."""
    for _ in range(50):
        base = free_port()
        try:
            socks = [socket.create_server(("127.0.0.1", base + i)) for i in range(n)]
        except OSError:
            continue
        for s in socks:
            s.close()
        return base
    raise RuntimeError(f"no {n} free ports in a row")


def generate(url: str, text: str) -> dict:
    r = httpx.post(url + "/generate", json={"text": text, "sampling_params": GREEDY}, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def served(pods: list[Proc], before: list[float]) -> int:
    """Index of the one pod whose prompt-token count moved since ``before``."""
    moved = [i for i, p in enumerate(pods) if p.metric("decode_worker_prompt_tokens_total") > before[i]]
    assert len(moved) == 1, f"pods that served the request: {moved}"
    return moved[0]


def command_lines() -> list[str]:
    """Every process's command line on this machine (those that end while read are left out)."""
    lines = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            lines.append(path.read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
    return lines


def wait_metric(proc: Proc, name: str, at_least: float, timeout_s: float = 60, **labels: str) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.metric(name, default=0.0, **labels) < at_least:
        assert time.monotonic() < deadline, f"{name}{labels} stayed below {at_least}:\n{proc.tail()}"
        time.sleep(0.2)


def assert_nothing_locked(pod: Proc) -> None:
    wait_pages_free(pod)
    for tier in ("device", "host"):
        assert pod.metric("decode_worker_cache_pages", tier=tier, state="locked") == 0, (pod.name, tier)


@pytest.fixture(scope="module")
def reference(smollm2_path) -> dict[str, list[int]]:
    """Greedy tokens of each prompt from an offline run that reuses no KV at all."""
    from decode_worker.core.sampling import SamplingParams
    from decode_worker.engine.llm import LLM

    llm = LLM(str(smollm2_path), max_total_tokens=2048, page_size=PS, prefix_cache=False,
              dtype=torch.float32)  # the pods' dtype
    params = SamplingParams(max_new_tokens=GREEDY["max_new_tokens"], temperature=0.0)
    texts = [SHARED + q for q in QUESTIONS]
    return {t: out.output_ids for t, out in zip(texts, llm.generate(texts, params))}


@pytest.fixture(scope="module")
def two_decode_pods(tmp_path_factory, smollm2_path):
    """`decode-worker up --decode-replicas 2` in round robin; yields (router, [decode-0, decode-1])."""
    logs = tmp_path_factory.mktemp("scale-out")
    router, prefill, decode = free_port(), free_port(), ports_in_a_row(2)
    cmd = [sys.executable, "-m", "decode_worker.cli", "up", "--decode-replicas", "2", "--decode-policy", "round_robin",
           "--port", str(router), "--prefill-port", str(prefill), "--decode-port", str(decode),
           "--max-total-tokens", "2048", "--page-size", str(PS), "--log-dir", str(logs / "up")]
    up = start("up", cmd, f"http://127.0.0.1:{router}", logs, env=STORAGE_POLICY, health=ROUTER_READY_PATH,
               timeout_s=300)
    pods = [Proc(f"decode-{i}", up.popen, f"http://127.0.0.1:{decode + i}", logs / "up" / f"decode-{i}.log")
            for i in range(2)]
    yield up, pods
    up.stop()


@pytest.mark.slow  # two decode pods on one redis (~30 s to start)
def test_every_decode_pod_points_at_the_one_redis(two_decode_pods):
    _, pods = two_decode_pods
    infos = [httpx.get(p.url + "/server_info", timeout=10).json() for p in pods]
    assert {i["hicache_storage_backend"] for i in infos} == {"redis"}
    (url,) = {i["hicache_storage_url"] for i in infos}
    assert url.startswith("redis://127.0.0.1:")
    # the URL reaches the workers through their environment: a password in it would show in `ps` otherwise
    lines = command_lines()
    assert sum("--role decode" in line for line in lines) >= 2
    assert not [line for line in lines if url in line]


@pytest.mark.slow  # two decode pods on one redis (~30 s to start)
def test_prefix_from_one_pod_reaches_the_other_through_redis(two_decode_pods, reference):
    up, pods = two_decode_pods
    text_a, text_b = (SHARED + q for q in QUESTIONS)

    before = [p.metric("decode_worker_prompt_tokens_total") for p in pods]
    first = generate(up.url, text_a)
    a = served(pods, before)
    assert sum(first["meta_info"]["cached_tokens_details"].values()) == 0  # a cold pod and an empty store
    assert first["output_ids"] == reference[text_a]
    shared_tokens = first["meta_info"]["prompt_tokens"] - 16  # a question is well under 16 tokens
    wait_metric(pods[a], "decode_worker_backup_tokens_total", shared_tokens // PS * PS - PS, tier="storage")

    before = [p.metric("decode_worker_prompt_tokens_total") for p in pods]
    second = generate(up.url, text_b)
    b = served(pods, before)
    assert b != a, "round robin sent both requests to one pod"
    cached = second["meta_info"]["cached_tokens_details"]
    assert cached["device"] == cached["host"] == 0  # pod B never saw this prefix itself
    assert cached["storage"] >= shared_tokens // PS * PS - PS, cached
    assert pods[b].metric("decode_worker_cached_tokens_total", tier="storage") == cached["storage"]
    assert second["output_ids"] == reference[text_b]
    for pod in pods:
        assert_nothing_locked(pod)


# -- the L3 key names the model: same shapes, different weights, one Redis ----------------------------------------


def perturbed_copy(src: Path, dest: Path) -> Path:
    """The same checkpoint, folder name and config with every weight nudged: only the values differ."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    (weights,) = dest.glob("*.safetensors")
    gen = torch.Generator().manual_seed(1)
    tensors = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="module")
def two_models_one_redis(tmp_path_factory):
    """Colocated workers of two same-shaped models (both folders named `tiny`) on one redis-server."""
    root = tmp_path_factory.mktemp("two-models")
    first = save_tiny_chat_model(root / "a" / "tiny")
    second = perturbed_copy(first, root / "b" / "tiny")
    server = RedisServer(REDIS_SERVER, free_port(), root)
    server.start()
    flags = ["--page-size", str(PS), "--max-total-tokens", "1024", "--disaggregation-decode-enable-radix-cache",
             "--disaggregation-decode-enable-hicache", "--hicache-storage-backend", "redis",
             "--hicache-storage-url", server.url, "--hicache-storage-prefetch-policy", "wait_complete"]
    workers = list(start_workers({name: ("colocated", ("--model-path", str(path), *flags), None)
                                  for name, path in (("model-a", first), ("model-b", second))}, root).values())
    yield workers
    for w in workers:
        w.stop()
    server.stop()


def ids_generate(proc: Proc, ids: list[int]) -> dict:
    r = httpx.post(proc.url + "/generate", json={"input_ids": ids, "sampling_params": GREEDY}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["cached_tokens_details"]


def test_pods_of_different_models_never_share_pages(two_models_one_redis):
    a, b = two_models_one_redis
    fingerprints = [httpx.get(w.url + "/server_info", timeout=10).json()["kv_layout_fingerprint"] for w in (a, b)]
    assert fingerprints[0] != fingerprints[1]
    ids = [(7 * i + 3) % 250 for i in range(12 * PS + 1)]  # 12 whole pages before the last token
    assert sum(ids_generate(a, ids).values()) == 0
    wait_metric(a, "decode_worker_backup_tokens_total", 12 * PS, tier="storage")

    assert ids_generate(b, ids) == {"device": 0, "host": 0, "storage": 0}  # model A's pages are not model B's
    assert b.metric("decode_worker_prefetch_tokens_total") == 0
    assert b.metric("decode_worker_storage_failures_total", default=0.0, reason="foreign") == 0  # never even found

    # Each model does read its own pages back from the store, so the zero above is the key at work.
    wait_metric(b, "decode_worker_backup_tokens_total", 12 * PS, tier="storage")
    for w in (a, b):
        assert httpx.post(w.url + "/flush_cache", timeout=30).status_code == 200
        assert ids_generate(w, ids) == {"device": 0, "host": 0, "storage": 12 * PS}


# -- the benchmark's scale-out mode, on the tiny model -------------------------------------------------------------


@pytest.mark.slow  # about a minute: two fleets of workers and eight routers
def test_bench_scale_out_reports_every_pod_count_and_routing(tmp_path):
    import json
    import subprocess

    from decode_worker.bench.scale_out import ROUTINGS

    model = save_tiny_chat_model(tmp_path / "model")
    cmd = [sys.executable, "-m", "decode_worker.cli", "bench", "--scale-out", "--model-path", str(model),
           "--dtype", "float32", "--shapes", "2x4", "--decode-pods", "1", "2", "--prefix-len", "32",
           "--suffix-len", "16", "--output-len", "3", "--concurrency", "1", "--out", str(tmp_path / "out"),
           "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["pods"], r["mode"]): r for r in json.loads(proc.stdout)["rows"]}
    assert set(rows) == {(p, m) for p in (1, 2) for m in ROUTINGS}
    for (pods, mode), row in rows.items():
        assert row["client"]["failed"] == 0 and sum(row["requests_per_pod"]) == 8, row["errors"]
        assert len(row["requests_per_pod"]) == pods
        if not ROUTINGS[mode].shared_l3:
            assert row["workers"]["hit_rate"]["storage"] == 0, (pods, mode)
    assert rows[2, "round_robin_l3"]["workers"]["hit_rate"]["storage"] > 0
    assert rows[2, "round_robin"]["requests_per_pod"] == [4, 4]
    hit = {k: r["workers"]["hit_rate"]["total"] for k, r in rows.items()}
    assert hit[2, "round_robin"] < hit[1, "round_robin"]  # each pod misses each prefix once
    assert hit[2, "round_robin_l3"] > hit[2, "round_robin"]  # the other pod's misses come from Redis
    assert "| 2x4 | 2 | round_robin_l3 |" in (tmp_path / "out" / "scale_out.md").read_text()
    assert (tmp_path / "out" / "scale_out.png").read_bytes()[:4] == b"\x89PNG"
