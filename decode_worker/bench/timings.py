"""Hit rates per tier, KV received and TTFT's parts from the workers' metrics (docs/ttft-model.md)."""
from __future__ import annotations

from dataclasses import dataclass

from decode_worker.bench.prom import Scrape

P = "decode_worker_"
TIERS = ("device", "host", "storage")

MISSING_TIMINGS = {
    "load-back": f"{P}load_back_seconds (histogram, L2 -> L1 per request): only {P}load_back_tokens_total is "
                 "exported, so the load-back hides inside decode_other",
    "prefill compute": f"{P}extend_seconds (histogram, prefill's forward per prompt): prefill_compute is its "
                       f"{P}ttft_seconds less its {P}queue_time_seconds, so it still holds the wait for an extend "
                       "step after admission",
    "handshake": f"{P}handshake_seconds (histogram, decode's handshake call until prefill answers): the wait for "
                 "prefill seen from decode, apart from the push that follows",
    "L3 prefetch": f"{P}prefetch_seconds (histogram, L3 lookup and prefetch wait per request)",
    "first decode step": f"{P}decode_step_seconds (histogram): in PD the first token is prefill's, so the first "
                         f"decode step is not in TTFT but in the first gap of {P}inter_token_latency_seconds, "
                         "which mixes it with every later one",
}


@dataclass(frozen=True)
class WorkerStats:
    hit_rate: dict[str, float] | None  # per tier and total, of the decode worker's prompt tokens
    prefill_hit_rate: float | None  # prefill's own radix cache: what it did not have to compute
    kv_received_bytes: float | None
    kv_received_tokens: float | None
    load_back_tokens: float | None
    ttft_parts_s: dict[str, float | None]
    decode_own_s: dict[str, float | None] | None = None  # per request: p50, p99 (and the mean) of decode_own_seconds

    @classmethod
    def of(cls, client_ttft_mean: float | None, decode: Scrape | None, prefill: Scrape | None) -> WorkerStats:
        """Each worker's scrapes after less before; None without its URL."""
        return cls(
            hit_rate=_hit_rates(decode) if decode else None,
            prefill_hit_rate=_ratio(prefill.get(P + "cached_tokens_total"), prefill.get(P + "prompt_tokens_total"))
            if prefill else None,
            kv_received_bytes=decode.get(P + "kv_received_bytes_total") if decode else None,
            kv_received_tokens=decode.get(P + "kv_received_tokens_total") if decode else None,
            load_back_tokens=decode.get(P + "load_back_tokens_total") if decode else None,
            ttft_parts_s=ttft_parts(client_ttft_mean, decode, prefill),
            decode_own_s=_decode_own(decode) if decode else None,
        )


def _decode_own(decode: Scrape) -> dict[str, float | None]:
    """Quantiles of decode's own share of PD TTFT (answer in to first token out, less the read)."""
    name = P + "decode_own_seconds"
    return {"p50": decode.quantile(name, 0.5), "p99": decode.quantile(name, 0.99), "mean": decode.mean(name)}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _hit_rates(decode: Scrape) -> dict[str, float] | None:
    prompt = decode.get(P + "prompt_tokens_total")
    if not prompt:
        return None
    rates = {tier: decode.get(P + "cached_tokens_total", tier=tier) / prompt for tier in TIERS}
    rates["total"] = sum(rates.values())
    return rates


def _minus(a: float | None, *parts: float | None) -> float | None:
    return None if a is None or any(p is None for p in parts) else a - sum(parts)  # type: ignore[arg-type]


def ttft_parts(client: float | None, decode: Scrape | None, prefill: Scrape | None) -> dict[str, float | None]:
    """Mean seconds per part, None without a worker's metrics; signed (docs/ttft-model.md)."""
    decode_ttft = decode.mean(P + "ttft_seconds") if decode else None
    transfer = decode.mean(P + "kv_transfer_seconds") if decode else None
    prefill_ttft = prefill.mean(P + "ttft_seconds") if prefill else None
    prefill_queue = prefill.mean(P + "queue_time_seconds") if prefill else None
    return {
        "client": client,
        "router_and_http": _minus(client, decode_ttft),
        "prefill_queue": prefill_queue,
        "prefill_compute": _minus(prefill_ttft, prefill_queue),
        "kv_transfer": transfer,
        "decode_other": _minus(decode_ttft, prefill_ttft, transfer),
        "decode_queue": decode.mean(P + "queue_time_seconds") if decode else None,
    }
