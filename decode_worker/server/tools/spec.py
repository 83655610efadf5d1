"""What a chat request asks of tools."""
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
        """A required call's array reader, else the format's."""
        return ArrayReader(self.names) if self.required else self.fmt.reader(self.names)

    def stop(self) -> list[str]:
        """After one call, unless parallel or required."""
        return [self.fmt.call_end] if not (self.required or self.parallel) else []

    def json_schema(self) -> str | None:
        """A required call's schema: an array of name/arguments objects."""
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
    """``--tool-call-parser``: by name, or the template's (default Hermes)."""
    if flag != "auto":
        return FORMATS[flag]
    return next((f for f in FORMATS.values() if f.marker in template), FORMATS[DEFAULT_FORMAT])


def tool_plan(body: ChatCompletionRequest, fmt: ToolFormat) -> ToolPlan | None:
    """The plan, or None when nothing is called; 400 when unmeetable."""
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
