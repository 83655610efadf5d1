"""Prometheus metrics: requests counted as they happen, cache and queue read from their owners at scrape time."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from decode_worker.cache.stats import CacheStats

PREFIX = "decode_worker_"
TIERS = ("device", "host", "storage")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TRANSFER_BUCKETS = (0.001, 0.0025, *_LATENCY_BUCKETS)  # a 16 MB delta lands in ~3 ms over shared memory
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600)
_OWN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                1, 2.5, 5)  # fine below 100 ms: the bench reads p50 and p99 from them


def cache_families(stats: CacheStats) -> dict:
    storage, tokens = stats.storage, stats.tokens
    backed_up = {"host": tokens.backed_up}
    if storage is not None:
        backed_up["storage"] = storage.backed_up_tokens
    return {
        "pages": {tier: pages.by_state() for tier, pages in stats.tiers().items()},
        "evicted_tokens": {"device": tokens.evicted_device, "host": tokens.evicted_host},
        "backup_tokens": backed_up,
        "load_back_tokens": tokens.loaded_back,
        "prefetch_tokens": storage.prefetched_tokens if storage is not None else 0,
        "storage_failures": storage.failures if storage is not None else {},
    }


class _LiveCollector:
    """Reads the cache's and scheduler's snapshots at scrape time."""

    def __init__(self, cache_stats: Callable[[], dict], queue_stats: Callable[[], dict]):
        self.cache_stats = cache_stats
        self.queue_stats = queue_stats

    def collect(self):
        stats = self.cache_stats()
        pages = GaugeMetricFamily(PREFIX + "cache_pages", "KV pages per tier and state", labels=["tier", "state"])
        for tier, states in stats.get("pages", {}).items():
            for state, n in states.items():
                pages.add_metric([tier, state], n)
        yield pages
        for name, doc in (("evicted_tokens", "Tokens evicted per tier"), ("backup_tokens", "Tokens backed up into a tier")):
            fam = CounterMetricFamily(PREFIX + name, doc, labels=["tier"])
            for tier, n in stats.get(name, {}).items():
                fam.add_metric([tier], n)
            yield fam
        yield CounterMetricFamily(PREFIX + "load_back_tokens", "Tokens copied L2 -> L1", value=stats.get("load_back_tokens", 0))
        yield CounterMetricFamily(PREFIX + "prefetch_tokens", "Tokens prefetched L3 -> L2", value=stats.get("prefetch_tokens", 0))
        fam = CounterMetricFamily(PREFIX + "storage_failures", "L3 store calls and pages that failed, served as misses", labels=["op", "reason"])
        for op, reasons in stats.get("storage_failures", {}).items():
            for reason, n in reasons.items():
                fam.add_metric([op, reason], n)
        yield fam
        queues = self.queue_stats()
        fam = GaugeMetricFamily(PREFIX + "queue_requests", "Requests waiting per queue", labels=["queue"])
        for queue, n in queues.get("queues", {}).items():
            fam.add_metric([queue], n)
        yield fam
        yield GaugeMetricFamily(PREFIX + "running_requests", "Requests in the decode batch", value=queues.get("running", 0))


class Metrics:
    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name  # set once the model is known; labels every series
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.cached_tokens = Counter(PREFIX + "cached_tokens", "Prompt tokens served from cache", ["tier"], registry=r)
        self.kv_received_tokens = Counter(PREFIX + "kv_received_tokens", "Prompt tokens whose KV came from prefill", registry=r)
        self.kv_received_bytes = Counter(PREFIX + "kv_received_bytes", "KV bytes received from prefill", registry=r)
        self.requests = Counter(PREFIX + "requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.transfer_failures = Counter(PREFIX + "transfer_failures", "Failed KV transfers by reason", ["reason"], registry=r)
        self.step_failures = Counter(PREFIX + "step_failures", "Batch forwards that raised, by kind (each is re-run in "
                                     "halves: only the requests that make it raise fail)", ["kind"], registry=r)
        self.fenced_pages = Gauge(PREFIX + "pd_fenced_pages", "PD with SGLang prefills: L1 pages kept out of use after "
                                  "a failed or aborted room, since a write may still land there", registry=r)
        self.retractions = Counter(PREFIX + "retractions", "Running requests retracted when L1 ran out", registry=r)
        self.kv_events_dropped = Counter(PREFIX + "kv_events_dropped", "KV events lost to a full publisher queue "
                                         "(subscribers then see a sequence gap and an AllBlocksCleared)", registry=r)
        self.ttft = Histogram(PREFIX + "ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_transfer = Histogram(PREFIX + "kv_transfer_seconds", "PD: prefill accepted the handshake until the delta KV "
                                     "is in the request's pages (prefill's compute is not in it)",
                                     buckets=_TRANSFER_BUCKETS, registry=r)
        self.output_tokens = Counter(PREFIX + "output_tokens", "Tokens generated (prefill's first token included)",
                                     registry=r)
        self.inter_token = Histogram(PREFIX + "inter_token_latency_seconds", "Time between a request's consecutive "
                                     "output tokens (TPOT)", buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e_latency = Histogram(PREFIX + "e2e_request_latency_seconds", "Submission to last token of a request "
                                     "that finished", buckets=_REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram(PREFIX + "queue_time_seconds", "Submission to admission (L1 pages and a batch "
                                    "slot granted), first admission only", buckets=_REQUEST_BUCKETS, registry=r)
        self.forward_seconds = Histogram(PREFIX + "forward_seconds", "One batch's forward and sampling, by kind (extend: "
                                         "prompt tokens, decode: one token per request)", ["kind"],
                                         buckets=_TOKEN_BUCKETS, registry=r)
        self.load_back_seconds = Histogram(PREFIX + "load_back_seconds", "Admission until a restored prefix is back "
                                           "on L1 (L2 -> L1), for requests computed here", buckets=_LATENCY_BUCKETS,
                                           registry=r)
        self.kv_handshake_seconds = Histogram(PREFIX + "kv_handshake_seconds", "PD decode: the handshake call until "
                                              "prefill accepts, which waits for prefill to hold the prompt's KV "
                                              "(its queue and compute)", buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_own = Histogram(PREFIX + "decode_own_seconds", "PD decode: its own share of a request's TTFT, "
                                    "from prefill's answer arriving to the first token leaving (the answer's checks, "
                                    "admission, the wait for the running step, bookkeeping); the KV read itself "
                                    "(kv_transfer_seconds) is not in it", buckets=_OWN_BUCKETS, registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Requests that finished, by finish reason "
                                       "(stop, length)", ["finish_reason"], registry=r)
        for tier in TIERS:
            self.cached_tokens.labels(tier)  # export zeros so hit-rate queries have every series from the start

    def watch(self, cache_stats: Callable[[], dict], queue_stats: Callable[[], dict]) -> None:
        self.registry.register(_LiveCollector(cache_stats, queue_stats))

    def collect(self):
        """Every family, each series labelled ``model_name`` as vLLM and SGLang do."""
        for family in self.registry.collect():
            family.samples = [s._replace(labels={"model_name": self.model_name, **s.labels}) for s in family.samples]
            yield family

    def render(self) -> bytes:
        return generate_latest(self)  # through ``collect``: every series labelled
