"""`decode-worker bench`'s flags and the scales they default from."""
from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass

from decode_worker.model.embedded import cache_dir


@dataclass(frozen=True)
class Scale:
    prefix_len: int
    suffix_len: int
    output_len: int
    concurrency: int
    l1_tokens: int | None  # None: --l1-prefixes prefixes plus each running request's own suffix and output
    dtype: str
    chat: str
    chat_first_len: int
    chat_turn_len: int


CPU = Scale(prefix_len=64, suffix_len=16, output_len=4, concurrency=8, l1_tokens=None, dtype="bfloat16",
            chat="8x4", chat_first_len=64, chat_turn_len=16)
SHAPES = [(10, 50), (50, 10)]
# More groups than one pod's L1 holds prefixes, and 8 prompts per group: round robin over 4 pods sends each group
# to each pod twice, so half the repeats of a prefix meet a pod that never saw it.
SCALE_OUT_SHAPES = [(32, 8)]
# The reference's ratios at lengths 2 cores carry: prefix : suffix 16384 : 4608, concurrency 8, ten prefixes in L1.
LINKED = Scale(prefix_len=256, suffix_len=72, output_len=4, concurrency=8, l1_tokens=None, dtype="bfloat16",
               chat="none", chat_first_len=256, chat_turn_len=72)
REFERENCE = Scale(prefix_len=16384, suffix_len=4608, output_len=350, concurrency=8, l1_tokens=162_000,
                  dtype="bfloat16", chat="8x8", chat_first_len=4096, chat_turn_len=512)


LINK_MODES = ("off", "radix", "hier")  # what the TTFT savings compare


def _links(text: str) -> list:
    from decode_worker.bench.link import parse_links

    try:
        return parse_links(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_grid(text: str) -> tuple[int, int]:
    """`AxB` as two positive integers."""
    try:
        a, b = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected AxB such as 10x50, not {text!r}") from None
    if a < 1 or b < 1:
        raise argparse.ArgumentTypeError(f"both numbers of {text!r} must be at least 1")
    return a, b


def _chat(text: str) -> str:
    """`CLIENTSxROUNDS` or `none`."""
    if text != "none":
        parse_grid(text)
    return text


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.description = ("Replay shared-prefix and multi-turn chat workloads through a PD deployment per decode cache mode "
                     "(or one you started) and report latency, throughput, per-tier hit rates and KV bytes received.")
    w = p.add_argument_group("workload (unset: the CPU default, or the reference's with --reference)")
    w.add_argument("--reference", action="store_true",
                   help="the reference's shape: 16384 + 4608 tokens, 350 out, concurrency 8, 162K-token L1, bfloat16")
    w.add_argument("--shapes", type=parse_grid, nargs="+", metavar="GROUPSxPROMPTS",
                   help=f"shared-prefix shapes: groups x prompts per group (default {_shape_names(SHAPES)}; "
                        f"with --scale-out {_shape_names(SCALE_OUT_SHAPES)})")
    w.add_argument("--prefix-len", type=int, help=f"shared prefix tokens (CPU {CPU.prefix_len})")
    w.add_argument("--suffix-len", type=int, help=f"unique suffix tokens (CPU {CPU.suffix_len})")
    w.add_argument("--output-len", type=int, help=f"output tokens per request (CPU {CPU.output_len})")
    w.add_argument("--chat", type=_chat, help=f"multi-turn chat: CLIENTSxROUNDS, or none (CPU {CPU.chat})")
    w.add_argument("--chat-first-len", type=int,
                   help=f"tokens of a conversation's first message (CPU {CPU.chat_first_len})")
    w.add_argument("--chat-turn-len", type=int, help=f"tokens of each later question (CPU {CPU.chat_turn_len})")
    w.add_argument("--concurrency", type=int, help=f"most requests in flight (CPU {CPU.concurrency})")
    w.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second, capped by --concurrency; inf sends as fast as the cap allows")
    w.add_argument("--seed", type=int, default=0, help="seeds prefixes, suffixes, shuffle and arrivals")
    _deployment_args(p.add_argument_group("deployment (one per mode, on loopback)"))
    _other_args(p)


def _deployment_args(d: argparse._ArgumentGroup) -> None:
    from decode_worker.bench.modes import MODES

    d.add_argument("--modes", nargs="+", choices=list(MODES), help="decode cache modes, in order (default: all)")
    d.add_argument("--model-path", default=None, help="the workers' model; unset: the embedded SmolLM2")
    d.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help=f"weights and KV (CPU {CPU.dtype})")
    d.add_argument("--page-size", type=int, default=16)
    d.add_argument("--l1-prefixes", type=float, default=10.0,
                   help="decode L1 holds this many prefixes plus each running request's own suffix and output (the "
                        "reference: about ten prefixes in 162K tokens)")
    d.add_argument("--l1-tokens", type=int, help="decode L1 in tokens; overrides --l1-prefixes")
    d.add_argument("--prefill-l1-tokens", type=int,
                   help="prefill's KV capacity; unset: room for every prefix of the largest workload plus the running "
                        "requests (prefill keeps what it has seen, as a prefill with its own cache would), or with "
                        "--reference the decode worker's L1")
    d.add_argument("--link", type=_links, metavar="RATE[,RATE...]",
                   help="run every mode once per link: a rate such as 500mbit or 1gbit puts each deployment in a "
                        "private network namespace whose loopback is shaped to that rate, with KV over UCX TCP; "
                        "'local' is the same-host path. Unset: local only. With --link the modes default to "
                        f"{' '.join(LINK_MODES)} and chat to none")
    d.add_argument("--hicache-ratio", type=float, default=3.0, help="L2 size as a multiple of L1 (hier modes)")
    d.add_argument("--prefetch-policy", choices=["best_effort", "wait_complete", "timeout"], default="timeout",
                   help="L3 modes: how long a queued request waits for its L3 prefetch. best_effort admits a request "
                        "before its lookup answers whenever the queue is short, so L3 would serve almost nothing here")
    d.add_argument("--startup-timeout", type=float, default=300.0)
    d.add_argument("--log-dir", default=None, help="worker logs and the L3 folder (default: a temp folder)")
    d.add_argument("--api-key", default=os.environ.get("DECODE_WORKER_API_KEY", ""),
                   help="sent as 'Authorization: Bearer' (env DECODE_WORKER_API_KEY)")


