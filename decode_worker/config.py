"""Server configuration: one pydantic-settings model, each field a `serve` flag or `DECODE_WORKER_<FIELD>`."""
from __future__ import annotations

import argparse
import json
import logging
import re
from enum import Enum
from importlib.metadata import version
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, model_validator
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, CliSettingsSource, SettingsConfigDict

from decode_worker.cache.kv_events import ENCODINGS
from decode_worker.core.policies import EvictionPolicy, PrefetchMode, Role, StorageBackend, WritePolicy

ENV_PREFIX = "DECODE_WORKER_"
# What a value of each pydantic error type must be instead; other errors keep pydantic's message.
_EXPECTED = {
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_parsing": "a number",
    "bool_parsing": "true or false (or 1/0, yes/no, on/off)",
}


class ConfigError(ValueError):
    """Settings the server refuses to start with."""


def _opt(help: str, default: Any = None) -> Any:
    return Field(default, description=help)


class ServerConfig(BaseSettings):
    """What a worker runs with: flags over the environment, or set in code."""

    # An empty variable counts as unset: compose's `${VAR:-}` yields one.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_ignore_empty=True)

    role: Role = _opt("colocated serves prompt to last token; prefill/decode are the two PD halves", Role.COLOCATED)
    model_path: str | None = _opt("local Hugging Face model folder or GGUF file, never downloaded; unset: the "
                                  "embedded SmolLM2")
    served_model_name: str | None = _opt("model name reported by the API; unset: the model file's name")
    host: str = _opt("HTTP bind address", "127.0.0.1")
    port: int = _opt("HTTP port", 30000)
    dtype: str = _opt("weights and KV dtype: float32, bfloat16, float16, or auto (bfloat16 on CUDA and on CPUs "
                      "with native bf16, AVX512-BF16 or AMX; float32 on other CPUs)", "auto")
    max_total_tokens: int = _opt("L1 (device) KV capacity in tokens; unset with L1 on CUDA: sized from the memory "
                                 "free after the weights by --mem-fraction-static; unset on CPU: the model's context "
                                 "length", 32768)
    mem_fraction_static: float = _opt("with L1 on CUDA and --max-total-tokens unset: the share of device memory "
                                      "weights and KV pool may take (the rest: activations, CUDA graphs)",
                                      0.85)  # cache/sizing.py's MEM_FRACTION_STATIC
    page_size: int = _opt("tokens per KV page", 16)
    max_running_requests: int = _opt("largest decode batch", 64)
    max_prefill_tokens: int = _opt("most new prompt tokens computed in one extend step", 4096)
    cuda_graph_max_bs: int = _opt("largest batch captured as a CUDA graph, at most --max-running-requests (0 turns "
                                  "graphs off)", 256)
    ucx_host: str = _opt("unused since KV moves over NIXL (decode reads from prefill at the address in its agent's "
                         "metadata); accepted so existing command lines start, with a warning when set", "127.0.0.1")
    ucx_port: int = _opt("unused since KV moves over NIXL (no listener of ours); accepted so existing command lines "
                         "start, with a warning when set", 0)
    bootstrap_port: int | None = _opt("prefill handshake port used when a request's bootstrap_port is null")
    pd_peer_protocol: Literal["native", "sglang"] = _opt(
        "decode role: the PD protocol its prefill peers speak: native (decode-worker's prefill role: handshake, "
        "decode reads the KV) or sglang (an unmodified SGLang prefill started with --disaggregation-mode prefill "
        "--disaggregation-transfer-backend nixl pushes the KV; docs/sglang-prefill.md)", "native")
    pd_token: str = _opt("shared secret of a prefill/decode pair, sent in the handshake's X-PD-Token header", "")
    prefill_hosts: str = _opt("decode role: the prefill workers this worker may call (and send its PD token to), as "
                              "host[:port],... with IP addresses or DNS names (a name also allows every address it "
                              "resolves to); a request naming another bootstrap_host gets 400. With --pd-token or "
                              "--api-key every entry needs its port (they are sent on). Unset: loopback only, any "
                              "port, and only without those secrets; '*': any host, without them", "")
    api_key: str = _opt("require 'Authorization: Bearer <key>' on every route but /health, /health_generate and "
                        "/metrics (prefer the environment variable: flags show in ps)", "")
    max_request_body_bytes: int = _opt("largest request body accepted; a larger one gets 413", 32 * 1024 * 1024)
    grammar_max_bytes: int = _opt("longest grammar a request may send (json_schema, regex, ebnf, a tool's "
                                  "schema); a longer one gets 400 before it compiles", 256 << 10)
    grammar_max_nesting: int = _opt("deepest nesting of a request's JSON schema (objects and arrays) or regex "
                                    "(groups); a deeper one gets 400 before it compiles", 64)
    grammar_step_budget_ms: float = _opt("what a request's grammar may add to the step all requests share (its "
                                         "mask and its accept); over it 4 tokens in a row, the request ends with "
                                         "an abort that says so", 10.0)
    max_concurrent_requests: int = _opt("most sequences in flight on the generation routes (each prompt of a batch "
                                        "and each of n counts); past it they get 503 with Retry-After", 1024)
    request_body_timeout_s: float = _opt("a request's whole body must arrive within this many seconds of its "
                                         "headers, else 408 (a generation request takes a slot of "
                                         "--max-concurrent-requests only once its body is in)", 30.0)
    handshake_timeout_s: float = _opt("deadline for the PD handshake HTTP call", 30.0)
    transfer_timeout_s: float = _opt("deadline for the delta-KV transfer after the handshake", 30.0)
    kv_lease_s: float = _opt("prefill keeps a finished request's KV this long for its decode peer", 60.0)
    load_back_timeout_s: float = _opt("deadline for an L2->L1 load-back", 30.0)
    disaggregation_decode_enable_radix_cache: bool = _opt("reuse cached prefixes on the decode role (colocated and "
                                                          "prefill always do: there the flag is accepted as is)", False)
    disaggregation_decode_enable_hicache: bool = _opt("add the L2 host tier, on any role (needs the radix flag)", False)
    disaggregation_decode_hicache_ratio: float = _opt("L2 size as a multiple of L1", 3.0)
    disaggregation_decode_hicache_size: float = _opt("L2 size in GB (overrides the ratio)", 0.0)
    disaggregation_decode_hicache_write_policy: WritePolicy = _opt("when pages are backed up to L2",
                                                                   WritePolicy.WRITE_THROUGH)
    radix_eviction_policy: EvictionPolicy = _opt("which cached pages L1 demotion and L2 eviction give up first: slru "
                                                 "(never-hit before hit, then LRU; exactly the pages needed), lru, "
                                                 "lfu", EvictionPolicy.SLRU)
    hicache_storage_backend: StorageBackend = _opt("L3 storage backend", StorageBackend.NONE)
    hicache_storage_url: str | None = _opt("folder for file, redis://host:port for redis")
    hicache_storage_prefetch_policy: PrefetchMode = _opt("how long a request waits for L3 prefetch",
                                                         PrefetchMode.BEST_EFFORT)
    hicache_storage_prefetch_timeout_base_s: float = _opt("timeout policy: seconds a request waits for any "
                                                          "prefetch", 1.0)
    hicache_storage_prefetch_timeout_per_1k_tokens_s: float = _opt("timeout policy: extra seconds per 1K prefetched "
                                                                   "tokens", 0.25)
    hicache_storage_prefetch_timeout_cap_s: float = _opt("timeout policy: most seconds a request waits for a "
                                                         "prefetch", 5.0)
    hicache_storage_file_max_gb: float = _opt("file backend: folder size cap in GB (least recently used pages go "
                                              "first)", 16.0)
    kv_events_config: str | None = _opt("publish KV events for KV-aware routers (llm-d, Dynamo) over ZMQ in "
                                        "vLLM's format; JSON as vLLM's and SGLang's flag: publisher (zmq or null), "
                                        "endpoint (tcp://*:5557), topic, replay_endpoint, buffer_steps, hwm, "
                                        "max_queue_size, enable_kv_cache_events, event_encoding (array: positional "
                                        "events, as llm-d and Dynamo read; map: tagged maps, as vLLM 0.24+ and "
                                        "SGLang 0.5.20+ send); unset: off")
    tool_call_parser: Literal["auto", "hermes"] = _opt("how the model writes tool calls on the chat route: auto "
                                                       "(the format its chat template shows, else hermes) or "
                                                       "hermes (<tool_call>{json}</tool_call>)", "auto")
    log_level: str = _opt("logging level", "info")

    _dtype_reason: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _resolve_dtype(self) -> ServerConfig:
        """Resolve ``auto``, keeping the reason for the start-up line (logging is not set up yet)."""
        if self.dtype != "auto":
            return self
        import torch  # only here: the config module stays light for `--help`

        from decode_worker.core.cpu_features import auto_dtype

        self.dtype, why = auto_dtype(torch.cuda.is_available())
        self._dtype_reason = f"--dtype auto: {why}"
        logging.getLogger(__name__).info("--dtype auto: %s (%s)", self.dtype, why)
        return self

    @property
    def dtype_reason(self) -> str | None:
        """Why ``--dtype auto`` chose ``dtype``; None when explicit."""
        return self._dtype_reason

    def validate(self) -> None:
        """Combinations the field types cannot express."""
        if self.disaggregation_decode_enable_hicache and not self.disaggregation_decode_enable_radix_cache:
            raise ConfigError(
                "--disaggregation-decode-enable-hicache requires --disaggregation-decode-enable-radix-cache"
            )
        for name in ("api_key", "pd_token"):  # both travel in HTTP headers
            if not all(" " < c <= "~" for c in getattr(self, name)):
                raise ConfigError(f"{_flag(name)} must be printable ASCII without spaces")
        self._check_prefill_hosts()
        if self.max_request_body_bytes < 1 or self.max_concurrent_requests < 1:
            raise ConfigError("--max-request-body-bytes and --max-concurrent-requests must be at least 1")
        if min(self.grammar_max_bytes, self.grammar_max_nesting) < 1 or not self.grammar_step_budget_ms > 0:
            raise ConfigError("--grammar-max-bytes and --grammar-max-nesting must be at least 1 and "
                              "--grammar-step-budget-ms positive")
        if self.request_body_timeout_s <= 0:
            raise ConfigError("--request-body-timeout-s must be positive")
        if self.page_size < 1 or self.max_total_tokens < self.page_size:
            raise ConfigError(f"--max-total-tokens ({self.max_total_tokens}) must hold at least one page of {self.page_size}")
        if not 0 < self.mem_fraction_static < 1 or self.cuda_graph_max_bs < 0:
            raise ConfigError("--mem-fraction-static must be between 0 and 1 and --cuda-graph-max-bs at least 0")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype must be float32, bfloat16 or float16, not {self.dtype!r}")
        if self.hicache_storage_backend != "none" and not self.disaggregation_decode_enable_hicache:
            raise ConfigError("--hicache-storage-backend needs --disaggregation-decode-enable-hicache")
        if self.hicache_storage_backend == "redis" and not (self.hicache_storage_url or "").startswith("redis://"):
            raise ConfigError("--hicache-storage-backend redis needs --hicache-storage-url redis://host:port")
        if self.kv_events is not None and not self.radix_cache:
            raise ConfigError("--kv-events-config needs --disaggregation-decode-enable-radix-cache on the decode "
                              "role: without prefix reuse nothing is cached to publish")

    def _check_prefill_hosts(self) -> None:
        from decode_worker.core.prefill_hosts import parse_prefill_hosts

        try:
            entries = parse_prefill_hosts(self.prefill_hosts)
        except ValueError as e:
            raise ConfigError(f"--prefill-hosts: {e}") from None
        if self.pd_peer_protocol == "sglang":
            self._check_sglang_peer(entries)
        secrets = " and ".join(_flag(name) for name in ("pd_token", "api_key") if getattr(self, name))
        if self.role != "decode" or not secrets:
            return
        if entries is None:
            raise ConfigError(f"--prefill-hosts '*' with {secrets} would send it to any host a request names in "
                              "bootstrap_host: list the prefill workers instead")
        portless = [str(e) for e in entries if e.port is None]
        if not entries or portless:
            which = f"{', '.join(portless)} names no port" if portless else "it is unset: loopback, any port"
            raise ConfigError(f"{secrets} go only to prefill workers listed in --prefill-hosts as host:port ({which}): "
                              "on a shared host any user may listen on a loopback port")

    def _check_sglang_peer(self, entries: tuple | None) -> None:
        """SGLang's protocol carries no secret and lets a registered prefill write into the whole KV pool: only
        for the decode role, and only with prefill bootstrap servers listed with their ports."""
        if self.role != "decode":
            raise ConfigError("--pd-peer-protocol sglang is for the decode role (this package's prefill role speaks "
                              "the native protocol)")
        if self.pd_token:
            raise ConfigError("--pd-token is not sent to SGLang prefills (their protocol has no secret): unset it "
                              "with --pd-peer-protocol sglang; --prefill-hosts is what guards the pool")
        if not entries or any(e.port is None for e in entries):
            raise ConfigError("--pd-peer-protocol sglang needs --prefill-hosts listing each SGLang prefill's "
                              "bootstrap server as host:port (a registered prefill may write into the whole KV pool)")

    @property
    def kv_events(self) -> dict[str, Any] | None:
        return kv_events_settings(self.kv_events_config)

    @property
    def radix_cache(self) -> bool:
        """Colocated and prefill always reuse prefixes; decode when asked."""
        return self.role != "decode" or self.disaggregation_decode_enable_radix_cache


