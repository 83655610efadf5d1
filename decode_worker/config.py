"""Server configuration: one dataclass, every field a CLI flag that also reads an environment variable.

`--some-flag` reads `DECODE_WORKER_SOME_FLAG` when not given on the command line.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal, get_args, get_type_hints

ENV_PREFIX = "DECODE_WORKER_"
Role = Literal["colocated", "prefill", "decode"]
WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
StorageBackend = Literal["none", "file", "redis"]


class ConfigError(ValueError):
    """A combination of flags the server refuses to start with."""


def _opt(help: str, default=None, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ServerConfig:
    role: Role = _opt("colocated serves prompt to last token; prefill/decode are the two PD halves", "colocated")
    model_path: str | None = _opt("Hugging Face directory or GGUF file (default: the embedded SmolLM2)")
    served_model_name: str | None = _opt("model name reported by the API (default: the model file's name)")
    host: str = _opt("HTTP bind address", "127.0.0.1")
    port: int = _opt("HTTP port", 30000)
    dtype: str = _opt("weights and KV dtype: float32, bfloat16 or float16", "float32")
    max_total_tokens: int = _opt("L1 (device) KV capacity in tokens", 32768)
    page_size: int = _opt("tokens per KV page", 16)
    max_running_requests: int = _opt("largest decode batch", 64)
    max_prefill_tokens: int = _opt("most new prompt tokens computed in one extend step", 4096)
    cuda_graph_max_bs: int = _opt("largest batch captured as a CUDA graph (0 turns graphs off)", 64)
    ucx_host: str = _opt("address prefill workers use to reach this decode worker's UCX listener", "127.0.0.1")
    ucx_port: int = _opt("UCX listener port for control and peer liveness (0 picks a free port)", 0)
    bootstrap_port: int | None = _opt("prefill handshake port used when a request's bootstrap_port is null")
    pd_token: str = _opt("shared secret of a prefill/decode pair, sent in the handshake's X-PD-Token header", "")
    api_key: str = _opt("require 'Authorization: Bearer <key>' on every route but /health, /health_generate and "
                        "/metrics (prefer the environment variable: flags show in ps)", "")
    max_request_body_bytes: int = _opt("largest request body accepted; a larger one gets 413", 32 * 1024 * 1024)
    max_concurrent_requests: int = _opt("most requests in flight on the generation routes; past it they get 503 "
                                        "with Retry-After", 1024)
    handshake_timeout_s: float = _opt("deadline for the PD handshake HTTP call", 30.0)
    transfer_timeout_s: float = _opt("deadline for the delta-KV transfer after the handshake", 30.0)
    kv_lease_s: float = _opt("prefill keeps a finished request's KV this long for its decode peer", 60.0)
    load_back_timeout_s: float = _opt("deadline for an L2->L1 load-back", 30.0)
    disaggregation_decode_enable_radix_cache: bool = _opt("reuse cached prefixes on the decode role (colocated and "
                                                          "prefill always do: there the flag is accepted as is)", False)
    disaggregation_decode_enable_hicache: bool = _opt("add the L2 host tier, on any role (needs the radix flag)", False)
    disaggregation_decode_hicache_ratio: float = _opt("L2 size as a multiple of L1", 3.0)
    disaggregation_decode_hicache_size: float = _opt("L2 size in GB (overrides the ratio)", 0.0)
    disaggregation_decode_hicache_write_policy: WritePolicy = _opt("when pages are backed up to L2", "write_through")
    hicache_storage_backend: StorageBackend = _opt("L3 storage backend", "none")
    hicache_storage_url: str | None = _opt("folder for file, redis://host:port for redis")
    hicache_storage_prefetch_policy: PrefetchPolicy = _opt("how long a request waits for L3 prefetch", "best_effort")
    hicache_storage_prefetch_timeout_base_s: float = _opt("timeout policy: seconds a request waits for any prefetch", 1.0)
    hicache_storage_prefetch_timeout_per_1k_tokens_s: float = _opt("timeout policy: extra seconds per 1K prefetched tokens", 0.25)
    hicache_storage_prefetch_timeout_cap_s: float = _opt("timeout policy: most seconds a request waits for a prefetch", 5.0)
    hicache_storage_file_max_gb: float = _opt("file backend: folder size cap in GB (least recently used pages go first)", 16.0)
    log_level: str = _opt("logging level", "info")

    def validate(self) -> None:
        hints = get_type_hints(ServerConfig)
        for f in dataclasses.fields(self):  # env values bypass argparse's choices: check them here
            allowed = get_args(hints[f.name]) if getattr(hints[f.name], "__origin__", None) is Literal else None
            if allowed and getattr(self, f.name) not in allowed:
                raise ConfigError(f"{_flag(f.name)} must be one of {', '.join(allowed)}, not {getattr(self, f.name)!r}")
        if self.disaggregation_decode_enable_hicache and not self.disaggregation_decode_enable_radix_cache:
            raise ConfigError(
                "--disaggregation-decode-enable-hicache requires --disaggregation-decode-enable-radix-cache"
            )
        for name in ("api_key", "pd_token"):  # both travel in HTTP headers
            if not all(" " < c <= "~" for c in getattr(self, name)):
                raise ConfigError(f"{_flag(name)} must be printable ASCII without spaces")
        if self.max_request_body_bytes < 1 or self.max_concurrent_requests < 1:
            raise ConfigError("--max-request-body-bytes and --max-concurrent-requests must be at least 1")
        if self.page_size < 1 or self.max_total_tokens < self.page_size:
            raise ConfigError(f"--max-total-tokens ({self.max_total_tokens}) must hold at least one page of {self.page_size}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype must be float32, bfloat16 or float16, not {self.dtype!r}")
        if self.hicache_storage_backend != "none" and not self.disaggregation_decode_enable_hicache:
            raise ConfigError("--hicache-storage-backend needs --disaggregation-decode-enable-hicache")
        if self.hicache_storage_backend == "redis" and not (self.hicache_storage_url or "").startswith("redis://"):
            raise ConfigError("--hicache-storage-backend redis needs --hicache-storage-url redis://host:port")

    @property
    def radix_cache(self) -> bool:
        """Colocated and prefill roles always reuse prefixes; the decode role only when asked."""
        return self.role != "decode" or self.disaggregation_decode_enable_radix_cache


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env_default(f: dataclasses.Field, kind: type):
    raw = os.environ.get(ENV_PREFIX + f.name.upper())
    if raw is None:
        return f.default
    if kind is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return kind(raw)


def add_config_args(parser: argparse.ArgumentParser) -> None:
    hints = get_type_hints(ServerConfig)
    for f in dataclasses.fields(ServerConfig):
        hint = hints[f.name]
        choices = get_args(hint) if getattr(hint, "__origin__", None) is Literal else None
        kind = next((t for t in get_args(hint) if t is not type(None)), hint) if choices is None else str
        if kind is bool:
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction,
                                default=_env_default(f, bool), help=f.metadata["help"])
        else:
            parser.add_argument(_flag(f.name), type=kind, choices=choices, default=_env_default(f, kind),
                                help=f"{f.metadata['help']} (env {ENV_PREFIX}{f.name.upper()})")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    cfg = ServerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)})
    cfg.validate()
    return cfg
