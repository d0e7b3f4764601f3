"""A response's ``output`` items, built from the chat output parser's message deltas, with the
streamed events that build them.

``serving.py`` feeds ``OutputItems.add`` what ``chat/output.ChoiceParser`` makes of the
generated text (reasoning, content, tool calls) and ends with ``close``: the same code builds
the non-streamed output (one delta, the whole text) and the streamed one (a delta per engine
step), so both give the same items. Reasoning is a ``reasoning`` item (its text a
``reasoning_text`` part), content a ``message`` with one ``output_text`` part, each tool call a
``function_call`` item. Each method returns the events of what it added, as the ``openai``
SDK's ``ResponseStreamEvent`` types hold them, without ``sequence_number`` (the writer numbers
them): an item is ``output_item.added``, its part ``content_part.added``, text deltas, then the
``.done`` events in the reverse order once the next item starts or the output ends.
"""

from __future__ import annotations

import uuid
from typing import Any

from jaxserve.server.chat.tool_calls import MessageDelta, ToolCallDelta

Event = dict[str, Any]


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []  # finished and open, in output order
        self.open: dict[str, Any] | None = None  # the item being written
        self.open_call: int | None = None  # the tool call index of an open function_call

    @property
    def reasoning_text(self) -> str:
        return "".join(
            part["text"]
            for item in self.items
            if item["type"] == "reasoning"
            for part in item["content"]
        )

    def add(self, delta: MessageDelta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls:
            events += self._call(call)
        return events

    def close(self, status: str) -> list[Event]:
        """End the open item with ``status`` (``completed``, or ``incomplete`` when cut)."""
        item = self.open
        if item is None:
            return []
        self.open, self.open_call = None, None
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        events: list[Event] = []
        if item["type"] == "function_call":
            args = item["arguments"]
            events.append(
                {"type": "response.function_call_arguments.done", **where, "arguments": args}
            )
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            text_done = {"type": f"response.{kind}.done", **where, "content_index": 0}
            text_done["text"] = part["text"]
            if kind == "output_text":
                text_done["logprobs"] = []
            events.append(text_done)
            events.append(
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part}
            )
        events.append(
            {
                "type": "response.output_item.done",
                "output_index": where["output_index"],
                "item": item,
            }
        )
        return events

    def _start(self, item: dict[str, Any]) -> list[Event]:
        self.items.append(item)
        self.open = item
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1}
        return [{**added, "item": {**item, "content": []} if "content" in item else dict(item)}]

    def _text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        item = self.open
        if item is None or item["type"] != kind:
            events += self.close("completed")
            if kind == "message":
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                item = {"id": item_id("msg"), "type": "message", "role": "assistant"}
            else:
                part = {"type": "reasoning_text", "text": ""}
                item = {"id": item_id("rs"), "type": "reasoning", "summary": []}
            item.update(status="in_progress", content=[part])
            events += self._start(item)
            where = {"item_id": item["id"], "output_index": len(self.items) - 1}
            events.append(
                {
                    "type": "response.content_part.added",
                    **where,
                    "content_index": 0,
                    "part": dict(part),
                }
            )
        item["content"][0]["text"] += text
        name = "output_text" if kind == "message" else "reasoning_text"
        delta = {"type": f"response.{name}.delta", "item_id": item["id"]}
        delta.update(output_index=len(self.items) - 1, content_index=0, delta=text)
        if kind == "message":
            delta["logprobs"] = []
        return [*events, delta]

    def _call(self, call: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if call.name is not None or self.open_call != call.index:
            events += self.close("completed")
            item = {
                "id": item_id("fc"),
                "type": "function_call",
                "call_id": call.id or item_id("call"),
            }
            item.update(name=call.name or "", arguments="", status="in_progress")
            events += self._start(item)
            self.open_call = call.index
        assert self.open is not None
        if call.arguments:
            self.open["arguments"] += call.arguments
            events.append(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": self.open["id"],
                    "output_index": len(self.items) - 1,
                    "delta": call.arguments,
                }
            )
        return events
