"""`decode-worker bench`: flags, the CPU default and the reference's shape, and the run's outputs.

The CPU default scales the reference (SGLang decode HiCache, Qwen3-32B on H200s: 16,384-token prefixes, 4,608-token
suffixes, 350 output tokens, concurrency 8, ~162K tokens of device KV) down to SmolLM2 on a couple of cores, so
that both shapes, the chat workload and every mode finish in about a quarter of an hour. `--reference` runs the
reference's own shape (on a GPU, with a long-context model given by --model-path). `--scale-out` compares decode
pod counts and routings instead of cache modes (bench/scale_out.py).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from decode_worker.config import ConfigError

if TYPE_CHECKING:  # the heavier modules load when the command runs, not whenever the CLI parses flags
    from decode_worker.bench.deploy import DeploySpec
    from decode_worker.bench.runner import Plan
    from decode_worker.bench.scale_out import ScalePlan


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
DEFAULT_OUT = Path.home() / ".cache" / "decode-worker" / "bench"


def _links(text: str) -> list:
    from decode_worker.bench.link import parse_links

    try:
        return parse_links(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _grid(text: str) -> tuple[int, int]:
    """`AxB` as two positive integers."""
    try:
        a, b = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected AxB such as 10x50, not {text!r}") from None
    if a < 1 or b < 1:
        raise argparse.ArgumentTypeError(f"both numbers of {text!r} must be at least 1")
    return a, b


def _chat(text: str) -> str:
    """`CLIENTSxROUNDS` or `none`, checked when the flags are parsed."""
    if text != "none":
        _grid(text)
    return text


def add_bench_args(p: argparse.ArgumentParser) -> None:
    from decode_worker.bench.modes import MODES
    from decode_worker.bench.scale_out import ROUTINGS

    p.description = ("Replay shared-prefix and multi-turn chat workloads through a PD deployment per decode cache mode "
                     "(or one you started) and report latency, throughput, per-tier hit rates and KV bytes received.")
    w = p.add_argument_group("workload (unset: the CPU default, or the reference's with --reference)")
    w.add_argument("--reference", action="store_true",
                   help="the reference's shape: 16384 + 4608 tokens, 350 out, concurrency 8, 162K-token L1, bfloat16")
    w.add_argument("--shapes", type=_grid, nargs="+", metavar="GROUPSxPROMPTS",
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
    d = p.add_argument_group("deployment (one per mode, on loopback)")
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
                   help="round_robin and cache_aware: sglang-router's decode policies over pod-local caches; "
                        "round_robin_l3 and cache_aware_l3: the same over pods that share one Redis as L3")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=str(DEFAULT_OUT), help="folder for NAME.json, NAME.md and NAME.png")
    o.add_argument("--name", help="file name of the outputs (default bench, with --scale-out scale_out)")


def _resolve(args: argparse.Namespace) -> Scale:
    """Each unset flag from the chosen scale."""
    base = REFERENCE if args.reference else LINKED if args.link else CPU
    return Scale(**{k: getattr(args, k) if getattr(args, k) is not None else v for k, v in asdict(base).items()})


def _shape_names(shapes: list[tuple[int, int]]) -> str:
    return " ".join(f"{g}x{n}" for g, n in shapes)


def _shared_prefix(s: Scale, args: argparse.Namespace) -> list:
    from decode_worker.bench.workload import SharedPrefixSpec

    shapes = args.shapes or (SCALE_OUT_SHAPES if args.scale_out else SHAPES)
    return [SharedPrefixSpec(g, n, s.prefix_len, s.suffix_len, s.output_len, args.seed) for g, n in shapes]


def _workloads(s: Scale, args: argparse.Namespace) -> list:
    from decode_worker.bench.workload import ChatSpec

    out: list = _shared_prefix(s, args)
    if s.chat != "none":
        clients, rounds = _grid(s.chat)
        out.append(ChatSpec(clients, rounds, s.chat_first_len, s.chat_turn_len, s.output_len, args.seed))
    return out


def _longest_request(workloads: list, restart: bool) -> int:
    """Prompt plus output tokens of the longest request any workload sends (the restart row doubles a chat)."""
    from decode_worker.bench.workload import SharedPrefixSpec

    def one(w) -> int:
        if isinstance(w, SharedPrefixSpec):
            return w.prefix_len + w.suffix_len + w.output_len
        rounds = w.rounds * (2 if restart else 1)
        return w.first_len + (rounds - 1) * (w.turn_len + w.output_len) + w.output_len

    return max(one(w) for w in workloads)


def _l1_tokens(s: Scale, args: argparse.Namespace) -> int:
    """--l1-tokens, or ten prefixes plus each running request's own pages, in whole pages."""
    tokens = s.l1_tokens or args.l1_prefixes * s.prefix_len + s.concurrency * (
        s.suffix_len + s.output_len + args.page_size)
    return -(-int(tokens) // args.page_size) * args.page_size


def _model(args: argparse.Namespace):
    """The model's path (the embedded one when unset) and its config."""
    from decode_worker.model.embedded import ensure_default_model
    from decode_worker.model.loader import read_config

    model_path = args.model_path or str(ensure_default_model())
    return model_path, read_config(Path(model_path).expanduser())


def _check_context(longest: int, model) -> None:
    if longest > model.max_context:
        raise ConfigError(f"the longest request has {longest} tokens, past the model's context of {model.max_context}:"
                          " give --model-path a longer-context model, or shorter lengths")


def _prefill_tokens(args: argparse.Namespace, s: Scale, workloads: list, l1: int) -> int:
    """--prefill-l1-tokens, or every distinct prompt token of the largest workload plus each running request's
    whole prompt and output (the reference's prefill holds its prefixes; --reference: the decode L1)."""
    if args.prefill_l1_tokens or args.reference:
        return args.prefill_l1_tokens or l1
    seen = max(w.reusable_tokens for w in workloads)
    tokens = seen + s.concurrency * (_longest_request(workloads, False) + args.page_size)
    return -(-tokens // args.page_size) * args.page_size


def _spec(args: argparse.Namespace, s: Scale, model_path: str, workloads: list) -> DeploySpec:
    from decode_worker.bench.deploy import DeploySpec

    l1 = _l1_tokens(s, args)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="decode-worker-bench-"))
    return DeploySpec(model_path, s.dtype, args.page_size, l1, _prefill_tokens(args, s, workloads, l1),
                      args.hicache_ratio, args.prefetch_policy, args.api_key, log_dir, args.startup_timeout)


