"""``/v1/chat/completions``: the route, its messages and tools (validated, rendered through the
chat template), and its output rules: generated text -> ``content``, ``reasoning_content`` and
``tool_calls`` (the tool-call and reasoning parsers), fed as it streams.
"""
