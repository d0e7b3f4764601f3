"""Reasoning parsers: ``<think>...</think>`` in a model's output -> ``reasoning_content``.

``--reasoning-parser`` (vLLM's names) picks the rule; one parser per choice, made by
``output.py`` with the rendered prompt, since templates may open (DeepSeek-R1, Qwen3
thinking models) or close (Qwen3 with ``enable_thinking: false``) the section themselves:

- ``qwen3``: the output is reasoning only if it starts with ``<think>``;
- ``deepseek_r1``: the output starts in reasoning, with or without ``<think>``.

Either way the reasoning ends at ``</think>``; without one it runs to the end of the output.
Whitespace just inside ``<think>`` and just after ``</think>`` is dropped. Like the tool parsers,
a parser gives the same split whether the text arrives whole or a character at a time.
"""

from __future__ import annotations

from jaxserve.server.chat.tool_calls import held_prefix

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"


def is_reasoning_over(prompt: str) -> bool:
    """True when the prompt itself closed the reasoning section (the template turned thinking
    off), so a constraint must not wait for a ``</think>`` that will not come."""
    return prompt.rstrip().endswith(THINK_END)


def opens_reasoning(prompt: str) -> bool:
    """True when the prompt itself opened the reasoning section (the output starts in it)."""
    return prompt.rstrip().endswith(THINK_START)


class ReasoningParser:
    def __init__(self, name: str, prompt: str, reasons: bool = True) -> None:
        """``reasons``: False when the output is constrained from its first token (the model
        cannot reason, the request turned thinking off, or the prompt closed the section):
        it is reasoning only if it opens with ``<think>`` (which the constraint forbids)."""
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}")
        self._starts_in_reasoning = name == "deepseek_r1" and reasons
        tail = prompt.rstrip()
        if not reasons:
            self._state = "start"
        elif tail.endswith(THINK_END):
            self._state = "content_start"
        elif tail.endswith(THINK_START):
            self._state = "reasoning_start"
        else:
            self._state = "start"
        self._buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        """Returns the ``(reasoning, content)`` this text adds."""
        self._buffer += text
        return self._run(is_final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(is_final=True)

    def _run(self, is_final: bool) -> tuple[str, str]:
        reasoning = content = ""
        while True:
            buffer = self._buffer
            if self._state == "start":  # does the output open a reasoning section?
                rest = buffer.lstrip()
                if rest.startswith(THINK_START):
                    self._buffer = rest[len(THINK_START) :]
                    self._state = "reasoning_start"
                elif not is_final and THINK_START.startswith(rest):
                    break
                else:
                    self._state = "reasoning_start" if self._starts_in_reasoning else "content"
            elif self._state in ("reasoning_start", "content_start"):
                rest = buffer.lstrip()
                if not rest and not is_final:
                    break
                self._buffer = rest
                self._state = self._state.removesuffix("_start")
            elif self._state == "reasoning":
                end = buffer.find(THINK_END)
                if end >= 0:
                    reasoning += buffer[:end]
                    self._buffer = buffer[end + len(THINK_END) :]
                    self._state = "content_start"
                    continue
                keep = 0 if is_final else held_prefix(buffer, THINK_END)
                reasoning += buffer[: len(buffer) - keep]
                self._buffer = buffer[len(buffer) - keep :]
                break
            else:
                content += buffer
                self._buffer = ""
                break
        return reasoning, content