def _other_args(p: argparse.ArgumentParser) -> None:
    from decode_worker.bench.scale_out import ROUTINGS

    g = p.add_argument_group("a deployment you started (no deployments are started; caches are not flushed)")
    g.add_argument("--url", help="router URL")
    g.add_argument("--decode-url", help="decode worker URL, for its /metrics (hit rates, KV bytes, TTFT parts)")
    g.add_argument("--prefill-url", help="prefill worker URL, for its /metrics (TTFT parts)")
    s = p.add_argument_group("scale-out (decode pods behind one router, instead of cache modes)")
    s.add_argument("--scale-out", action="store_true",
                   help="replay the shared-prefix trace through 1, 2, 4... decode pods per routing; the hit rate is "
                        "summed over the pods")
    s.add_argument("--decode-pods", type=int, nargs="+", default=[1, 2, 4], help="decode pod counts, in order")
    s.add_argument("--routings", nargs="+", choices=list(ROUTINGS), default=list(ROUTINGS),
                   help="round_robin and cache_aware: smg's decode policies over pod-local caches; "
                        "round_robin_l3 and cache_aware_l3: the same over pods that share one Redis as L3")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=str(cache_dir() / "bench"), help="folder for NAME.json, NAME.md and NAME.png")
    o.add_argument("--name", help="file name of the outputs (default bench, with --scale-out scale_out)")


def resolve_scale(args: argparse.Namespace) -> Scale:
    """Each unset flag from the chosen scale."""
    base = REFERENCE if args.reference else LINKED if args.link else CPU
    return Scale(**{k: getattr(args, k) if getattr(args, k) is not None else v for k, v in asdict(base).items()})


def _shape_names(shapes: list[tuple[int, int]]) -> str:
    return " ".join(f"{g}x{n}" for g, n in shapes)
