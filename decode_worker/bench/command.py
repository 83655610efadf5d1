"""`decode-worker bench`: a run's plan, deployments and outputs."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from decode_worker.bench.args import LINK_MODES, SCALE_OUT_SHAPES, SHAPES, Scale, parse_grid, resolve_scale
from decode_worker.config import ConfigError

if TYPE_CHECKING:  # the heavier modules load when the command runs, not whenever the CLI parses flags
    from decode_worker.bench.deploy import DeploySpec
    from decode_worker.bench.runner import Plan
    from decode_worker.bench.scale_out import ScalePlan


def _shared_prefix(s: Scale, args: argparse.Namespace) -> list:
    from decode_worker.bench.workload import SharedPrefixSpec

    shapes = args.shapes or (SCALE_OUT_SHAPES if args.scale_out else SHAPES)
    return [SharedPrefixSpec(g, n, s.prefix_len, s.suffix_len, s.output_len, args.seed) for g, n in shapes]


def _workloads(s: Scale, args: argparse.Namespace) -> list:
    from decode_worker.bench.workload import ChatSpec

    out: list = _shared_prefix(s, args)
    if s.chat != "none":
        clients, rounds = parse_grid(s.chat)
        out.append(ChatSpec(clients, rounds, s.chat_first_len, s.chat_turn_len, s.output_len, args.seed))
    return out


def _longest_request(workloads: list, restart: bool) -> int:
    """Prompt plus output tokens of the longest request (a restart doubles a chat)."""
    from decode_worker.bench.workload import SharedPrefixSpec

    def one(w) -> int:
        if isinstance(w, SharedPrefixSpec):
            return w.prefix_len + w.suffix_len + w.output_len
        rounds = w.rounds * (2 if restart else 1)
        return w.first_len + (rounds - 1) * (w.turn_len + w.output_len) + w.output_len

    return max(one(w) for w in workloads)


def _l1_tokens(s: Scale, args: argparse.Namespace) -> int:
    """--l1-tokens, or ten prefixes plus each running request's pages, in whole pages."""
    tokens = s.l1_tokens or args.l1_prefixes * s.prefix_len + s.concurrency * (
        s.suffix_len + s.output_len + args.page_size)
    return -(-int(tokens) // args.page_size) * args.page_size


def _model(args: argparse.Namespace):
    from decode_worker.model.embedded import ensure_default_model
    from decode_worker.model.loader import read_config

    model_path = args.model_path or str(ensure_default_model())
    return model_path, read_config(Path(model_path).expanduser())


def _check_context(longest: int, model) -> None:
    if longest > model.max_context:
        raise ConfigError(f"the longest request has {longest} tokens, past the model's context of {model.max_context}:"
                          " give --model-path a longer-context model, or shorter lengths")


def _prefill_tokens(args: argparse.Namespace, s: Scale, workloads: list, l1: int) -> int:
    """--prefill-l1-tokens (--reference: ``l1``), else the largest workload's distinct tokens plus running requests."""
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
    """The run's plan, deployment spec and recorded settings, or ConfigError."""
    from decode_worker.bench.modes import MODES, Mode, check_order
    from decode_worker.bench.runner import Plan

    s = resolve_scale(args)
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
    """Refuse by name the comparison's flags a scale-out run would ignore."""
    given = [flag for flag, value in (("--url", args.url), ("--decode-url", args.decode_url),
                                      ("--prefill-url", args.prefill_url), ("--modes", args.modes),
                                      ("--chat", args.chat)) if value is not None]
    if given:
        raise ConfigError(f"--scale-out starts its own deployments and replays the shared-prefix trace only: drop "
                          f"{', '.join(given)}")
    if min(args.decode_pods) < 1:
        raise ConfigError(f"--decode-pods must all be at least 1, not {args.decode_pods}")


def _scale_plan(args: argparse.Namespace) -> tuple[ScalePlan, DeploySpec, dict]:
    """Shared-prefix traces as text the router can route on."""
    from decode_worker.bench.scale_out import ROUTINGS, ScalePlan, Trace
    from decode_worker.bench.text_prompts import as_texts, load_tokenizer, round_trip_words
    from decode_worker.bench.workload import shared_prefix_trace

    _check_scale_out_args(args)
    s = resolve_scale(args)
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
    """A stderr progress bar and its ``progress(label)`` callback."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="req", file=sys.stderr, mininterval=1.0)

    def progress(label: str):
        bar.set_description(label)
        return lambda: bar.update(1)

    return bar, progress


def _run_with_bar(total: int, runs: Callable[[Callable], list]) -> tuple[list | None, float]:
    """``runs(progress)`` under a progress bar: rows and wall seconds, or None (error printed)."""
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
    """Every mode per link; only ``local`` where no namespace can be made."""
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
