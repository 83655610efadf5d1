"""A request's grammar, from each API's fields, as ``SamplingParams``' grammar fields (``scheduler/grammar.py``)."""
from __future__ import annotations

import json

from decode_worker.core.request import RequestError
from decode_worker.server.schemas import OpenAISampling, SGLangSamplingParams

ANY_OBJECT = '{"type": "object"}'  # json_object, and a json_schema format without a schema


def generate_grammar(p: SGLangSamplingParams) -> dict[str, str]:
    """``/generate``'s sampling params: at most one of json_schema, regex and ebnf."""
    given = {f"sampling_params.{kind}": (kind, text) for kind in ("json_schema", "regex", "ebnf")
             if (text := getattr(p, kind)) is not None}
    return _one(given)


def openai_grammar(body: OpenAISampling) -> dict[str, str]:
    """OpenAI routes: ``response_format`` json_object/json_schema, or a regex or ebnf extra; one at most."""
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
    return _one(given)


def _one(given: dict[str, tuple[str, str]]) -> dict[str, str]:
    if len(given) > 1:
        raise RequestError(f"{' and '.join(given)} each ask for a grammar: give one of them")
    if not given:
        return {}
    (name, (kind, text)), = given.items()
    return {kind: text, "grammar_field": name}
