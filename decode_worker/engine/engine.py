"""The serving engine behind the HTTP layer's few calls."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import torch

from decode_worker.cache.hicache import HierarchicalCache
from decode_worker.cache.prefix_cache import NoPrefixReuse
from decode_worker.cache.sizing import device_pool_tokens, host_device_pool_tokens, host_pool_pages, make_host_pool
from decode_worker.config import ServerConfig, mask_url, package_version
from decode_worker.core.policies import StorageBackup, WritePolicy
from decode_worker.core.request import GenerateInput, RequestError, RequestStream
from decode_worker.core.sampling import SamplingParams
from decode_worker.core.tasks import SharedRun
from decode_worker.core.threads import started_pool
from decode_worker.engine.startup_gc import freeze_startup_objects
from decode_worker.engine.summary import startup_summary
from decode_worker.engine.wiring import ModelFacts, open_kv_events, open_pd, open_storage
from decode_worker.metrics import Metrics, cache_families
from decode_worker.model.embedded import ensure_default_model
from decode_worker.model.loader import load_model
from decode_worker.model.runner import ModelRunner
from decode_worker.scheduler.grammar import CompiledGrammar, GrammarCompiler, GrammarLimits
from decode_worker.scheduler.roles import COLOCATED
from decode_worker.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


DEFAULT_EXECUTOR_THREADS = min(32, (os.cpu_count() or 1) + 4)  # asyncio's own default size
SECRETS = ("api_key", "pd_token")  # config fields server_info never shows
HEALTH_REUSE_S = 1.0  # a /health_generate outcome answers the callers that come this long after it


class Engine:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.metrics = Metrics()
        self.started_at = int(time.time())
        self.model_path = config.model_path or ""
        self.ready = False
        self.not_ready_reason = "loading the model"
        self._health = SharedRun(HEALTH_REUSE_S)
        self.runner: ModelRunner | None = None
        self.cache: HierarchicalCache | None = None
        self.scheduler: Scheduler | None = None
        self.tokenizer = None
        self.fetcher = None  # decode role: DeltaKVFetcher, or SGLangPrefillSource with --pd-peer-protocol sglang
        self.handoff = None  # prefill role: KVHandoff
        self._expiry: asyncio.Task | None = None
        self.kv_events = None  # ZmqEventPublisher under --kv-events-config
        self.grammars: GrammarCompiler | None = None  # constrained decoding's compiler and cache

    # ---- start-up ---------------------------------------------------------------------------------------------

    def load_model(self) -> None:
        """Blocking start-up: run it off the loop."""
        cfg = self.config
        path = Path(cfg.model_path) if cfg.model_path else ensure_default_model()
        self.model_path = str(path)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        # --dtype auto's float32 (a CPU without native bf16) keeps the GGUF's low-bit weights; explicit float32 is exact
        loaded = load_model(path, dtype=getattr(torch, cfg.dtype), device=device,
                            low_bit_float32=cfg.dtype_reason is not None)
        self.tokenizer = loaded.tokenizer
        tokens = cfg.max_total_tokens
        if device == "cuda" and "max_total_tokens" not in cfg.model_fields_set:  # SGLang's --mem-fraction-static
            tokens = device_pool_tokens(loaded.config, cfg.page_size, getattr(torch, cfg.dtype),
                                        cfg.mem_fraction_static)
        elif "max_total_tokens" not in cfg.model_fields_set:  # from the model's context and the host's memory
            tokens = host_device_pool_tokens(loaded.config, cfg.page_size, getattr(torch, cfg.dtype))
        self.runner = ModelRunner(loaded, tokens, cfg.page_size, min(cfg.cuda_graph_max_bs, cfg.max_running_requests),
                                  shared_pool=cfg.role == "prefill")  # its decode peers on this host map it
        host_pool = None
        if cfg.disaggregation_decode_enable_hicache:
            pages = host_pool_pages(self.runner.layout, self.runner.num_pages - 1,
                                    ratio=cfg.disaggregation_decode_hicache_ratio,
                                    size_gb=cfg.disaggregation_decode_hicache_size or None,
                                    cuda_available=self.runner.pool.device.type == "cuda")  # staging only then
            host_pool = make_host_pool(self.runner.layout, pages, self.runner.pool)
        # L3 backs up what reaches L2; under write_through_selective only pages hit twice, as L2 itself does.
        write_policy = cfg.disaggregation_decode_hicache_write_policy
        self.cache = HierarchicalCache(
            self.runner.pool, host_pool, write_policy=write_policy, eviction=cfg.radix_eviction_policy,
            storage=open_storage(cfg, self.runner.layout),
            storage_backup_policy=(StorageBackup.HIT_TWICE if write_policy == WritePolicy.WRITE_THROUGH_SELECTIVE
                                   else StorageBackup.ALL),
        )
        self.kv_events = open_kv_events(cfg, self.cache, self.metrics)
        log.info(startup_summary(cfg, self.runner, self.model_path, host_pool.num_pages if host_pool else 0))

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(started_pool(DEFAULT_EXECUTOR_THREADS, "asyncio"))  # to_thread's (storage I/O)
        await loop.run_in_executor(None, self.load_model)
        cfg = self.config
        tok = self.tokenizer
        self.grammars = GrammarCompiler(tok, self.runner.config.vocab_size, GrammarLimits(
            cfg.grammar_max_bytes, cfg.grammar_max_nesting, cfg.grammar_step_budget_ms / 1000))
        model = ModelFacts(self.model_name, self.runner.config.vocab_size, self.runner.config.hidden_size,
                           self.cache.free_device)
        self.fetcher, self.handoff = open_pd(cfg, self.runner.pool, self.metrics, model)
        self.scheduler = Scheduler(
            self.runner, self.cache if cfg.radix_cache else NoPrefixReuse(self.cache), self.metrics,
            eos_token_ids=tok.eos_token_ids, decode_text=tok.decode,
            max_running=cfg.max_running_requests, max_prefill_tokens=cfg.max_prefill_tokens,
            load_back_timeout_s=cfg.load_back_timeout_s,
            source=self.fetcher if self.fetcher is not None else COLOCATED,
            done=self.handoff if self.handoff is not None else COLOCATED,
        )
        if self.handoff is not None:
            self._expiry = asyncio.get_running_loop().create_task(self._expire_leases())
        self.metrics.watch(lambda: cache_families(self.cache.stats()), self.scheduler.queue_stats)
        self.metrics.model_name = self.model_name
        self.scheduler.start()
        freeze_startup_objects()
        self.ready, self.not_ready_reason = True, ""

    async def _expire_leases(self) -> None:
        """Free expired prefill leases each second; a failing pass never ends the task."""
        while True:
            await asyncio.sleep(1.0)
            try:
                self.handoff.expire()
            except Exception:
                log.exception("freeing expired KV leases failed; trying again in 1 s")

    async def handshake(self, body) -> dict | None:
        self.require_ready()
        return await self.handoff.handshake(body)

    async def shutdown(self) -> None:
        self.ready, self.not_ready_reason = False, "shutting down"
        if self.scheduler is not None:
            await self.scheduler.stop()
        if self._expiry is not None:
            self._expiry.cancel()
        if self.handoff is not None:
            await self.handoff.close()
        if self.fetcher is not None:
            await self.fetcher.close()
        if self.cache is not None:
            self.cache.drain()  # finished L1->L2 copies queue their L3 backups
            if self.cache.storage is not None:
                await self.cache.storage.close()  # stores queued backups, within its own deadline
            self.cache.close()
        if self.kv_events is not None:
            self.kv_events.close()  # after the cache: its last changes are sent too
        if self.grammars is not None:
            self.grammars.close()

    # ---- requests ---------------------------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or Path(self.model_path).stem or "model"

    @property
    def model_config(self):
        return self.runner.config

    def require_ready(self) -> Scheduler:
        if not self.ready or self.scheduler is None:
            raise RequestError(f"not ready: {self.not_ready_reason}", 503, "unavailable")
        return self.scheduler

    def check_request(self, inp: GenerateInput) -> None:
        scheduler = self.require_ready()
        if self.config.role == "decode" and inp.bootstrap is None:
            raise RequestError("this is a decode worker: requests need bootstrap_host, bootstrap_port and "
                               "bootstrap_room (send them through a PD router)")
        scheduler.check_fits(inp)

    async def compile_grammar(self, inp: GenerateInput) -> CompiledGrammar | None:
        """``inp``'s grammar compiled off the loop, or None; RequestError naming the field."""
        if inp.params.grammar is None:
            return None
        self.require_ready()
        return await self.grammars.compile(inp.params)

    async def submit(self, inp: GenerateInput) -> RequestStream:
        """Expects ``check_request`` run and the grammar compiled by the route."""
        grammar = await self.compile_grammar(inp)
        return self.require_ready().submit(inp, grammar)

    def abort(self, rid: str) -> None:
        if self.scheduler is not None:
            self.scheduler.abort(rid)

    def live_requests(self) -> list[str]:
        return list(self.scheduler.requests) if self.scheduler is not None else []

    async def health_generate(self) -> None:
        """One token through the scheduler; one probe at a time, its answer shared for ``HEALTH_REUSE_S``."""
        self.require_ready()
        await self._health(self._probe)

    async def _probe(self) -> None:
        scheduler = self.require_ready()
        if self.config.role == "decode":
            if not scheduler.loop_running:
                raise RequestError("scheduler loop is not running", 503, "unavailable")
            return
        stream = scheduler.submit(GenerateInput(f"health-{time.monotonic_ns()}", [self.tokenizer.encode("hi")[0]],
                                                SamplingParams(max_new_tokens=1, temperature=0)))
        try:
            async with asyncio.timeout(30):
                async for event in stream:
                    if event.error is not None:
                        raise event.error
        except TimeoutError:
            raise RequestError("no token within 30 s", 503, "unavailable") from None
        finally:
            scheduler.abort(stream.rid)  # a no-op once it finished

    def server_info(self) -> dict:
        cfg = self.config
        info = {k: v for k, v in vars(cfg).items() if k not in SECRETS}
        if cfg.hicache_storage_url:  # a redis://user:password@host URL must not leak through the API
            info["hicache_storage_url"] = mask_url(cfg.hicache_storage_url)
        info.update(served_model_name=self.model_name, model_path=self.model_path, version=package_version(), ready=self.ready)
        if self.runner is not None:
            info.update(kv_layout=self.runner.layout.describe(), kv_layout_fingerprint=self.runner.layout.fingerprint(),
                        max_context=self.runner.config.max_context,
                        max_total_num_tokens=(self.runner.num_pages - 1) * cfg.page_size)
        if self.cache is not None:
            info["cache"] = self.cache.stats().to_dict()
        return info

    def get_load(self) -> dict:
        """What a router balances on."""
        if self.scheduler is None:
            return {"num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
        q = self.scheduler.queue_stats()
        dev = self.cache.stats().device
        return {"num_reqs": len(self.scheduler.requests), "num_running_reqs": q["running"],
                "num_waiting_reqs": sum(q["queues"].values()),
                "num_tokens": (dev.total - dev.free) * self.config.page_size,
                "max_total_tokens": (self.runner.num_pages - 1) * self.config.page_size}
