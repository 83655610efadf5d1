"""A chat answer with tools, whole or as deltas."""
from __future__ import annotations

from decode_worker.server.tools.parsers import Item, Reader, ToolCall, read_all
from decode_worker.server.tools.spec import ToolPlan


def chat_message(plan: ToolPlan | None, text: str) -> dict:
    """The assistant message, calls parsed out with a plan."""
    if plan is None:
        return {"role": "assistant", "content": text}
    content, calls = read_all(plan.reader(), text)
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.message() for c in calls]
    return message


def finish_reason(reason: str | None, called: bool) -> str | None:
    """``tool_calls`` when an answer stopped by itself with calls."""
    return "tool_calls" if called and reason == "stop" else reason


class ChoiceDeltas:
    """One streamed choice: text in, chat deltas out."""

    def __init__(self, plan: ToolPlan | None):
        self.reader: Reader | None = plan.reader() if plan is not None else None
        self.calls = 0

    def feed(self, text: str) -> list[dict]:
        if self.reader is None:
            return [{"content": text}] if text else []
        return self._deltas(self.reader.feed(text))

    def finish(self) -> list[dict]:
        return self._deltas(self.reader.finish()) if self.reader is not None else []

    @property
    def called(self) -> bool:
        return self.calls > 0

    def _deltas(self, items: list[Item]) -> list[dict]:
        out = []
        for item in items:
            if isinstance(item, ToolCall):
                out += self._call(item)
            elif item:
                out.append({"content": item})
        return out

    def _call(self, call: ToolCall) -> list[dict]:
        index, self.calls = self.calls, self.calls + 1
        head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        return [{"tool_calls": [head]}, {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]
