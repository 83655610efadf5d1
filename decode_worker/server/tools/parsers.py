"""Answers read back into tool calls, alike whole or streamed."""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text
    id: str = field(default_factory=new_call_id)

    def message(self) -> dict:
        """As a ``tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


Item = str | ToolCall  # content text, or a complete call


class Reader(Protocol):
    def feed(self, text: str) -> list[Item]: ...

    def finish(self) -> list[Item]: ...


def parse_call(text: str, names: frozenset[str]) -> ToolCall | None:
    """A call to one of ``names``, else None."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth; content, not a 500
        return None
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"} or not isinstance(obj["name"], str) \
            or obj["name"] not in names:
        return None
    arguments = obj["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class _Spacing:
    """Drops whitespace between content and a call."""

    def __init__(self) -> None:
        self.held = ""
        self.after_call = False

    def text(self, text: str) -> list[Item]:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return []
            self.after_call = False
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        return [body] if body else []

    def call(self, call: ToolCall) -> list[Item]:
        self.held, self.after_call = "", True
        return [call]

    def finish(self) -> list[Item]:
        held, self.held = self.held, ""
        return [held] if held else []


def _partial_tag(text: str, tag: str) -> int:
    """How much of ``text``'s end could start ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class _Strings:
    """Whether JSON read one character at a time stands inside a string."""

    inside: bool = False
    escaped: bool = False

    def read(self, ch: str) -> bool:
        """Take ``ch``; True when it is part of a string (its quotes included), so it is no syntax."""
        if self.inside:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.inside = False
            return True
        self.inside = ch == '"'
        return self.inside


class _EndTagScan:
    """Finds a call body's end tag outside JSON strings, reading each character once across deltas: the scan's
    place and whether it stands inside a string carry over, so a streamed body costs O(its length)."""

    def __init__(self, tag: str):
        self.tag = tag
        self.reset()

    def reset(self) -> None:
        self.at = 0
        self.strings = _Strings()

    def find(self, body: str) -> int:
        """Where the tag starts in ``body`` (the body so far, only ever extended), or -1."""
        at, tag = self.at, self.tag
        while at < len(body):
            ch = body[at]
            if not self.strings.read(ch) and ch == tag[0] and tag.startswith(body[at:at + len(tag)]):
                if len(body) - at >= len(tag):
                    return at
                break  # the tag may be arriving: read from here once more text has come
            at += 1
        self.at = at
        return -1


class TaggedReader:
    """Calls as JSON between tags (Hermes); an unclosed one counts once complete."""

    def __init__(self, names: frozenset[str], start: str = "<tool_call>", end: str = "</tool_call>"):
        self.names, self.start, self.end = names, start, end
        self.pending = ""
        self.inside = False
        self.end_scan = _EndTagScan(end)
        self.spacing = _Spacing()

    def feed(self, text: str) -> list[Item]:
        self.pending += text
        out: list[Item] = []
        while True:
            if not self.inside:
                at = self.pending.find(self.start)
                if at < 0:
                    cut = len(self.pending) - _partial_tag(self.pending, self.start)
                    ready, self.pending = self.pending[:cut], self.pending[cut:]
                    return out + (self.spacing.text(ready) if ready else [])
                out += self.spacing.text(self.pending[:at]) if at else []
                self.pending, self.inside = self.pending[at + len(self.start):], True
                self.end_scan.reset()
            else:
                at = self.end_scan.find(self.pending)
                if at < 0:
                    return out
                out += self._call(self.pending[:at], self.end)
                self.pending, self.inside = self.pending[at + len(self.end):], False

    def finish(self) -> list[Item]:
        out: list[Item] = []
        if self.inside:
            out += self._call(self.pending, "")
        elif self.pending:
            out += self.spacing.text(self.pending)
        self.pending, self.inside = "", False
        return out + self.spacing.finish()

    def _call(self, body: str, end: str) -> list[Item]:
        call = parse_call(body, self.names)
        if call is None:
            return self.spacing.text(self.start + body + end)
        return self.spacing.call(call)


class ArrayReader:
    """A JSON array of calls (constrained decoding's); the unparsable stays content."""

    def __init__(self, names: frozenset[str]):
        self.names = names
        self.text = ""
        self.depth = 0
        self.opened = self.broken = False
        self.strings = _Strings()
        self.element = -1  # where the open element starts, -1 while none is open
        self.done_to = 0  # what precedes this went out as a call or was array syntax
        self.spacing = _Spacing()

    def feed(self, text: str) -> list[Item]:
        out: list[Item] = []
        start, self.text = len(self.text), self.text + text
        for at in range(start, len(self.text)):
            if self.broken:
                break
            out += self._step(at, self.text[at])
        if self.broken:
            out += self.spacing.text(self.text[self.done_to:])
            self.done_to = len(self.text)
        return out

    def finish(self) -> list[Item]:
        cut = self.text[self.element:] if self.element >= 0 and not self.broken else ""
        self.element, self.done_to = -1, len(self.text)
        return (self.spacing.text(cut) if cut else []) + self.spacing.finish()

    def _step(self, at: int, ch: str) -> list[Item]:
        if self.depth >= 2:  # inside an element: only its nesting matters here, json.loads judges the rest
            if self.strings.read(ch):
                return []
            if ch in "[{":
                self.depth += 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1:
                    return self._close(at)
            return []
        if ch.isspace() or (self.depth == 1 and ch == ","):
            return []
        if self.depth == 0 and ch == "[" and not self.opened:
            self.opened, self.depth = True, 1
        elif self.depth == 1 and ch == "{":
            self.element, self.depth = at, 2
        elif self.depth == 1 and ch == "]":
            self.depth = 0
        else:
            self.broken = True
        return []

    def _close(self, at: int) -> list[Item]:
        body = self.text[self.element:at + 1]
        self.element, self.done_to = -1, at + 1
        call = parse_call(body, self.names)
        return self.spacing.call(call) if call is not None else self.spacing.text(body)


@dataclass(frozen=True)
class ToolFormat:
    """A call format: template marker, reader, call end."""

    name: str
    marker: str
    reader: Callable[[frozenset[str]], Reader]
    call_end: str


FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", "<tool_call>", TaggedReader, "</tool_call>"),
}
DEFAULT_FORMAT = "hermes"


def read_all(reader: Reader, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's content (None if empty) and calls."""
    items = reader.feed(text) + reader.finish()
    content = "".join(i for i in items if isinstance(i, str))
    return content or None, [i for i in items if isinstance(i, ToolCall)]
