"""`decode-worker bench`: flags, the CPU default and the reference's shape, and the run's outputs.

The CPU default scales the reference (SGLang decode HiCache, Qwen3-32B on H200s: 16,384-token prefixes, 4,608-token
suffixes, 350 output tokens, concurrency 8, ~162K tokens of device KV) down to SmolLM2 on a couple of cores, so
that both shapes, the chat workload and every mode finish in about a quarter of an hour. `--reference` runs the
reference's own shape (on a GPU, with a long-context model given by --model-path).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from decode_worker.config import ConfigError

if TYPE_CHECKING:  # the heavier modules load when the command runs, not whenever the CLI parses flags
    from decode_worker.bench.deploy import DeploySpec
    from decode_worker.bench.runner import Plan


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
REFERENCE = Scale(prefix_len=16384, suffix_len=4608, output_len=350, concurrency=8, l1_tokens=162_000,
                  dtype="bfloat16", chat="8x8", chat_first_len=4096, chat_turn_len=512)


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

    p.description = ("Replay shared-prefix and multi-turn chat workloads through a PD deployment per decode cache mode "
                     "(or one you started) and report latency, throughput, per-tier hit rates and KV bytes received.")
    w = p.add_argument_group("workload (unset: the CPU default, or the reference's with --reference)")
    w.add_argument("--reference", action="store_true",
                   help="the reference's shape: 16384 + 4608 tokens, 350 out, concurrency 8, 162K-token L1, bfloat16")
    w.add_argument("--shapes", type=_grid, nargs="+", default=[(10, 50), (50, 10)], metavar="GROUPSxPROMPTS",
                   help="shared-prefix shapes: groups x prompts per group")
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
    d.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="decode cache modes, in order")
    d.add_argument("--model-path", default=None, help="the workers' model; unset: the embedded SmolLM2")
    d.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help=f"weights and KV (CPU {CPU.dtype})")
    d.add_argument("--page-size", type=int, default=16)
    d.add_argument("--l1-prefixes", type=float, default=10.0,
                   help="decode L1 holds this many prefixes plus each running request's own suffix and output (the "
                        "reference: about ten prefixes in 162K tokens)")
    d.add_argument("--l1-tokens", type=int, help="decode L1 in tokens; overrides --l1-prefixes")
    d.add_argument("--prefill-l1-tokens", type=int, help="prefill's KV capacity; unset: the decode worker's L1")
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
    o = p.add_argument_group("output")
    o.add_argument("--out", default="bench/results", help="folder for NAME.json, NAME.md and NAME.png")
    o.add_argument("--name", default="bench", help="file name of the outputs")


def _resolve(args: argparse.Namespace) -> Scale:
    """Each unset flag from the chosen scale."""
    base = REFERENCE if args.reference else CPU
    return Scale(**{k: getattr(args, k) if getattr(args, k) is not None else v for k, v in asdict(base).items()})


def _workloads(s: Scale, args: argparse.Namespace) -> list:
    from decode_worker.bench.workload import ChatSpec, SharedPrefixSpec

    out: list = [SharedPrefixSpec(g, n, s.prefix_len, s.suffix_len, s.output_len, args.seed) for g, n in args.shapes]
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


def _plan(args: argparse.Namespace) -> tuple[Plan, DeploySpec, dict]:
    """The run's plan, deployment spec and the settings the JSON records; ConfigError for what cannot run."""
    from decode_worker.bench.deploy import DeploySpec
    from decode_worker.bench.modes import MODES, Mode, check_order
    from decode_worker.bench.runner import Plan
    from decode_worker.model.embedded import ensure_default_model
    from decode_worker.model.loader import read_config

    s = _resolve(args)
    model_path = args.model_path or str(ensure_default_model())
    model = read_config(Path(model_path).expanduser())
    workloads = _workloads(s, args)
    modes = [Mode("given")] if args.url else [MODES[m] for m in args.modes]
    try:
        check_order([m.name for m in modes])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    longest = _longest_request(workloads, any(m.restart for m in modes))
    if longest > model.max_context:
        raise ConfigError(f"the longest request has {longest} tokens, past the model's context of {model.max_context}:"
                          " give --model-path a longer-context model, or shorter lengths")
    l1 = _l1_tokens(s, args)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="decode-worker-bench-"))
    spec = DeploySpec(model_path, s.dtype, args.page_size, l1, args.prefill_l1_tokens or l1, args.hicache_ratio,
                      args.prefetch_policy, args.api_key, log_dir, args.startup_timeout)
    plan = Plan(workloads, modes, s.concurrency, args.request_rate, args.page_size, model.vocab_size, args.seed,
                args.api_key)
    settings = {**asdict(s), "model": model.name, "workloads": [w.name for w in workloads],
                "modes": [m.name for m in modes], "page_size": args.page_size, "l1_tokens": l1,
                "prefill_l1_tokens": spec.prefill_l1_tokens, "hicache_ratio": args.hicache_ratio,
                "prefetch_policy": args.prefetch_policy, "seed": args.seed, "url": args.url,
                "request_rate": None if args.request_rate == float("inf") else args.request_rate}
    return plan, spec, settings


def _write(out_dir: Path, name: str, rows: list, line: str, md: str, title: str) -> None:
    from decode_worker.bench.plot import plot

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(line + "\n")
    (out_dir / f"{name}.md").write_text(f"{title}\n\n{md}")
    plot(rows, out_dir / f"{name}.png", title)


def run_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from decode_worker.bench.deploy import Endpoints
    from decode_worker.bench.machine import machine
    from decode_worker.bench.report import json_line, table
    from decode_worker.bench.runner import run

    plan, spec, settings = _plan(args)
    given = Endpoints(args.url.rstrip("/"), args.decode_url, args.prefill_url) if args.url else None
    host = machine()
    bar = tqdm(total=plan.total_requests, unit="req", file=sys.stderr, mininterval=1.0)

    def progress(label: str):
        bar.set_description(label)
        return lambda: bar.update(1)

    try:
        rows = run(plan, None if given else spec, given, progress)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        bar.close()
        shutil.rmtree(spec.storage_dir, ignore_errors=True)
    host["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    line, md = json_line(rows, host, settings), table(rows)
    title = (f"decode-worker bench: {settings['model']} {spec.dtype}, prefix {settings['prefix_len']} + suffix "
             f"{settings['suffix_len']}, {settings['output_len']} out, concurrency {plan.concurrency}, "
             f"L1 {spec.l1_tokens} tokens; {host['cpu']} x{host['cores']}")
    _write(Path(args.out), args.name, rows, line, md, title)
    print(md, file=sys.stderr)
    print(f"logs: {spec.log_dir}; outputs: {Path(args.out) / args.name}.{{json,md,png}}", file=sys.stderr)
    print(line, flush=True)
    return 0
