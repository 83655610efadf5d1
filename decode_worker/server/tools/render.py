"""A chat with tools as the model's prompt."""
from __future__ import annotations

import json

from decode_worker.core.request import RequestError
from decode_worker.model.tokenizer import Tokenizer
from decode_worker.server.schemas import ChatMessage, ContentPart, Tool, ToolCallMessage
from decode_worker.server.tools.parsers import ToolFormat

TOOLS_INTRO = ("# Tools\n\nYou may call functions to help with the user's request. Each function's JSON definition "
               "is listed in <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, write a JSON object "
               "with its name and arguments between <tool_call></tool_call> tags, one call per pair of tags:\n"
               '<tool_call>\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n</tool_call>')


def chat_prompt(tokenizer: Tokenizer, messages: list[ChatMessage], tools: list[Tool], fmt: ToolFormat) -> list[int]:
    """The prompt's token ids; a malformed conversation is refused."""
    _check_results(messages)
    template = tokenizer.chat_template
    native = fmt.marker in template and "tools" in template
    try:
        if native:
            return tokenizer.apply_chat_template([_native(m, i) for i, m in enumerate(messages)],
                                                 tools=[t.model_dump(exclude_none=True) for t in tools] or None)
        return tokenizer.apply_chat_template(_hermes(messages, tools))
    except ValueError as e:
        raise RequestError(str(e)) from e


def message_text(content: str | list[ContentPart] | None) -> str:
    """Text parts joined; other parts are refused."""
    if not isinstance(content, list):
        return content or ""
    other = sorted({p.type for p in content} - {"text"})
    if other:
        raise RequestError(f"messages: content parts of type {', '.join(map(repr, other))} are not supported "
                           "(text parts only)")
    return "".join(p.text or "" for p in content)


def _check_results(messages: list[ChatMessage]) -> None:
    """Tool messages answer earlier calls; only assistants call."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise RequestError(f"messages[{i}].tool_calls: only an assistant message makes calls (role is {m.role!r})")
        called.update(c.id for c in m.tool_calls or [])
        if m.role == "tool" and m.tool_call_id not in called:
            what = "is missing" if m.tool_call_id is None else f"{m.tool_call_id!r} answers no earlier call"
            raise RequestError(f"messages[{i}].tool_call_id {what}: a tool message is the result of an assistant's "
                               "tool call")


def _arguments(call: ToolCallMessage, i: int) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise RequestError(f"messages[{i}].tool_calls: the arguments of call {call.id!r} are not a JSON object")
    return arguments


def _native(m: ChatMessage, i: int) -> dict:
    out: dict = {"role": m.role, "content": message_text(m.content)}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c, i)}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _hermes(messages: list[ChatMessage], tools: list[Tool]) -> list[dict]:
    out: list[dict] = []
    first = 0
    if tools:
        listing = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
        intro = TOOLS_INTRO.format(tools=listing)
        if messages[0].role == "system":
            intro, first = message_text(messages[0].content) + "\n\n" + intro, 1
        out.append({"role": "system", "content": intro})
    for i, m in enumerate(messages[first:], first):
        text = message_text(m.content)
        if m.role == "tool":
            result = f"<tool_response>\n{text}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "tool_results": True})
            continue
        calls = [json.dumps({"name": c.function.name, "arguments": _arguments(c, i)}, ensure_ascii=False)
                 for c in m.tool_calls or []]
        text = "\n".join([text] * bool(text) + [f"<tool_call>\n{call}\n</tool_call>" for call in calls])
        out.append({"role": m.role, "content": text})
    return [{"role": m["role"], "content": m["content"]} for m in out]
