"""Chat output rules: what a request's tools and the server's parsers do to its sampling
parameters, and how each choice's generated text becomes an assistant message.

Built once per server (``ServingContext.chat_output``) from ``--enable-auto-tool-choice``,
``--tool-call-parser`` and ``--reasoning-parser``. ``completions.py`` asks it to check a request and
adjust its ``SamplingParams`` (the grammar of a forced tool choice, ``reasoning_end``), then
makes one ``ChoiceParser`` per choice and sends what it yields: ``message`` /
``delta`` JSON with ``content``, ``reasoning_content`` and ``tool_calls``, and the finish reason
(``tool_calls`` when a choice that stopped called tools).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.server.api.errors import bad_request
from jaxserve.server.api.protocol import ChatRequest
from jaxserve.server.chat.reasoning import (
    THINK_END,
    THINK_START,
    ReasoningParser,
    is_reasoning_over,
    opens_reasoning,
)
from jaxserve.server.chat.tool_calls import MessageDelta, ToolCallDelta
from jaxserve.server.chat.tool_parsers import (
    NamedParser,
    RequiredParser,
    ToolParser,
    make_tool_parser,
)
from jaxserve.server.chat.tools import tool_calls_schema
from jaxserve.server.settings import ServerSettings

AUTO_NEEDS_FLAGS = (
    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
)


class ChoiceParser:
    """One choice's text -> message deltas: reasoning first, then tool calls in the rest."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @property
    def num_tool_calls(self) -> int:
        return self.tools.num_calls if self.tools is not None else 0

    def feed(self, text: str) -> MessageDelta:
        return self._parse(*self.reasoning.feed(text) if self.reasoning else ("", text))

    def finish(self) -> MessageDelta:
        delta = self._parse(*self.reasoning.finish() if self.reasoning else ("", ""))
        if self.tools is not None:
            delta.extend(self.tools.finish())
        return delta

    def _parse(self, reasoning: str, content: str) -> MessageDelta:
        if self.tools is None:
            return MessageDelta(reasoning, content)
        delta = self.tools.feed(content) if content else MessageDelta()
        delta.reasoning = reasoning
        return delta

    def parse_all(self, text: str) -> MessageDelta:
        message = self.feed(text)
        message.extend(self.finish())
        return message


