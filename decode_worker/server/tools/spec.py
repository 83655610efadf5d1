"""What a chat request asks of tools: which functions the model may call, and whether it may, must, or must call
one named function. ``required`` and a named function are enforced by constrained decoding: the answer is held
to a JSON schema of an array of calls to the allowed functions, each with its own arguments schema, so even a
model that knows nothing of tools answers with a valid call."""
from __future__ import annotations

import json
from dataclasses import dataclass

from decode_worker.core.request import RequestError
from decode_worker.server.schemas import ChatCompletionRequest
from decode_worker.server.tools.parsers import DEFAULT_FORMAT, FORMATS, ArrayReader, Reader, ToolFormat

ANY_OBJECT = {"type": "object"}  # the arguments of a function declared without parameters


@dataclass(frozen=True)
class ToolPlan:
    functions: tuple[dict, ...]  # each offered function's definition: name, and description/parameters if given
    required: bool  # the model must call: tool_choice required or a named function
    parallel: bool  # more than one call allowed (parallel_tool_calls)
    fmt: ToolFormat  # how the model writes calls when it is free to

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f["name"] for f in self.functions)

    def reader(self) -> Reader:
        """Reads one choice's answer: the constrained JSON array when the call is required, else the model's own
        format."""
        return ArrayReader(self.names) if self.required else self.fmt.reader(self.names)

    def stop(self) -> list[str]:
        """Stop strings the answer needs: with parallel calls off and the model free, it stops after its first
        call."""
        return [self.fmt.call_end] if not (self.required or self.parallel) else []

    def json_schema(self) -> str | None:
        """The schema the answer is constrained to when a call is required: a non-empty array of calls (one when
        a function is named or parallel calls are off), each ``{"name": <allowed>, "arguments": <its schema>}``."""
        if not self.required:
            return None
        calls = [_call_schema(f) for f in self.functions]
        schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return json.dumps(schema)


def _call_schema(function: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": function.get("parameters") or ANY_OBJECT},
            "required": ["name", "arguments"], "additionalProperties": False}


def pick_format(flag: str, template: str) -> ToolFormat:
    """``--tool-call-parser``: a format by name, or ``auto``: the registered format whose call marker the model's
    chat template shows, else the default (Hermes)."""
    if flag != "auto":
        return FORMATS[flag]
    return next((f for f in FORMATS.values() if f.marker in template), FORMATS[DEFAULT_FORMAT])


def tool_plan(body: ChatCompletionRequest, fmt: ToolFormat) -> ToolPlan | None:
    """The request's tool plan, or None when the model is not to call anything (no tools, or tool_choice
    ``none``). Refuses (400 naming the field) a choice that cannot be met."""
    tools = body.tools or []
    functions = tuple(t.function.model_dump(exclude_none=True) for t in tools)
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise RequestError(f"tools: function name {twice!r} is given more than once")
    choice = body.tool_choice or "auto"
    if choice == "none" or (choice == "auto" and not tools):
        return None
    if not tools:
        raise RequestError(f"tool_choice {_describe(choice)} needs tools, and none were given")
    if isinstance(choice, str):
        return ToolPlan(functions, choice == "required", body.parallel_tool_calls, fmt)
    named = choice.function.name
    if named not in names:
        raise RequestError(f"tool_choice names function {named!r}, which is not among tools ({', '.join(names)})")
    return ToolPlan(tuple(f for f in functions if f["name"] == named), True, False, fmt)


def _describe(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"naming function {choice.function.name!r}"