# --kv-events-config keys (vLLM's KVEventsConfig, SGLang's is the same less the first) and their types.
_KV_EVENTS_KEYS: dict[str, type | tuple[type, ...]] = {
    "enable_kv_cache_events": bool, "publisher": str, "endpoint": str, "replay_endpoint": (str, type(None)),
    "topic": str, "buffer_steps": int, "hwm": int, "max_queue_size": int, "event_encoding": str,
}


def kv_events_settings(raw: str | None) -> dict[str, Any] | None:
    """Publisher arguments from ``--kv-events-config``, None when off; unknown keys and wrong types refused by name."""
    if raw is None:
        return None
    try:
        given = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--kv-events-config is not JSON: {e}") from None
    if not isinstance(given, dict):
        raise ConfigError("--kv-events-config must be a JSON object")
    for key, value in given.items():
        kind = _KV_EVENTS_KEYS.get(key)
        if kind is None:
            raise ConfigError(f"--kv-events-config: unknown key {key!r} (known: {', '.join(_KV_EVENTS_KEYS)})")
        if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 1)):
            raise ConfigError(f"--kv-events-config: {key} cannot be {value!r}")
    publisher = given.pop("publisher", "zmq")
    if publisher not in ("zmq", "null"):
        raise ConfigError(f"--kv-events-config: publisher must be zmq or null, not {publisher!r}")
    if given.get("event_encoding", "array") not in ENCODINGS:
        raise ConfigError(f"--kv-events-config: event_encoding must be one of {', '.join(ENCODINGS)}, "
                          f"not {given['event_encoding']!r}")
    if not given.pop("enable_kv_cache_events", True) or publisher == "null":
        return None
    return given


