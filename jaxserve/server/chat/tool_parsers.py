"""Tool-call parsers: a model's output text -> content and tool-call deltas, fed as it streams.

One parser per choice, made by ``output.py``. ``--tool-call-parser`` picks the format a
model family writes when ``tool_choice`` is ``auto`` (vLLM's names):

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, after optional text;
- ``llama3_json`` (Llama 3.1+): an output that starts with ``{`` (or ``<|python_tag|>``) is
  calls, ``{"name": ..., "parameters": {...}}`` objects separated by ``;``;
- ``mistral``: optional text, then ``[TOOL_CALLS]`` and a JSON array of call objects, or
  (tokenizers from v11) ``[TOOL_CALLS]name[ARGS]{...}`` for each call, or
  ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`` (the call's id is then the model's).

``required`` and named choices are generated under a grammar (``tools.py``) and parsed by
``RequiredParser`` (a JSON array of calls) and ``NamedParser`` (the output is the arguments).

Every parser gives the same message whether its text arrives whole or a character at a time:
text that may still be the start of a marker is held back until the next delta decides it.
Text that looked like a call but is not one (no name) is sent as content when it ends.
"""

from __future__ import annotations

import json

from jaxserve.server.chat.tool_calls import (
    CallSequence,
    MessageDelta,
    ToolCallDelta,
    held_prefix,
    new_mistral_call_id,
)
from jaxserve.server.chat.tool_calls import new_call_id as new_call_id

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


class ToolParser:
    """Base: a buffer of text not yet decided, the calls found so far, and the rule for text
    around calls (whitespace before and between calls is dropped; anything else is content)."""

    new_call_id = staticmethod(new_call_id)  # the id of a call the model gave none

    def __init__(self, parallel: bool = True) -> None:
        self.calls = CallSequence(parallel, self.new_call_id)
        self._buffer = ""
        self._state = "start"
        self._is_between_calls = True  # whitespace here is dropped if a call follows
        self._call_prefix = ""  # sent before a call's text if it turns out not to be one

    @property
    def num_calls(self) -> int:
        return self.calls.num_calls

    def feed(self, text: str) -> MessageDelta:
        out = MessageDelta()
        self._buffer += text
        while self._step(out, is_final=False):
            pass
        return out

    def finish(self) -> MessageDelta:
        out = MessageDelta()
        while self._step(out, is_final=True):
            pass
        if self.calls.current is not None:  # cut short (max_tokens)
            text = self.calls.end(out)
            if text:
                out.content += self._call_prefix + text
        return out

    def _step(self, out: MessageDelta, is_final: bool) -> bool:
        """Consume some of the buffer; False when it must wait for more text (or, at the end,
        when nothing is left)."""
        raise NotImplementedError

    def _feed_call(self, out: MessageDelta, next_state: str) -> bool:
        taken = self.calls.feed(self._buffer, out)
        self._buffer = self._buffer[taken:]
        call = self.calls.current
        if call is None or not call.is_closed:
            return False
        text = self.calls.end(out)
        self._state = next_state
        self._is_between_calls = not text
        if text:
            self._not_a_call(out, self._call_prefix + text)
        return True

    def _not_a_call(self, out: MessageDelta, text: str) -> None:
        out.content += text

    def _skip_whitespace_before_call(self, marker: str, is_final: bool) -> bool | None:
        """Before or between calls, drop whitespace that leads to ``marker`` (or to the end).
        Returns False to wait, None when the buffer is now plain text to handle."""
        if not self._is_between_calls:
            return None
        rest = self._buffer.lstrip()
        if not rest:
            if is_final:
                self._buffer = ""
            return False
        if rest.startswith(marker):
            self._buffer = rest
            return None
        if marker.startswith(rest) and not is_final:
            return False
        self._is_between_calls = False
        return None


class HermesParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def _step(self, out: MessageDelta, is_final: bool) -> bool:
        if self._state in ("start", "text"):
            waiting = self._skip_whitespace_before_call(self.START, is_final)
            if waiting is not None:
                return waiting
            i = self._buffer.find(self.START)
            if i < 0:
                keep = 0 if is_final else held_prefix(self._buffer, self.START)
                out.content += self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return False
            out.content += self._buffer[:i]
            self._buffer = self._buffer[i + len(self.START) :]
            self._call_prefix = self.START
            self._state = "open"
            return True
        if self._state == "open":  # after <tool_call>: a call object must follow
            rest = self._buffer.lstrip()
            if not rest:
                self._call_prefix += self._buffer
                self._buffer = ""
                if is_final:
                    out.content += self._call_prefix
                return False
            if rest[0] != "{":  # not a call: the marker and the whitespace after it are text
                out.content += self._call_prefix + self._buffer[: len(self._buffer) - len(rest)]
                self._buffer = rest
                self._is_between_calls = False
                self._state = "text"
                return True
            self._call_prefix += self._buffer[: len(self._buffer) - len(rest)]
            self._buffer = rest
            self.calls.start()
            self._state = "call"
            return True
        if self._state == "call":
            return self._feed_call(out, "close")
        # "close": after the object, expect </tool_call> (a missing one is tolerated)
        rest = self._buffer.lstrip()
        if rest.startswith(self.END):
            if not self._is_between_calls:  # the block was not a call: all of it is content
                out.content += self._buffer[: len(self._buffer) - len(rest)] + self.END
            self._buffer = rest[len(self.END) :]
        elif self.END.startswith(rest) and not is_final:
            return False
        self._state = "text"
        return bool(self._buffer)


class Llama3JsonParser(ToolParser):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._is_tagged = False

    def _step(self, out: MessageDelta, is_final: bool) -> bool:
        if self._state == "start":  # calls if the output starts with { or the python tag
            rest = self._buffer.lstrip()
            if not self._is_tagged and rest.startswith(self.PYTHON_TAG):
                rest = rest[len(self.PYTHON_TAG) :].lstrip()
                self._is_tagged = True
            if self._is_tagged:
                # NOTE: whitespace after the tag is dropped, whether it comes with the tag or
                # in a later delta (vLLM strips it too).
                self._buffer = rest
            if not is_final and (
                not rest or (not self._is_tagged and self.PYTHON_TAG.startswith(rest))
            ):
                return False
            self._state = "between" if rest.startswith("{") else "content"
            return True
        if self._state == "between":  # calls are separated by ";"
            rest = self._buffer.lstrip(" \t\r\n;")
            self._buffer = rest
            if not rest:
                return False
            if rest[0] == "{":
                self.calls.start()
                self._state = "call"
            else:
                self._state = "content"
            return True
        if self._state == "call":
            return self._feed_call(out, "between")
        out.content += self._buffer
        self._buffer = ""
        return False

    def _not_a_call(self, out: MessageDelta, text: str) -> None:
        out.content += text  # an object that is not a call: the rest is content too
        self._state = "content"


class _ArrayParser(ToolParser):
    """A JSON array of call objects (Mistral after ``[TOOL_CALLS]``; ``required``)."""

    def _array_step(self, out: MessageDelta) -> bool:
        if self._state == "array":  # after "[" or a call: "," then "{", or "]"
            rest = self._buffer.lstrip(" \t\r\n,")
            self._buffer = rest
            if not rest:
                return False
            if rest[0] == "{":
                self.calls.start()
                self._state = "call"
            else:
                self._buffer = rest[1:] if rest[0] == "]" else rest
                self._state = "text"
            return True
        if self._state == "call":
            return self._feed_call(out, "array")
        raise AssertionError(self._state)

    def _open_array(self, out: MessageDelta, opened: str, is_final: bool) -> bool:
        """After ``opened`` (the marker, or nothing): ``[`` starts the array, ``{`` one call."""
        rest = self._buffer.lstrip()
        if not rest:
            if is_final:
                out.content += opened + self._buffer
                self._buffer = ""
            return False
        self._buffer = rest
        if rest[0] == "[":
            self._buffer = rest[1:]
            self._state = "array"
        elif rest[0] == "{":
            self.calls.start()
            self._state = "call"
        else:
            out.content += opened
            self._state = "text"
        return True


class _JsonObjectEnd:
    """Where a JSON object fed in pieces closes (strings and nesting tracked)."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escape = False

    def feed(self, text: str) -> int | None:
        """The length of ``text`` up to and including the object's closing brace, or None."""
        for i, char in enumerate(text):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None


