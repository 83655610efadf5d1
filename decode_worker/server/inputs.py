"""What the routes share in making scheduler inputs."""
from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from decode_worker.config import ServerConfig
from decode_worker.core.prefill_hosts import prefill_hosts
from decode_worker.core.request import Bootstrap, GenerateInput, RequestError
from decode_worker.engine.engine import Engine
from decode_worker.model.tokenizer import Tokenizer
from decode_worker.server.errors import describe
from decode_worker.server.schemas import BootstrapFields, OpenAISampling, SGLangSamplingParams, check_fields

BOOTSTRAP = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
ANY_OBJECT = '{"type": "object"}'  # json_object, and a json_schema format without a schema
Body = TypeVar("Body", bound=BaseModel)


async def get_engine(request: Request) -> Engine:
    """Async, so it runs on the event loop."""
    return request.app.state.engine


EngineDep = Annotated[Engine, Depends(get_engine)]


async def parse_body(request: Request, model: type[Body]) -> Body:
    """A JSON body of any content type, its fields and prefill hosts checked."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"malformed JSON body: {e}") from e
    try:
        check_fields(model, data, request.url.path)
    except ValueError as e:
        raise RequestError(str(e)) from e
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        raise RequestError(describe(e)) from e
    await check_prefill_hosts(body, request.app.state.engine.config)
    return body


async def check_prefill_hosts(body: BaseModel, cfg: ServerConfig) -> None:
    """400 for a ``bootstrap_host`` outside ``--prefill-hosts``."""
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


def pick(value: Any, i: int) -> Any:
    """Prompt ``i``'s entry of a field given once or per prompt."""
    return value[i] if isinstance(value, list) else value


def per_prompt(body: BaseModel, fields: tuple[str, ...], n: int) -> None:
    """400 for a list field whose length is not ``n``."""
    for name in fields:
        value = getattr(body, name)
        if isinstance(value, list) and len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for {n} prompt{'s' if n != 1 else ''}")


def encode(tokenizer: Tokenizer, text: str | None, ids: list[int] | None) -> list[int]:
    """Given token ids, else the text's."""
    if ids is not None:
        return list(ids)
    if text is None:
        raise RequestError("give either text or input_ids")
    return tokenizer.encode(text)


def stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def prompt_logprob_start(start: int | None, prompt_len: int, name: str) -> int | None:
    """``start`` checked against the prompt; -1/None: none."""
    if start is None or start == -1:
        return None
    if not 0 <= start < prompt_len:
        raise RequestError(f"{name} must be -1 (output logprobs only) or a prompt position in [0, {prompt_len}), "
                           f"got {start}")
    return start


def bootstrap(body: BootstrapFields, i: int, cfg: ServerConfig) -> Bootstrap | None:
    """Prompt ``i``'s prefill peer and room; None outside PD."""
    host, port, room = pick(body.bootstrap_host, i), pick(body.bootstrap_port, i), pick(body.bootstrap_room, i)
    if host is None and room is None:
        return None
    if host is None or room is None:
        raise RequestError("bootstrap_host and bootstrap_room must be given together")
    port = port if port is not None else _default_port(cfg)
    if port is None:
        raise RequestError("bootstrap_port is null and this worker has no --bootstrap-port default")
    return Bootstrap(_url_host(host), int(port), int(room))


def _default_port(cfg: ServerConfig) -> int | None:
    """--bootstrap-port on decode, the own port on prefill."""
    return cfg.bootstrap_port if cfg.role == "decode" else cfg.port


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def bootstrap_per_choice(body: BaseModel, prompts: int, total: int) -> bool:
    """Whether bootstrap lists are per choice, not per prompt; else refused."""
    lists = {name: len(v) for name in BOOTSTRAP if isinstance(v := getattr(body, name), list)}
    lengths = set(lists.values())
    if len(lengths) > 1:  # name the field that disagrees with the prompts (or, failing that, with the others)
        name, length = min(lists.items(), key=lambda item: (item[1] in (prompts, total), item[0]))
        raise RequestError(f"{name} has {length} entries for {prompts} prompts; {', '.join(BOOTSTRAP)} must have as "
                           "many entries each")
    if not lengths or lengths == {prompts}:
        return False
    if lengths == {total}:
        return True
    per_choice = f" or {total} (one per choice)" if total != prompts else ""
    name, length = next(iter(lists.items()))
    raise RequestError(f"{name} has {length} entries: give {prompts} (one per prompt){per_choice}")


def choice_room(room: int, j: int) -> int:
    """Choice ``j``'s room, hashed from the prompt's; choice 0 keeps it."""
    if j == 0:
        return room
    return int.from_bytes(hashlib.sha256(f"{room}/{j}".encode()).digest()[:8], "big")


def choice_inputs(inp: GenerateInput, n: int, body: BaseModel, first: int | None,
                  cfg: ServerConfig) -> list[GenerateInput]:
    """``inp``'s ``n`` choices, each its own id, seed and room (README: ``n``)."""
    samples = fan_out(replace(inp, bootstrap=None), n)
    if first is not None:
        boots = [bootstrap(body, first + j, cfg) for j in range(n)]
    else:
        base = inp.bootstrap
        boots = [None if base is None else replace(base, room=choice_room(base.room, j)) for j in range(n)]
    return [replace(s, bootstrap=b) for s, b in zip(samples, boots)]


def fan_out(inp: GenerateInput, n: int) -> list[GenerateInput]:
    """``n`` requests, each its own id and seed."""
    if n == 1:
        return [inp]
    seed = inp.params.seed
    seeds = [None if seed is None else (seed + j) % 2**64 for j in range(n)]
    return [replace(inp, rid=f"{inp.rid}-{j}", params=replace(inp.params, seed=s)) for j, s in enumerate(seeds)]


def generate_grammar(p: SGLangSamplingParams) -> dict[str, str]:
    """``/generate``'s grammar fields: one of json_schema, regex, ebnf at most."""
    given = {f"sampling_params.{kind}": (kind, text) for kind in ("json_schema", "regex", "ebnf")
             if (text := getattr(p, kind)) is not None}
    return _one_grammar(given)


def openai_grammar(body: OpenAISampling) -> dict[str, str]:
    """The grammar of ``response_format``, regex or ebnf; one at most."""
    given: dict[str, tuple[str, str]] = {}
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        given["response_format"] = ("json_schema", ANY_OBJECT)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise RequestError("response_format.json_schema is required with type 'json_schema'")
        schema = fmt.json_schema.schema_
        given["response_format.json_schema.schema"] = ("json_schema", ANY_OBJECT if schema is None
                                                       else json.dumps(schema))
    for kind in ("regex", "ebnf"):
        if (text := getattr(body, kind)) is not None:
            given[kind] = (kind, text)
    return _one_grammar(given)


def _one_grammar(given: dict[str, tuple[str, str]]) -> dict[str, str]:
    if len(given) > 1:
        raise RequestError(f"{' and '.join(given)} each ask for a grammar: give one of them")
    if not given:
        return {}
    (name, (kind, text)), = given.items()
    return {kind: text, "grammar_field": name}
