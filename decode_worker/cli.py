"""`decode-worker` command line."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from decode_worker.bench.args import add_bench_args
from decode_worker.bench.command import run_bench
from decode_worker.config import ConfigError, add_config_args, config_from_args, config_from_env, package_version
from decode_worker.launch import add_up_args, check_up_args, run_up
from decode_worker.model.config import ModelLoadError

# `owner/name`, as on the Hugging Face Hub: what a missing --model-path looks like when it is a repo id.
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _missing_model(path: str) -> str:
    if not REPO_ID.fullmatch(path):
        return f"--model-path {path!r}: no such file or directory"
    name = path.split("/")[1]
    return (f"--model-path {path!r} does not exist. If it is a Hugging Face repo id: decode-worker does not download "
            f"models; download it first (`hf download {path} --local-dir models/{name}`) and pass that local folder "
            "(in a container, mount it)")


def check_model_path(path: str | None) -> None:
    """Refuse an unopenable model before starting (in the background it shows only as /health 503); None: embedded."""
    if path is None:
        return
    target = Path(path).expanduser()
    if not target.exists():
        raise ConfigError(_missing_model(path))
    if not os.access(target, os.R_OK | (os.X_OK if target.is_dir() else 0)):
        raise ConfigError(f"--model-path {path!r}: permission denied for uid {os.getuid()}")
    from decode_worker.model.loader import read_config

    try:
        read_config(target)  # config.json or the GGUF header: cheap, and says what is wrong in the loader's words
    except OSError as e:
        raise ConfigError(f"--model-path {path!r}: {e.strerror}: {e.filename}") from None


def _generate(args: argparse.Namespace) -> int:
    check_model_path(args.model_path)
    import torch

    from decode_worker.core.sampling import SamplingParams
    from decode_worker.engine.llm import LLM
    from decode_worker.model.embedded import ensure_default_model

    path = args.model_path or str(ensure_default_model())
    llm = LLM(path, max_total_tokens=args.max_total_tokens, page_size=args.page_size, dtype=getattr(torch, args.dtype))
    prompt = [{"role": "user", "content": args.chat}] if args.chat else args.prompt
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    try:
        out = llm.generate([prompt], params)[0]
    except ValueError as e:  # a prompt that cannot fit, bad parameters
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"text": out.text, "output_ids": out.output_ids, "finish_reason": out.finish_reason,
                      "prompt_tokens": out.prompt_tokens}))
    return 0


def _serve(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    check_model_path(config.model_path)
    from decode_worker.server.app import serve

    serve(config)
    return 0


def _up(args: argparse.Namespace) -> int:
    check_up_args(args)
    check_model_path(args.model_path or config_from_env().model_path)  # the workers inherit the environment
    return run_up(args)


def _fetch_model(args: argparse.Namespace) -> int:
    from decode_worker.model.embedded import ensure_default_model

    print(ensure_default_model())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decode-worker")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from one prompt on the command line",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    group = gen.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="raw prompt text")
    group.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    gen.add_argument("--model-path", default=None,
                     help="local Hugging Face folder or GGUF file; unset: the embedded SmolLM2")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--max-total-tokens", type=int, default=16384, help="KV capacity in tokens")
    gen.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                     help="weights and KV dtype")
    gen.set_defaults(func=_generate)
    srv = sub.add_parser("serve", help="run a worker (colocated, prefill or decode role)")
    add_config_args(srv)
    srv.set_defaults(func=_serve)
    up = sub.add_parser("up", help="run a local PD deployment: smg, a prefill and decode workers "
                                    "(with 2 or more, a redis-server as their shared L3)")
    add_up_args(up)
    up.set_defaults(func=_up)
    bench = sub.add_parser("bench", help="benchmark decode cache modes on shared-prefix and chat workloads")
    add_bench_args(bench)
    bench.set_defaults(func=run_bench)
    fetch = sub.add_parser("fetch-model", help="download the embedded default model into the cache folder")
    fetch.set_defaults(func=_fetch_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config_from_env()  # a bad DECODE_WORKER_* value stops every subcommand, whether or not a flag overrides it
        return args.func(args)
    except (ConfigError, ModelLoadError) as e:
        for line in str(e).splitlines():  # one line per bad setting
            print(f"error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