def _settings(args: argparse.Namespace, s: Scale, model, spec: DeploySpec, workloads: list) -> dict:
    return {**asdict(s), "model": model.name, "workloads": [w.name for w in workloads], "page_size": args.page_size,
            "l1_tokens": spec.l1_tokens, "prefill_l1_tokens": spec.prefill_l1_tokens,
            "hicache_ratio": args.hicache_ratio, "prefetch_policy": args.prefetch_policy, "seed": args.seed,
            "request_rate": None if args.request_rate == float("inf") else args.request_rate}


def _plan(args: argparse.Namespace) -> tuple[Plan, DeploySpec, dict]:
    """The run's plan, deployment spec and the settings the JSON records; ConfigError for what cannot run."""
    from decode_worker.bench.modes import MODES, Mode, check_order
    from decode_worker.bench.runner import Plan

    s = _resolve(args)
    model_path, model = _model(args)
    workloads = _workloads(s, args)
    modes = [Mode("given")] if args.url else [MODES[m] for m in args.modes or (LINK_MODES if args.link else MODES)]
    try:
        check_order([m.name for m in modes])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_context(_longest_request(workloads, any(m.restart for m in modes)), model)
    spec = _spec(args, s, model_path, workloads)
    plan = Plan(workloads, modes, s.concurrency, args.request_rate, args.page_size, model.vocab_size, args.seed,
                args.api_key)
    settings = {**_settings(args, s, model, spec, workloads), "modes": [m.name for m in modes], "url": args.url}
    return plan, spec, settings


def _check_scale_out_args(args: argparse.Namespace) -> None:
    """Flags of the cache-mode comparison that a scale-out run would otherwise ignore, refused by name."""
    given = [flag for flag, value in (("--url", args.url), ("--decode-url", args.decode_url),
                                      ("--prefill-url", args.prefill_url), ("--modes", args.modes),
                                      ("--chat", args.chat)) if value is not None]
    if given:
        raise ConfigError(f"--scale-out starts its own deployments and replays the shared-prefix trace only: drop "
                          f"{', '.join(given)}")
    if min(args.decode_pods) < 1:
        raise ConfigError(f"--decode-pods must all be at least 1, not {args.decode_pods}")


def _scale_plan(args: argparse.Namespace) -> tuple[ScalePlan, DeploySpec, dict]:
    """The scale-out run's plan: the shared-prefix traces as text the router can route on."""
    from decode_worker.bench.scale_out import ROUTINGS, ScalePlan, Trace
    from decode_worker.bench.text_prompts import as_texts, load_tokenizer, round_trip_words
    from decode_worker.bench.workload import shared_prefix_trace

    _check_scale_out_args(args)
    s = _resolve(args)
    model_path, model = _model(args)
    workloads = _shared_prefix(s, args)
    _check_context(_longest_request(workloads, False), model)
    tokenizer = load_tokenizer(model_path)
    words = round_trip_words(tokenizer)
    traces = []
    for w in workloads:
        ids = [p.ids for p in shared_prefix_trace(w, words)]
        traces.append(Trace(w, ids, as_texts(tokenizer, ids)))
    spec = _spec(args, s, model_path, workloads)
    routings = [ROUTINGS[r] for r in dict.fromkeys(args.routings)]
    plan = ScalePlan(traces, list(dict.fromkeys(args.decode_pods)), routings, s.concurrency, args.request_rate,
                     args.page_size, args.seed, words, lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
                     args.api_key)
    settings = {k: v for k, v in _settings(args, s, model, spec, workloads).items() if not k.startswith("chat")}
    settings |= {"decode_pods": plan.pods, "routings": [r.name for r in routings], "sent_as": "text"}
    return plan, spec, settings


