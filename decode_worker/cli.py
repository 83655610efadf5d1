"""`decode-worker` command line."""
from __future__ import annotations

import argparse
import json
import sys

from decode_worker.config import add_config_args
from decode_worker.launch import add_up_args, run_up
from decode_worker.model.config import ModelLoadError


def _generate(args: argparse.Namespace) -> int:
    import torch

    from decode_worker.engine.llm import LLM
    from decode_worker.core.sampling import SamplingParams
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
    from decode_worker.server.server import serve
    from decode_worker.config import ConfigError, config_from_args

    try:
        config = config_from_args(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    serve(config)
    return 0


def _fetch_model(args: argparse.Namespace) -> int:
    from decode_worker.model.embedded import ensure_default_model

    print(ensure_default_model())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decode-worker")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from one prompt on the command line")
    group = gen.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="raw prompt text")
    group.add_argument("--chat", help="a user message, wrapped in the model's chat template")
    gen.add_argument("--model-path", default=None, help="Hugging Face directory or GGUF file (default: embedded SmolLM2)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-total-tokens", type=int, default=16384)
    gen.add_argument("--page-size", type=int, default=16)
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.set_defaults(func=_generate)
    srv = sub.add_parser("serve", help="run a worker (colocated, prefill or decode role)")
    add_config_args(srv)
    srv.set_defaults(func=_serve)
    up = sub.add_parser("up", help="run a local PD deployment: sglang-router, a prefill and a decode worker")
    add_up_args(up)
    up.set_defaults(func=run_up)
    fetch = sub.add_parser("fetch-model", help="download the embedded default model into the cache folder")
    fetch.set_defaults(func=_fetch_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
