"""From a request body to scheduler inputs: what the SGLang and OpenAI routes share."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from pydantic import BaseModel

from decode_worker.config import ServerConfig
from decode_worker.core.prefill_hosts import prefill_hosts
from decode_worker.core.request import Bootstrap, GenerateInput, RequestError
from decode_worker.model.tokenizer import Tokenizer
from decode_worker.server.schemas import BootstrapFields

BOOTSTRAP = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def pick(value: Any, i: int) -> Any:
    """Prompt ``i``'s value of a field given once or per prompt."""
    return value[i] if isinstance(value, list) else value


def per_prompt(body: BaseModel, fields: tuple[str, ...], n: int) -> None:
    """A list-valued field of another length than the prompts is refused (400 naming it)."""
    for name in fields:
        value = getattr(body, name)
        if isinstance(value, list) and len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for {n} prompt{'s' if n != 1 else ''}")


def bootstrap(body: BootstrapFields, i: int, cfg: ServerConfig) -> Bootstrap | None:
    """Prompt ``i``'s prefill peer and room, or None outside a PD pair."""
    host, port, room = pick(body.bootstrap_host, i), pick(body.bootstrap_port, i), pick(body.bootstrap_room, i)
    if host is None and room is None:
        return None
    if host is None or room is None:
        raise RequestError("bootstrap_host and bootstrap_room must be given together")
    port = port if port is not None else _default_port(cfg)
    if port is None:
        raise RequestError("bootstrap_port is null and this worker has no --bootstrap-port default")
    return Bootstrap(_url_host(host), int(port), int(room))


async def check_prefill_hosts(body: BaseModel, cfg: ServerConfig) -> None:
    """Refuse (400 naming it) a ``bootstrap_host`` outside ``--prefill-hosts``, without listing them."""
    if cfg.role != "decode" or getattr(body, "bootstrap_host", None) is None:
        return
    hosts = body.bootstrap_host if isinstance(body.bootstrap_host, list) else [body.bootstrap_host]
    ports = body.bootstrap_port if isinstance(body.bootstrap_port, list) else [body.bootstrap_port] * len(hosts)
    allow = prefill_hosts(cfg.prefill_hosts)
    for host, port in zip(hosts, ports + [None] * (len(hosts) - len(ports))):
        port = port if port is not None else _default_port(cfg)
        if host is None or port is None:
            continue  # bootstrap() refuses these for their own reasons
        if not await allow.allowed(host, int(port)):
            raise RequestError(f"bootstrap_host {host!r} (port {port}) is not a prefill worker this decode worker "
                               "may call: the operator lists them in --prefill-hosts")


def _default_port(cfg: ServerConfig) -> int | None:
    """A null bootstrap_port: --bootstrap-port on decode, the own port on prefill."""
    return cfg.bootstrap_port if cfg.role == "decode" else cfg.port


def _url_host(host: str) -> str:
    """A raw IPv6 address goes in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def encode(tokenizer: Tokenizer, text: str | None, ids: list[int] | None) -> list[int]:
    """The prompt's token ids: given ones as they are, else the text's."""
    if ids is not None:
        return list(ids)
    if text is None:
        raise RequestError("give either text or input_ids")
    return tokenizer.encode(text)


def stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def fan_out(inp: GenerateInput, n: int) -> list[GenerateInput]:
    """``n`` samples of one prompt as ``n`` requests, each with its own id and seed."""
    if n == 1:
        return [inp]
    seed = inp.params.seed
    seeds = [None if seed is None else (seed + j) % 2**64 for j in range(n)]
    return [replace(inp, rid=f"{inp.rid}-{j}", params=replace(inp.params, seed=s)) for j, s in enumerate(seeds)]