def _write(out_dir: Path, name: str, rows: list, line: str, md: str, title: str, column=None,
           plot_links: bool = False) -> None:
    from decode_worker.bench.plot import plot, plot_savings

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(line + "\n")
    (out_dir / f"{name}.md").write_text(f"{title}\n\n{md}")
    if plot_links:
        plot_savings(rows, out_dir / f"{name}.png", title)
    else:
        plot(rows, out_dir / f"{name}.png", title, *([column] if column else []))


def _progress_bar(total: int):
    """A stderr progress bar and the ``progress(label)`` callback the runners take."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="req", file=sys.stderr, mininterval=1.0)

    def progress(label: str):
        bar.set_description(label)
        return lambda: bar.update(1)

    return bar, progress


def _run_with_bar(total: int, runs: Callable[[Callable], list]) -> tuple[list | None, float]:
    """``runs(progress)`` under a progress bar: its rows and wall seconds, or None once its error is printed."""
    bar, progress = _progress_bar(total)
    start = time.monotonic()
    try:
        return runs(progress), round(time.monotonic() - start, 1)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return None, 0.0
    finally:
        bar.close()


def _finish(args: argparse.Namespace, spec: DeploySpec, rows: list, host: dict, settings: dict, md: str,
            title: str, name: str, column=None, plot_links: bool = False) -> int:
    from decode_worker.bench.report import json_line

    host["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    line = json_line(rows, host, settings)
    _write(Path(args.out).expanduser(), name, rows, line, md, title, column, plot_links)
    print(md, file=sys.stderr)
    print(f"logs: {spec.log_dir}; outputs: {Path(args.out) / name}.{{json,md,png}}", file=sys.stderr)
    print(line, flush=True)
    return 0


def _title(settings: dict, spec: DeploySpec, concurrency: int, host: dict) -> str:
    return (f"{settings['model']} {spec.dtype}, prefix {settings['prefix_len']} + suffix {settings['suffix_len']}, "
            f"{settings['output_len']} out, concurrency {concurrency}, L1 {spec.l1_tokens} tokens"
            f"{' per decode pod' if 'decode_pods' in settings else ''}; {host['cpu']} x{host['cores']}")


def run_scale_out(args: argparse.Namespace) -> int:
    from decode_worker.bench.machine import machine
    from decode_worker.bench.scale_out import run_scale_out as run
    from decode_worker.bench.scale_report import table

    plan, spec, settings = _scale_plan(args)
    host = machine()
    rows, host["wall_s"] = _run_with_bar(plan.total_requests, lambda progress: run(plan, spec, progress))
    if rows is None:
        return 1
    title = f"decode-worker bench --scale-out: {_title(settings, spec, plan.concurrency, host)}; {host['wall_s']:.0f} s"
    return _finish(args, spec, rows, host, settings, table(rows), title, args.name or "scale_out",
                   lambda r: f"{r.workload}, {r.pods} decode pod{'s' if r.pods > 1 else ''}")


def run_bench(args: argparse.Namespace) -> int:
    from decode_worker.bench.deploy import Endpoints
    from decode_worker.bench.machine import machine
    from decode_worker.bench.report import table
    from decode_worker.bench.runner import run

    if args.scale_out:
        return run_scale_out(args)
    if args.link:
        return run_linked(args)
    plan, spec, settings = _plan(args)
    given = Endpoints(args.url.rstrip("/"), args.decode_url, args.prefill_url) if args.url else None
    host = machine()
    try:
        rows, _ = _run_with_bar(plan.total_requests,
                                lambda progress: run(plan, None if given else spec, given, progress))
    finally:
        shutil.rmtree(spec.storage_dir, ignore_errors=True)
    if rows is None:
        return 1
    title = f"decode-worker bench: {_title(settings, spec, plan.concurrency, host)}"
    return _finish(args, spec, rows, host, settings, table(rows), title, args.name or "bench")


def run_linked(args: argparse.Namespace) -> int:
    """Every mode once per link (bench/linked.py); local only, said in one line, where no namespace can be made."""
    from decode_worker.bench.link import LOCAL, Link, namespace_problem
    from decode_worker.bench.link_report import link_table
    from decode_worker.bench.linked import run_links
    from decode_worker.bench.machine import machine

    links = args.link
    if any(link.shaped for link in links) and (problem := namespace_problem()) is not None:
        print(f"bench --link: {problem}; running {LOCAL} only", file=sys.stderr)
        links = [Link(LOCAL, None)]
    plan, spec, settings = _plan(args)
    settings["links"] = [link.name for link in links]
    host = machine()
    rows, host["wall_s"] = _run_with_bar(plan.total_requests,
                                         lambda progress: run_links(args, links, plan, spec, progress))
    if rows is None:
        return 1
    title = (f"decode-worker bench --link {','.join(settings['links'])}: "
             f"{_title(settings, spec, plan.concurrency, host)}, prefill {spec.prefill_l1_tokens} tokens; "
             f"{host['wall_s']:.0f} s")
    md, extra = link_table(rows, settings)
    settings |= extra
    return _finish(args, spec, rows, host, settings, md, title, args.name or "bench_link", plot_links=True)