class MistralParser(_ArrayParser):
    """``[TOOL_CALLS]`` then a JSON array of calls (tokenizers before v11), or, from v11,
    ``[TOOL_CALLS]name[ARGS]{...}`` or ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`` once per
    call (as mistral-common decodes them)."""

    MARKER = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    CALL_ID = "[CALL_ID]"
    new_call_id = staticmethod(new_mistral_call_id)
    MAX_NAME = 128  # a longer run of name (or id) characters before [ARGS] is text

    def _step(self, out: MessageDelta, is_final: bool) -> bool:
        if self._state == "open":
            rest = self._buffer.lstrip()
            if not rest or rest[0] in "[{":
                return self._open_array(out, self.MARKER, is_final)
            self._state = "name"
        if self._state == "name":
            return self._name_step(out, is_final)
        if self._state == "arguments":
            return self._arguments_step(out)
        return self._array_or_text_step(out, is_final)

    def _name_step(self, out: MessageDelta, is_final: bool) -> bool:
        """v11: the function's name, and maybe ``[CALL_ID]`` and the call's id, up to
        ``[ARGS]``; anything else is text."""
        i = self._buffer.find(self.ARGS)
        head = self._buffer[:i] if i >= 0 else self._buffer
        if i < 0 and not is_final:  # the start of [ARGS] or [CALL_ID] waits
            held = held_prefix(head, self.ARGS)
            if self.CALL_ID not in head:
                held = max(held, held_prefix(head, self.CALL_ID))
            head = head[: len(head) - held]
        name, _, call_id = (part.strip() for part in head.partition(self.CALL_ID))
        is_name = all(c.isalnum() or c in "_-." for c in name + call_id)
        if i < 0 and is_name and len(head) <= self.MAX_NAME and not is_final:
            return False
        args = self._buffer[i + len(self.ARGS) :].lstrip() if i >= 0 else ""
        if i >= 0 and not args and not is_final:  # is an object next?
            return False
        if i < 0 or not is_name or not name or (args and args[0] != "{"):
            out.content += self.MARKER
            self._state = "text"
            self._is_between_calls = False
            return True
        self._buffer = self._buffer[i + len(self.ARGS) :]
        self.calls.start(call_id or None)
        self.calls.feed(f'{{"name": {json.dumps(name)}, "arguments": ', out)
        self._arguments_end = _JsonObjectEnd()
        self._state = "arguments"
        return True

    def _arguments_step(self, out: MessageDelta) -> bool:
        end = self._arguments_end.feed(self._buffer)
        if end is None:
            self.calls.feed(self._buffer, out)
            self._buffer = ""
            return False
        self.calls.feed(self._buffer[:end] + "}", out)
        self._buffer = self._buffer[end:]
        self.calls.end(out)  # named by [TOOL_CALLS]name[ARGS]: always a call
        self._state = "text"
        self._is_between_calls = True
        return True

    def _array_or_text_step(self, out: MessageDelta, is_final: bool) -> bool:
        if self._state in ("start", "text"):
            waiting = self._skip_whitespace_before_call(self.MARKER, is_final)
            if waiting is not None:
                return waiting
            i = self._buffer.find(self.MARKER)
            if i < 0:
                keep = 0 if is_final else held_prefix(self._buffer, self.MARKER)
                out.content += self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return False
            out.content += self._buffer[:i]
            self._buffer = self._buffer[i + len(self.MARKER) :]
            self._state = "open"
            return True
        return self._array_step(out)


class RequiredParser(_ArrayParser):
    """``tool_choice: "required"``: the grammar makes the output a JSON array of
    ``{"name": ..., "parameters": {...}}`` objects."""

    def _step(self, out: MessageDelta, is_final: bool) -> bool:
        if self._state == "start":
            return self._open_array(out, "", is_final)
        if self._state == "text":
            waiting = self._skip_whitespace_before_call("[", is_final)
            if waiting is not None:
                return waiting
            out.content += self._buffer
            self._buffer = ""
            return False
        return self._array_step(out)


class NamedParser(ToolParser):
    """A named ``tool_choice``: the grammar makes the whole output the function's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _step(self, out: MessageDelta, is_final: bool) -> bool:
        if self._state == "start":
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            out.tool_calls.append(ToolCallDelta(0, id=new_call_id(), name=self.name))
            self.calls.num_calls = 1
            self._state = "arguments"
        # Trailing whitespace waits: it is sent only if more arguments follow it.
        text = self._buffer if is_final else self._buffer.rstrip()
        out.add_arguments(0, text.rstrip())
        self._buffer = self._buffer[len(text) :] if not is_final else ""
        return False


def make_tool_parser(name: str, parallel: bool) -> ToolParser:
    """The ``--tool-call-parser`` format for ``tool_choice: "auto"``."""
    parsers: dict[str, type[ToolParser]] = {
        "hermes": HermesParser,
        "llama3_json": Llama3JsonParser,
        "mistral": MistralParser,
    }
    return parsers[name](parallel)