def mask_url(url: str) -> str:
    return re.sub(r"//[^@/]*@", "//***@", url)


def package_version() -> str:
    """The installed version; pyproject.toml is its one source."""
    return version("decode-worker")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _enum_type(name: str) -> type[Enum] | None:
    field = ServerConfig.model_fields.get(name)
    kind = field.annotation if field else None
    return kind if isinstance(kind, type) and issubclass(kind, Enum) else None


def _add_argument(parser: argparse.ArgumentParser, *names: str, **kwargs: Any) -> argparse.Action:
    """Flags and env take an enum's values (``decode``), not its member names."""
    kind = _enum_type(kwargs.get("dest", ""))
    if kind is not None:
        kwargs["metavar"] = "{" + ",".join(m.value for m in kind) + "}"
        default = ServerConfig.model_fields[kwargs["dest"]].default
        kwargs["help"] = kwargs["help"].replace(f"(default: {default.name})", f"(default: {default.value})")
    return parser.add_argument(*names, **kwargs)


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Every ServerConfig field as a flag; ``--help`` shows its default and variable."""
    source = CliSettingsSource(ServerConfig, root_parser=parser, cli_kebab_case=True, cli_implicit_flags=True,
                               cli_show_env_vars=True, cli_hide_none_type=True, add_argument_method=_add_argument)
    parser.set_defaults(config_source=source)


def _describe(error: ErrorDetails, given: set[str]) -> str:
    """A bad value's one-line error, naming its flag or variable."""
    name = str(error["loc"][0])
    where = _flag(name) if name in given else _env_var(name)
    value = error.get("input")
    kind = _enum_type(name)
    if kind is not None:
        return f"{where} must be one of {', '.join(m.value for m in kind)}, not {value!r}"
    if error["type"] in _EXPECTED:
        return f"{where} must be {_EXPECTED[error['type']]}, not {value!r}"
    return f"{where}: {error['msg']} (got {value!r})"


def _build(given: set[str], **kwargs: Any) -> ServerConfig:
    try:
        return ServerConfig(**kwargs)
    except ValidationError as e:
        raise ConfigError("\n".join(_describe(err, given) for err in e.errors())) from None


def config_from_env() -> ServerConfig:
    """The environment's settings alone, type-checked; combinations are the flags' to check."""
    return _build(set())


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Flags over the environment over the defaults, validated."""
    given = {name for name in vars(args) if name in ServerConfig.model_fields}
    cfg = _build(given, _cli_settings_source=args.config_source(parsed_args=args))
    cfg.validate()
    return cfg
