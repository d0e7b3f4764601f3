"""Forced tool choices on the demo model: whatever it samples, ``required`` and named choices
come back as calls that parse and validate against the function's parameters, because the
server hands the engine a JSON-schema grammar (``StructuredOutputsParams(json=...)``).

The demo model knows nothing of tools, so only the grammar can make these calls valid: the
tests sample at temperature 1 with several seeds, through the OpenAI SDK over HTTP.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.conftest import tiny_server

MODEL = "jaxserve-demo"
# Bounded parameters (enums, integer ranges, no free strings), so any output the grammar allows
# ends well within max_tokens.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CONVERT = {
    "type": "function",
    "function": {
        "name": "convert",
        "parameters": {
            "type": "object",
            "properties": {"celsius": {"type": "boolean"}},
            "required": ["celsius"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CONVERT]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What will the weather be in Paris?"}]


@pytest.fixture(scope="module")
def client():
    with (
        tiny_server(
            MODEL,
            model="",  # the demo model
            dtype="auto",
            max_model_len=1024,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            num_gpu_blocks_override=160,
        ) as server,
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as c,
    ):
        yield c


def assert_valid_calls(
    choice, names: set[str], may_be_cut: bool = False, finish_reason: str = "tool_calls"
) -> None:
    """Every call parses and validates; with ``may_be_cut``, an array of parallel calls that
    reached max_tokens may end in a call cut short (the grammar bounds each call, not their
    number), and the calls before it must still be valid."""
    calls = choice.message.tool_calls
    assert calls, choice.message
    if may_be_cut and choice.finish_reason == "length":
        calls = calls[:-1]
    else:
        assert choice.finish_reason == finish_reason, choice
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("parallel", [False, True])
def test_required_choice_always_gives_valid_calls(client, parallel):
    for seed in range(2):
        result = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            n=4,
            temperature=1.0,
            seed=seed,
            max_tokens=128 if parallel else 64,
        )
        for choice in result.choices:
            assert_valid_calls(choice, {"get_weather", "convert"}, may_be_cut=parallel)
            if not parallel:
                assert len(choice.message.tool_calls) == 1


def test_named_choice_always_gives_a_valid_call_whole_and_streamed(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    request = dict(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=named, n=4, max_tokens=64
    )
    for seed in range(2):
        result = client.chat.completions.create(**request, temperature=1.0, seed=seed)
        for choice in result.choices:
            assert_valid_calls(choice, {"get_weather"}, finish_reason="stop")
        state = ChatCompletionStreamState()
        for chunk in client.chat.completions.create(
            **request, temperature=1.0, seed=seed, stream=True
        ):
            state.handle_chunk(chunk)
        streamed = state.get_final_completion()
        for choice, whole in zip(streamed.choices, result.choices, strict=True):
            assert_valid_calls(choice, {"get_weather"}, finish_reason="stop")
            # The same seed gives the same tokens, so the same arguments.
            assert choice.message.tool_calls[0].function.arguments == (
                whole.message.tool_calls[0].function.arguments
            )


def test_the_readmes_examples_run_against_the_demo_model(client, capsys) -> None:
    """The Python of the README's first section (completions, chat, tool calling, JSON output,
    the SDK's parse), run as written against a server of the demo model."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = readme[: readme.index("## Serving a real model")]
    code = "\n".join(re.findall(r"```python\n(.*?)```", start, re.S))
    assert code.count("client.chat.completions") >= 5, "the README's examples moved"
    assert "stream=True" in code  # the streaming example runs too
    url = 'base_url="http://localhost:8000/v1"'
    assert url in code
    exec(compile(code.replace(url, f'base_url="{client.base_url}"'), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "get_weather {'city': " in printed
    assert "name=" in printed and "arguments=" in printed  # the parsed Function
    assert printed.rstrip().splitlines()[-1].strip() in ("yes", "no")