class ChatOutputRules:
    def __init__(self, settings: ServerSettings, tokenizer: Tokenizer) -> None:
        # The format parsed for tool_choice "auto"; None: "auto" is refused.
        self.tool_call_parser = (
            settings.tool_call_parser if settings.enable_auto_tool_choice else None
        )
        self.reasoning_parser = settings.reasoning_parser
        self.tokenizer = tokenizer

    @functools.cached_property
    def reasoning_end(self) -> tuple[int, ...]:
        """The token ids of ``</think>`` (one id in Qwen3 and DeepSeek-R1 vocabularies)."""
        return tuple(self.tokenizer.encode(THINK_END, add_special_tokens=False))

    @functools.cached_property
    def reasoning_start(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(THINK_START, add_special_tokens=False))

    @functools.cached_property
    def model_reasons(self) -> bool:
        """Whether the model can write a reasoning section at all: a reasoning model's
        vocabulary holds ``</think>`` as one token; a model without one (the demo model, say)
        would spell it out of pieces only by chance, so nothing waits for it."""
        return self.reasoning_parser is not None and len(self.reasoning_end) == 1

    def reasons(self, req: ChatRequest, prompt: str) -> bool:
        """Whether this request's output may open with a reasoning section: not when the model
        cannot reason, the client turned thinking off (``chat_template_kwargs``
        ``enable_thinking`` / ``thinking`` false), or the prompt already closed the section."""
        kwargs = req.template_kwargs
        turned_off = kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False
        return self.model_reasons and not turned_off and not is_reasoning_over(prompt)

    def check(self, req: ChatRequest) -> None:
        choice = req.tool_choice
        if choice.mode == "auto" and self.tool_call_parser is None:
            if choice.is_sent:
                raise bad_request(AUTO_NEEDS_FLAGS, param="tool_choice")
            raise bad_request(
                f'tools without tool_choice means tool_choice "auto": {AUTO_NEEDS_FLAGS}; '
                'send tool_choice "none" (show the tools only), "required" or a named function',
                param="tools",
            )
        if choice.is_forced and req.params.structured_outputs is not None:
            raise bad_request(
                f'tool_choice "{choice.name or choice.mode}" makes the output tool calls; it '
                "cannot be combined with another output constraint (response_format)",
                param="tool_choice",
            )

    def params_for(self, req: ChatRequest, params: SamplingParams, prompt: str) -> SamplingParams:
        """The request's params with its tool choice's grammar, and any constraint held back
        until the reasoning section ends."""
        choice = req.tool_choice
        if choice.is_forced and req.tools:
            schema = tool_calls_schema(req.tools, choice)
            params = params.replace(structured_outputs=StructuredOutputsParams(json=schema))
        elif choice.mode == "auto":
            # NOTE: as in vLLM, markers such as [TOOL_CALLS] or <|python_tag|> are special
            # tokens in some vocabularies; the parser must see them in the text.
            params = params.replace(skip_special_tokens=False)
        constraint = params.structured_outputs
        if constraint is not None and self.reasoning_parser and self.reasons(req, prompt):
            # NOTE: qwen3's section is the model's choice (it reasons if it writes <think>
            # first), so the first token may be <think> or whatever the constraint allows; a
            # deepseek_r1 output, or a prompt the template ended with <think>, is reasoning
            # until </think>.
            is_optional = self.reasoning_parser == "qwen3" and not opens_reasoning(prompt)
            start = self.reasoning_start if is_optional and len(self.reasoning_start) == 1 else ()
            constraint = dataclasses.replace(
                constraint, reasoning_end=self.reasoning_end, reasoning_start=start
            )
            params = params.replace(structured_outputs=constraint)
        return params

    def parser(self, req: ChatRequest, prompt: str) -> ChoiceParser:
        choice = req.tool_choice
        tools: ToolParser | None = None
        if choice.mode == "function" and choice.name is not None:
            tools = NamedParser(choice.name)
        elif choice.mode == "required":
            tools = RequiredParser(choice.parallel)
        elif choice.mode == "auto" and self.tool_call_parser is not None:
            tools = make_tool_parser(self.tool_call_parser, choice.parallel)
        reasoning = None
        if self.reasoning_parser is not None:
            is_constrained = choice.is_forced or req.params.structured_outputs is not None
            reasons = not is_constrained or self.reasons(req, prompt)
            reasoning = ReasoningParser(self.reasoning_parser, prompt, reasons)
        return ChoiceParser(reasoning, tools)


def finish_reason(reason: str | None, parser: ChoiceParser) -> str | None:
    """OpenAI's ``tool_calls`` for a choice that stopped after calling tools it chose (``auto``
    or ``required``); a function named in ``tool_choice`` ends with ``stop``, as OpenAI and
    vLLM answer."""
    if isinstance(parser.tools, NamedParser):
        return reason
    return "tool_calls" if reason == "stop" and parser.num_tool_calls else reason


def message_json(message: MessageDelta, has_reasoning: bool) -> dict[str, Any]:
    calls: dict[int, dict[str, Any]] = {}
    for delta in message.tool_calls:
        call = calls.setdefault(
            delta.index,
            {"id": delta.id, "type": "function", "function": {"name": delta.name, "arguments": ""}},
        )
        call["function"]["arguments"] += delta.arguments
    result: dict[str, Any] = {
        "role": "assistant",
        "content": message.content if message.content or not calls else None,
    }
    if has_reasoning:
        result["reasoning_content"] = message.reasoning or None
    if calls:
        result["tool_calls"] = [calls[i] for i in sorted(calls)]
    return result


def delta_json(delta: MessageDelta) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if delta.reasoning:
        result["reasoning_content"] = delta.reasoning
    if delta.content:
        result["content"] = delta.content
    if delta.tool_calls:
        result["tool_calls"] = [_tool_call_delta(d) for d in delta.tool_calls]
    return result


def _tool_call_delta(delta: ToolCallDelta) -> dict[str, Any]:
    if delta.name is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    function = {"name": delta.name, "arguments": delta.arguments}
    return {"index": delta.index, "id": delta.id, "type": "function", "function": function}
