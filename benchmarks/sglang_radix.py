"""SGLang's own ``RadixCache`` and paged allocator, loaded for ``bench_cache.py`` from the PyPI wheel's source.

A benchmark-only yardstick, never a runtime dependency: the wheel is fetched once with ``pip download --no-deps``
into ``benchmarks/.cache/sglang/`` (git-ignored), and only the handful of pure-Python modules the cache path runs are
executed from it (``radix_cache``, ``base_prefix_cache``, ``evict_policy``, ``cache_init_params``, the allocator's
``base`` and ``paged``). Their other imports (Triton kernels, metrics, KV events, server args) are replaced by
inert stubs: the benchmark runs with metrics and KV events off, and uses only ``alloc``/``free_segments``, so no
stubbed name is on the timed path.
"""
from __future__ import annotations

import subprocess
import sys
import types
import zipfile
from array import array
from pathlib import Path

import torch

SGLANG_VERSION = "0.5.18"
CACHE_DIR = Path(__file__).resolve().parent / ".cache" / "sglang"
REAL = ("cache_init_params", "evict_policy", "allocator.base", "allocator.paged", "base_prefix_cache", "radix_cache")


def wheel(version: str = SGLANG_VERSION) -> Path:
    """The sglang wheel in the bench cache, downloaded (without dependencies) on first use."""
    found = sorted(CACHE_DIR.glob(f"sglang-{version}-*.whl"))
    if not found:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"sglang=={version}",
                        "-d", str(CACHE_DIR)], check=True, timeout=600)
        found = sorted(CACHE_DIR.glob(f"sglang-{version}-*.whl"))
    return found[0]


def _module(name: str, **attrs) -> types.ModuleType:
    mod = sys.modules.get(name) or types.ModuleType(name)
    mod.__path__ = []  # a package as far as the import system cares: submodules come from sys.modules only
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def _split_hashes(hashes, split_len: int, page_size: int):
    if hashes is None:
        return None, None
    cut = split_len // page_size
    return hashes[:cut], hashes[cut:]


class _NoEvents:
    """Stands in for ``KVCacheEventMixin``: the benchmark runs with ``enable_kv_cache_events`` off, where every
    ``_record_*`` of the real mixin returns at once."""

    def _record_store_event(self, node, medium=None):
        pass

    def _record_remove_event(self, node, medium=None):
        pass

    def _record_all_cleared_event(self):
        pass


def _stubs() -> None:
    mc = "sglang.srt.mem_cache"
    for pkg in ("sglang", "sglang.srt", mc, f"{mc}.allocator", "sglang.srt.observability", "sglang.kernels",
                "sglang.kernels.ops", "sglang.kernels.ops.memory"):
        _module(pkg)
    _module("sglang.kernels.ops.memory.allocator", alloc_decode_kernel=None, alloc_extend_kernel=None)
    _module("sglang.srt.utils", get_bool_env_var=lambda name, default="false": False, is_hip=lambda: False,
            next_power_of_2=lambda n: 1 << max(n - 1, 0).bit_length(), get_num_new_pages=None)
    _module(f"{mc}.memory_pool", ReqToTokenPool=object)
    _module("sglang.srt.observability.metrics_collector", STAT_LOGGER_ROLE_RADIX_CACHE="radix_cache",
            RadixCacheMetricsCollector=object, resolve_collector_class=None)
    _module("sglang.srt.runtime_context", get_observability=None, get_server_args=None)
    _module(f"{mc}.events", KVCacheEventMixin=_NoEvents)


def load(version: str = SGLANG_VERSION) -> types.ModuleType:
    """``sglang.srt.mem_cache.radix_cache`` as shipped, with ``PagedTokenToKVPoolAllocator`` attached."""
    if "sglang.srt.mem_cache.radix_cache" in sys.modules:
        return sys.modules["sglang.srt.mem_cache.radix_cache"]
    _stubs()
    mc = "sglang.srt.mem_cache"
    with zipfile.ZipFile(wheel(version)) as whl:
        for name in REAL:
            path = "sglang/srt/mem_cache/" + name.replace(".", "/") + ".py"
            mod = _module(f"{mc}.{name}")
            del mod.__path__
            exec(compile(whl.read(path).decode(), f"{whl.filename}/{path}", "exec"), mod.__dict__)
            if name == "allocator.base":
                sys.modules[f"{mc}.allocator"].BaseTokenToKVPoolAllocator = mod.BaseTokenToKVPoolAllocator
            if name == "evict_policy":
                strategies = {"lru": mod.LRUStrategy, "lfu": mod.LFUStrategy, "slru": mod.SLRUStrategy}
                _module(f"{mc}.utils", get_eviction_strategy=lambda policy: strategies[policy.lower()](),
                        get_hash_str=None, split_node_hash_value=_split_hashes)
    radix = sys.modules[f"{mc}.radix_cache"]
    radix.PagedTokenToKVPoolAllocator = sys.modules[f"{mc}.allocator.paged"].PagedTokenToKVPoolAllocator
    radix.CacheInitParams = sys.modules[f"{mc}.cache_init_params"].CacheInitParams
    return radix


class SGLangRequestPath:
    """One request through SGLang's cache as its scheduler drives it (``match_prefix`` and ``inc_lock_ref`` at
    admission, ``evict`` when the allocator is short, ``alloc`` for the new tokens, and ``cache_finished_req``'s
    ``insert``, ``free_segments`` and ``dec_lock_ref`` at the end), default LRU, on a ``tokens``-sized pool."""

    def __init__(self, page_size: int, tokens: int, eviction: str = "lru"):
        self.radix = radix = load()
        self.page_size = page_size
        self.alloc = radix.PagedTokenToKVPoolAllocator(tokens // page_size * page_size, page_size, torch.int64,
                                                       "cpu", None, False)
        self.cache = radix.RadixCache(radix.CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.alloc, page_size=page_size,
            eviction_policy=eviction))

    @staticmethod
    def pack(tokens: list[int]) -> array:
        """What its tokenizer manager hands the scheduler (``Req.origin_input_ids``)."""
        return array("q", tokens)

    def request(self, token_ids: array) -> int:
        """Serve one prompt; returns its cached tokens."""
        r, cache, alloc, ps = self.radix, self.cache, self.alloc, self.page_size
        n = len(token_ids)
        key = r.RadixKey(token_ids)
        match = cache.match_prefix(r.MatchPrefixParams(key=key))
        prefix, node = match.device_indices, match.last_device_node
        cache.inc_lock_ref(node)
        need = -(-n // ps) * ps - len(prefix)
        if alloc.available_size() < need:
            cache.evict(r.EvictParams(num_tokens=need - alloc.available_size()))
        kv = torch.cat([prefix, alloc.alloc(need)])[:n]
        aligned = r.RadixKey((token_ids + array("q"))[:n]).page_aligned(ps)  # origin_input_ids + output_ids
        done = cache.insert(r.InsertParams(key=aligned, value=kv[: len(aligned)].clone()))
        alloc.free_segments([(kv[len(prefix) : done.prefix_len], len(prefix)), (kv[len(aligned) :], len(aligned))])
        cache.dec_lock_ref(node)
        return len(prefix)
