"""Tool calls as they are generated: the deltas a chat response carries, and the scanner that
finds a call object (``{"name": ..., "arguments": {...}}``) in text that arrives a token at a
time.

Used by the output-format parsers in ``tool_parsers.py``; their deltas go to ``output.py``,
which turns them into OpenAI's ``message.tool_calls`` and streamed ``delta.tool_calls``.

# NOTE: partial-json-parser was considered for streamed arguments and not used. It re-parses the
# whole buffer for each token and re-serializes what it found, so a streamer must diff the
# re-serialized prefix (which is not stable: ``1`` may become ``12``, a string may grow) and the
# streamed arguments come out re-formatted, unlike the non-streamed ones. The scanner below
# reads each character once, tracking only nesting and strings, and sends the model's own
# argument text: the streamed fragments reassemble byte for byte to the non-streamed string.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import string
import uuid
from collections.abc import Callable

_WHITESPACE = " \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes and Mistral say arguments, Llama parameters


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def new_mistral_call_id() -> str:
    """Nine letters and digits: the only form Mistral's chat templates accept back in a
    ``tool_call_id`` (as vLLM's mistral parser makes them)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclasses.dataclass
class ToolCallDelta:
    """A piece of one tool call: its first delta carries ``id`` and ``name``; the following
    ones carry fragments of ``arguments`` (a JSON text), as OpenAI streams them."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclasses.dataclass
class MessageDelta:
    """What one step of output adds to an assistant message."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def add_arguments(self, index: int, text: str) -> None:
        if not text:
            return
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == index:
            last.arguments += text
        else:
            self.tool_calls.append(ToolCallDelta(index, text))

    def extend(self, other: MessageDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        for call in other.tool_calls:
            last = self.tool_calls[-1] if self.tool_calls else None
            if call.name is None and last is not None and last.index == call.index:
                last.arguments += call.arguments
            else:
                self.tool_calls.append(dataclasses.replace(call))

    @property
    def is_empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls)


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class CallObject:
    """One generated call object, fed from its opening brace as it arrives.

    Tracks nesting and strings only; at the object's own level it records each key and where
    its value starts and ends, so the name is known as soon as its string closes and the
    arguments can be sent while they are still being generated.
    """

    def __init__(self) -> None:
        self.text = ""
        self.is_closed = False
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect = "key"  # at the object's level: key, colon, value or comma
        self._key = ""
        self._key_start = -1
        self._value_start = -1
        self._spans: dict[str, tuple[int, int | None]] = {}  # key -> value [start, end)
        self._name: str | None = None
        self._num_args_sent = 0
        self._is_args_done = False

    def feed(self, text: str) -> int:
        """Scan ``text``; returns how much of it belongs to the object (all of it until the
        closing brace)."""
        base = len(self.text)
        self.text += text
        for i, char in enumerate(text):
            pos = base + i
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == '"':
                    self._in_string = False
                    if self._depth == 1:
                        self._end_string(pos + 1)
                continue
            if char in _WHITESPACE:
                continue
            if self._depth == 1 and self._expect == "value" and self._value_start < 0:
                self._value_start = pos
                self._spans[self._key] = (pos, None)
            if char == '"':
                self._in_string = True
                if self._depth == 1 and self._expect == "key":
                    self._key_start = pos
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 1:
                    self._end_value(pos + 1)
                elif self._depth <= 0:
                    self._end_value(pos)
                    self.is_closed = True
                    self.text = self.text[: pos + 1]
                    return i + 1
            elif self._depth == 1 and char == ":" and self._expect == "colon":
                self._expect = "value"
            elif self._depth == 1 and char == ",":
                self._end_value(pos)
                self._expect = "key"
        return len(text)

    def _end_string(self, end: int) -> None:
        if self._expect == "key":
            key = _loads(self.text[self._key_start : end], "")
            self._key = key if isinstance(key, str) else ""
            self._expect = "colon"
        elif self._expect == "value":
            self._end_value(end)

    def _end_value(self, end: int) -> None:
        if self._expect == "value" and self._value_start >= 0:
            self._spans[self._key] = (self._value_start, end)
            self._value_start = -1
            self._expect = "comma"

    @property
    def name(self) -> str | None:
        """The function's name, once its string has closed."""
        if self._name is None:
            start, end = self._spans.get("name", (0, None))
            if end is not None:
                name = _loads(self.text[start:end], None)
                self._name = name if isinstance(name, str) and name else None
        return self._name

    def take_arguments(self) -> str:
        """Argument text not taken yet: an object's text as it grows; a string's value (some
        models send the arguments JSON-encoded) or anything else once it has ended."""
        span = next((self._spans[k] for k in ARGUMENT_KEYS if k in self._spans), None)
        if span is None or self._is_args_done:
            return ""
        start, end = span
        if self.text[start] == "{":
            stop = len(self.text) if end is None else end
            piece = self.text[start + self._num_args_sent : stop]
            self._num_args_sent += len(piece)
            self._is_args_done = end is not None
            return piece
        if end is None:
            return ""
        self._is_args_done = True
        raw = self.text[start:end].strip()
        value = _loads(raw, None)
        return value if isinstance(value, str) else raw

    def take_final_arguments(self) -> str:
        """What is left once the object closed; ``{}`` when it had no arguments."""
        has_args = any(k in self._spans for k in ARGUMENT_KEYS)
        rest = self.take_arguments()
        if not has_args and not self._is_args_done:
            self._is_args_done = True
            return "{}"
        return rest


def _loads(text: str, default: object) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # a model's output may nest past Python's limit
        return default


class CallSequence:
    """The calls of one output, numbered as OpenAI numbers them: the object being scanned,
    the deltas it yields, and what to do with one that turns out not to be a call."""

    def __init__(self, parallel: bool, make_id: Callable[[], str] = new_call_id) -> None:
        self.parallel = parallel  # False: keep the first call only (parallel_tool_calls)
        self.make_id = make_id  # the id of a call the model gave none
        self.num_calls = 0
        self.current: CallObject | None = None
        self._index: int | None = None  # the current object's call index; -1: dropped
        self._call_id: str | None = None  # the id the model gave the current call, if any

    def start(self, call_id: str | None = None) -> None:
        self.current = CallObject()
        self._index = None
        self._call_id = call_id

    def feed(self, text: str, out: MessageDelta) -> int:
        """Feed the current object; returns how much of ``text`` it took."""
        assert self.current is not None
        taken = self.current.feed(text)
        self._emit(out)
        return taken

    def _emit(self, out: MessageDelta) -> None:
        call = self.current
        assert call is not None
        if self._index is None:
            name = call.name
            if name is None:
                return
            if self.num_calls and not self.parallel:
                self._index = -1
                return
            self._index = self.num_calls
            self.num_calls += 1
            call_id = self._call_id or self.make_id()
            out.tool_calls.append(ToolCallDelta(self._index, id=call_id, name=name))
        if self._index >= 0:
            out.add_arguments(self._index, call.take_arguments())

    def end(self, out: MessageDelta) -> str:
        """Close the current object (complete or cut short); returns its text when it was not
        a call (the caller sends it as content), else ""."""
        call = self.current
        assert call is not None
        self.current = None
        if self._index is None:
            return call.text
        if self._index >= 0 and call.is_closed:
            out.add_arguments(self._index, call.take_final_arguments())
        return ""
