"""Tool calling and reasoning output through the OpenAI SDK over HTTP, with chosen model outputs.

``EchoCore`` stands behind the real ``AsyncEngine`` and app: it answers each chat with the text
of its last user message, tokenized by the demo model's tokenizer and sent one token per step,
so a test picks the exact output each parser sees, whole (non-streaming) and token by token
(streaming). It also records the prompt it was given and the ``SamplingParams`` the server
made, so the rendered chat template and the grammar of forced tool choices can be checked.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from jaxserve.cli import main
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.interfaces import EngineStats
from jaxserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.engine_config import EngineConfig, default_model_dir
from jaxserve.server.api.protocol import parse_chat_request
from jaxserve.server.chat.output import ChatOutputRules
from jaxserve.server.chat.tool_calls import MessageDelta
from jaxserve.server.launch.flags import settings_from_args
from jaxserve.server.launch.serve import run_launch
from jaxserve.server.settings import ServerSettings
from tests.conftest import tiny_server

MODEL = "echo"
DEMO = default_model_dir()
USER_TURN, END_TURN = "<|im_start|>user\n", "<|im_end|>"


class EchoCore:
    """A fake engine core: each request's output is the last user message of its prompt."""

    def __init__(self) -> None:
        self.config = EngineConfig(served_model_name=MODEL)
        self.model_config = None
        self.tokenizer = Tokenizer(DEMO)
        self.vocab_size = self.tokenizer.vocab_size
        self.max_model_len = 1024
        self.requests: list[dict] = []
        self.prompts: list[str] = []  # every prompt received, decoded with special tokens
        self.params: list = []  # the SamplingParams of each request
        self._lock = threading.Lock()

    def shutdown(self) -> None:
        pass

    def capacity_lines(self) -> list[str]:
        return ["KV cache size: 1,024 tokens"]

    class grammar_compiler:  # it echoes: constraints are not applied
        @staticmethod
        async def compile_async(spec, client=""):
            return None

    def add_request(self, request_id, prompt_token_ids, params, prompt=None, priority=0,
                    cache_salt=None, arrival_time=None, group_id=None):  # fmt: skip
        text = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
        reply = text[text.rindex(USER_TURN) + len(USER_TURN) :]
        reply = reply[: reply.index(END_TURN)]
        with self._lock:
            self.prompts.append(text)
            self.params.append(params)
            self.requests.append(
                {
                    "id": request_id,
                    "prompt": list(prompt_token_ids),
                    "params": params,
                    "reply": self.tokenizer.encode(reply, add_special_tokens=False),
                    "detokenizers": [
                        self.tokenizer.detokenizer(prompt_token_ids, params.skip_special_tokens)
                        for _ in range(params.n)
                    ],
                    "step": 0,
                    "metrics": RequestMetrics(arrival_time=arrival_time or time.time()),
                }
            )

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self.requests = [r for r in self.requests if r["id"] != request_id]

    is_sleeping = False  # no sleep mode

    def has_work(self) -> bool:
        return bool(self.requests)

    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def stats(self) -> EngineStats:
        return EngineStats(len(self.requests), 0, 0.0, 0, 0, 0, 0, 0, 0, 0)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.001)
        with self._lock:
            running = list(self.requests)
        outputs = []
        for request in running:
            k = request["step"]
            request["step"] += 1
            token = request["reply"][k]
            metrics = request["metrics"]
            metrics.first_scheduled_time = metrics.first_scheduled_time or time.time()
            metrics.first_token_time = metrics.first_token_time or time.time()
            reason = None
            if k + 1 == len(request["reply"]):
                reason = "stop"  # as if the model sent EOS next
            elif k + 1 == request["params"].max_tokens:
                reason = "length"
            samples = [
                CompletionOutput(j, d.add([token]), [token], finish_reason=reason)
                for j, d in enumerate(request["detokenizers"])
            ]
            if reason is not None:
                metrics.finished_time = time.time()
                with self._lock:
                    self.requests.remove(request)
            outputs.append(
                RequestOutput(
                    request["id"], None, request["prompt"], samples,
                    finished=reason is not None, metrics=metrics,
                )
            )  # fmt: skip
        return outputs


@pytest.fixture(scope="module")
def servers():
    """One echo server per parser configuration, started on first use."""
    started: dict[tuple, tuple] = {}
    with contextlib.ExitStack() as stack:

        def get(tool_call_parser=None, reasoning_parser=None):
            key = (tool_call_parser, reasoning_parser)
            if key not in started:
                core = EchoCore()
                engine = AsyncEngine(core)
                engine.start()
                stack.callback(engine.shutdown)
                settings = {
                    "enable_auto_tool_choice": tool_call_parser is not None,
                    "tool_call_parser": tool_call_parser,
                    "reasoning_parser": reasoning_parser,
                }
                server = stack.enter_context(tiny_server(MODEL, settings, engine=engine))
                client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
                stack.callback(client.close)
                started[key] = (client, core)
            return started[key]

        yield get


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, TIME]


def ask(client, output: str, **kwargs):
    """A chat whose (echoed) output is ``output``."""
    messages = [{"role": "user", "content": output}]
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def ask_streamed(client, output: str, **kwargs):
    """The chunks of a streamed chat, and the completion the OpenAI SDK assembles from them."""
    chunks = list(ask(client, output, stream=True, **kwargs))
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    return chunks, state.get_final_completion()


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


PARIS = {"city": "Paris", "days": 2}
ROME = {"city": 'Rome "eternal" {}'}
# parser -> [(model output, expected content, expected calls)]
OUTPUTS = {
    "hermes": [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            "</tool_call>",
            None,
            [("get_weather", PARIS)],
        ),
        (
            "Let me look.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome \\"eternal\\" {}"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
            "Let me look.\n",
            [("get_weather", PARIS), ("get_weather", ROME), ("get_time", {})],
        ),
    ],
    "llama3_json": [
        (
            '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
            None,
            [("get_weather", PARIS)],
        ),
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
            '{"name": "get_weather", "parameters": {"city": "Rome \\"eternal\\" {}"}}',
            None,
            [("get_weather", PARIS), ("get_weather", ROME)],
        ),
    ],
    "mistral": [
        (
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
            None,
            [("get_weather", PARIS)],
        ),
        (
            'Checking both. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris",'
            ' "days": 2}}, {"name": "get_weather", "arguments": {"city": "Rome \\"eternal\\" {}"}}'
            "]",
            "Checking both. ",
            [("get_weather", PARIS), ("get_weather", ROME)],
        ),
        (  # tokenizers from v11: [TOOL_CALLS]name[ARGS]{...} per call
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}',
            None,
            [("get_weather", PARIS)],
        ),
        (
            'Both. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome \\"eternal\\" {}"}'
            "[TOOL_CALLS]get_time[ARGS]{}",
            "Both. ",
            [("get_weather", PARIS), ("get_weather", ROME), ("get_time", {})],
        ),
        (  # v11 with the model's own call ids (mistral-common's [CALL_ID] form)
            '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", "days": 2}\n'
            "[TOOL_CALLS]get_time[CALL_ID]Z9y8X7w6v[ARGS]{}",
            None,
            [("get_weather", PARIS), ("get_time", {})],
        ),
    ],
}
CASES = [(parser, *case) for parser, cases in OUTPUTS.items() for case in cases]


@pytest.mark.parametrize(("parser", "output", "content", "calls"), CASES)
def test_auto_tool_calls_parse_whole_and_streamed(servers, parser, output, content, calls):
    client, _ = servers(parser)
    whole = ask(client, output, tools=TOOLS, tool_choice="auto").choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == content
    assert calls_of(whole.message) == calls
    assert len({c.id for c in whole.message.tool_calls}) == len(calls)

    chunks, assembled = ask_streamed(client, output, tools=TOOLS)  # no tool_choice: "auto"
    streamed = assembled.choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert (streamed.message.content or None) == content
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    # OpenAI's streaming shape: each call's first delta has its id, type and name; the
    # arguments follow in fragments, token by token.
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or []) if c.choices]
    for index in range(len(calls)):
        mine = [d for d in deltas if d.index == index]
        assert mine[0].id and mine[0].type == "function" and mine[0].function.name
        assert all(d.id is None and d.function.name is None for d in mine[1:])
    if calls[0][1]:
        assert len([d for d in deltas if d.index == 0]) > 3


@pytest.mark.parametrize("parser", sorted(OUTPUTS))
def test_text_without_a_call_is_content(servers, parser):
    client, _ = servers(parser)
    text = "The weather is {fine} [today] <tool> in Paris."
    whole = ask(client, text, tools=TOOLS).choices[0]
    assert whole.message.content == text and not whole.message.tool_calls
    assert whole.finish_reason == "stop"
    _, assembled = ask_streamed(client, text, tools=TOOLS)
    assert assembled.choices[0].message.content == text
    assert not assembled.choices[0].message.tool_calls


def test_tool_choice_none_leaves_calls_as_text(servers):
    client, core = servers("hermes")
    output = OUTPUTS["hermes"][0][0]
    choice = ask(client, output, tools=TOOLS, tool_choice="none").choices[0]
    assert choice.message.content == output and choice.finish_reason == "stop"
    assert core.params[-1].structured_outputs is None


def test_parallel_tool_calls_false_keeps_the_first_call(servers):
    client, _ = servers("hermes")
    output = OUTPUTS["hermes"][1][0]
    message = ask(client, output, tools=TOOLS, parallel_tool_calls=False).choices[0].message
    assert calls_of(message) == [("get_weather", PARIS)]


def test_a_call_cut_short_keeps_its_name_and_finish_reason_length(servers):
    client, core = servers("hermes")
    output = OUTPUTS["hermes"][0][0]
    cut = output.index('"Paris"')  # the output stops inside the arguments
    max_tokens = len(core.tokenizer.encode(output[:cut], add_special_tokens=False)) + 1
    choice = ask(client, output, tools=TOOLS, max_tokens=max_tokens).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments.startswith('{"city": "') and len(call.function.arguments) < 14


def test_n_choices_parse_separately(servers):
    client, _ = servers("mistral")
    output = OUTPUTS["mistral"][0][0]
    result = ask(client, output, tools=TOOLS, n=2)
    assert [calls_of(c.message) for c in result.choices] == [[("get_weather", PARIS)]] * 2
    _, assembled = ask_streamed(client, output, tools=TOOLS, n=2)
    assert [calls_of(c.message) for c in assembled.choices] == [[("get_weather", PARIS)]] * 2


def test_auto_asks_for_special_tokens_in_the_text(servers):
    client, core = servers("mistral")
    ask(client, "hi", tools=TOOLS)
    assert core.params[-1].skip_special_tokens is False


# -- forced choices: the grammar the server sends, and the output it parses ------------------


def test_required_choice_sends_an_array_grammar_and_parses_its_output(servers):
    client, core = servers()  # no auto flags needed
    output = (
        '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    choice = ask(client, output, tools=TOOLS, tool_choice="required").choices[0]
    assert calls_of(choice.message) == [("get_weather", PARIS), ("get_time", {})]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    schema = json.loads(core.params[-1].structured_outputs.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    weather, time_ = schema["items"]["anyOf"]
    assert weather["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert weather["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert time_["properties"]["parameters"] == {"type": "object"}
    assert core.params[-1].structured_outputs.reasoning_end == ()
    _, assembled = ask_streamed(client, output, tools=TOOLS, tool_choice="required")
    assert calls_of(assembled.choices[0].message) == calls_of(choice.message)
    ask(client, output, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert json.loads(core.params[-1].structured_outputs.json)["maxItems"] == 1


def test_named_choice_sends_the_parameters_schema_and_parses_the_arguments(servers):
    client, core = servers()
    named = {"type": "function", "function": {"name": "get_weather"}}
    output = ' {"city": "Paris", "days": 2}\n'
    choice = ask(client, output, tools=TOOLS, tool_choice=named).choices[0]
    assert calls_of(choice.message) == [("get_weather", PARIS)]
    assert choice.message.tool_calls[0].function.arguments == '{"city": "Paris", "days": 2}'
    assert choice.finish_reason == "stop"  # a named function: OpenAI's and vLLM's answer
    params = core.params[-1]
    assert json.loads(params.structured_outputs.json) == WEATHER["function"]["parameters"]
    _, assembled = ask_streamed(client, output, tools=TOOLS, tool_choice=named)
    assert calls_of(assembled.choices[0].message) == [("get_weather", PARIS)]


def test_required_grammar_keeps_refs_and_definitions_resolvable(servers):
    client, core = servers()
    item = {"type": "object", "properties": {"sku": {"type": "string"}}}
    order = {
        "type": "function",
        "function": {
            "name": "order",
            "parameters": {
                "type": "object",
                "$defs": {"item": item},
                "properties": {
                    "items": {"type": "array", "items": {"$ref": "#/$defs/item"}},
                    "again": {"$ref": "#/properties/items"},
                },
            },
        },
    }
    ask(client, "[]", tools=[WEATHER, order], tool_choice="required")
    schema = json.loads(core.params[-1].structured_outputs.json)
    assert schema["$defs"] == {"item": item}
    parameters = schema["items"]["anyOf"][1]["properties"]["parameters"]
    assert parameters["properties"]["items"]["items"] == {"$ref": "#/$defs/item"}
    again = parameters["properties"]["again"]["$ref"]
    assert again == "#/items/anyOf/1/properties/parameters/properties/items"


# -- reasoning -------------------------------------------------------------------------------

REASONING = {
    # parser -> [(model output, reasoning, content)]
    "qwen3": [
        ("<think>\nThe user greets.\n</think>\n\nHello!", "The user greets.\n", "Hello!"),
        ("Hello without thinking.", None, "Hello without thinking."),
        ("<think>Still thinking when cut", "Still thinking when cut", None),
    ],
    "deepseek_r1": [
        ("The user greets.\n</think>\n\nHello!", "The user greets.\n", "Hello!"),
        ("<think>The user greets.</think>Hello!", "The user greets.", "Hello!"),
        ("Only reasoning, no end", "Only reasoning, no end", None),
    ],
}
REASONING_CASES = [(parser, *case) for parser, cases in REASONING.items() for case in cases]


@pytest.mark.parametrize(("parser", "output", "reasoning", "content"), REASONING_CASES)
def test_reasoning_split_whole_and_streamed(servers, parser, output, reasoning, content):
    client, _ = servers(reasoning_parser=parser)
    message = ask(client, output).choices[0].message
    assert message.model_extra["reasoning_content"] == reasoning
    assert (message.content or None) == content
    chunks, assembled = ask_streamed(client, output)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert (streamed or None) == reasoning
    assert (assembled.choices[0].message.content or None) == content
    if reasoning:
        assert sum(1 for d in deltas if d.model_extra.get("reasoning_content")) > 2


def test_reasoning_then_tool_call_and_the_message_sent_back(servers):
    client, core = servers("hermes", "qwen3")
    output = "<think>Weather needs a tool.</think>\n" + OUTPUTS["hermes"][0][0]
    choice = ask(client, output, tools=TOOLS).choices[0]
    assert choice.message.model_extra["reasoning_content"] == "Weather needs a tool."
    assert calls_of(choice.message) == [("get_weather", PARIS)]
    assert choice.finish_reason == "tool_calls"
    _, assembled = ask_streamed(client, output, tools=TOOLS)
    assert calls_of(assembled.choices[0].message) == [("get_weather", PARIS)]
    # The SDK's message object goes back as it came, followed by the tool's result.
    call = choice.message.tool_calls[0]
    messages = [
        {"role": "user", "content": output},
        choice.message,
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        {"role": "user", "content": "Thanks."},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert reply.choices[0].message.content == "Thanks."
    assert "<tool_response>\nsunny\n</tool_response>" in core.prompts[-1]


def test_constraints_hold_at_once_for_a_model_that_cannot_reason(servers):
    """The demo model's vocabulary has no </think> token: it never closes a reasoning section,
    so a constraint that waited for one never applied (json_object returned Python code)."""
    client, core = servers(reasoning_parser="deepseek_r1")
    ask(client, "[]", tools=TOOLS, tool_choice="required")
    assert core.params[-1].structured_outputs.reasoning_end == ()
    output = '[{"name": "get_time", "parameters": {}}]'
    choice = ask(client, output, tools=TOOLS, tool_choice="required").choices[0]
    assert calls_of(choice.message) == [("get_time", {})]  # content, not reasoning
    assert choice.finish_reason == "tool_calls"
    ask(client, "x")  # no constraint: nothing to hold back
    assert core.params[-1].structured_outputs is None


class ReasoningVocabulary:
    """A reasoning model's tokenizer, as far as the rules read it: one id each for the tags."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return {"<think>": [7], "</think>": [8]}[text]


@pytest.mark.parametrize(
    ("parser", "kwargs", "prompt_end", "end", "start"),
    [
        ("qwen3", {}, "assistant\n", (8,), (7,)),  # the model's choice: <think> or the grammar
        ("qwen3", {}, "<think>\n", (8,), ()),  # the template opened the section
        ("deepseek_r1", {}, "assistant\n", (8,), ()),  # R1 always reasons first
        ("qwen3", {}, "<think>\n\n</think>\n\n", (), ()),  # the template closed it
        ("qwen3", {"enable_thinking": False}, "assistant\n", (), ()),  # the client turned it off
        ("deepseek_r1", {"thinking": False}, "assistant\n", (), ()),
    ],
)
def test_when_a_constraint_waits_for_the_reasoning(parser, kwargs, prompt_end, end, start):
    rules = ChatOutputRules(
        ServerSettings(served_model_names=(MODEL,), reasoning_parser=parser), ReasoningVocabulary()
    )
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_object"},
    }
    req = parse_chat_request(body | {"chat_template_kwargs": kwargs})
    spec = rules.params_for(req, req.params, "prompt " + prompt_end).structured_outputs
    assert (spec.reasoning_end, spec.reasoning_start) == (end, start)
    # The reply is content whenever the constraint holds from the first token.
    message = rules.parser(req, "prompt " + prompt_end).parse_all('{"a": 1}')
    assert message.content == ('{"a": 1}' if not end or start else "")


# -- the chat template -----------------------------------------------------------------------


def test_chat_template_renders_tools_tool_calls_and_tool_results(servers):
    client, core = servers()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "20 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "25 C"},
        {"role": "user", "content": "ok"},
    ]
    client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none")
    prompt = core.prompts[-1]
    assert prompt.startswith("<|bos|><|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" in prompt and '"name": "get_weather"' in prompt
    assert '"name": "get_time"' in prompt
    assert prompt.count("<|im_start|>system") == 1
    assert (
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n20 C\n</tool_response>\n<tool_response>\n25 C\n"
        "</tool_response><|im_end|>\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
    ) in prompt
    # Without tools the template is plain ChatML, as the model was trained.
    client.chat.completions.create(model=MODEL, messages=messages[:2])
    assert core.prompts[-1] == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        "Weather in Paris and Rome?<|im_end|>\n<|im_start|>assistant\n"
    )


# -- bad input ---------------------------------------------------------------------------------


def function(name="f", **fields):
    return {"type": "function", "function": {"name": name, **fields}}


NAMED = {"type": "function", "function": {"name": "get_weather"}}
# (request fields, param named by the 400)
BAD_TOOLS = {
    "tools-not-array": ({"tools": {"a": 1}}, "tools"),
    "tool-not-object": ({"tools": ["get_weather"], "tool_choice": "none"}, "tools[0]"),
    "tool-not-function": ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    "tool-without-function": ({"tools": [{"type": "function"}]}, "tools[0].function"),
    "tool-unknown-field": ({"tools": [{**WEATHER, "x": 1}]}, "tools[0].x"),
    "function-unknown-field": ({"tools": [function(parameter={})]}, "tools[0].function.parameter"),
    "name-missing": ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    "name-with-space": ({"tools": [function("get weather")]}, "tools[0].function.name"),
    "name-too-long": ({"tools": [function("f" * 65)]}, "tools[0].function.name"),
    "duplicate-names": ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    "description-not-string": (
        {"tools": [function(description=1)]},
        "tools[0].function.description",
    ),
    "strict-not-boolean": ({"tools": [function(strict="yes")]}, "tools[0].function.strict"),
    "parameters-not-object": ({"tools": [function(parameters=[])]}, "tools[0].function.parameters"),
    "parameters-not-type-object": (
        {"tools": [function(parameters={"type": "string"})]},
        "tools[0].function.parameters",
    ),
    "parameters-invalid-schema": (
        {
            "tools": [
                TIME,
                function(parameters={"type": "object", "properties": {"a": {"type": "strin"}}}),
            ]
        },
        "tools[1].function.parameters",
    ),
    "parameters-required-not-array": (
        {"tools": [function(parameters={"type": "object", "required": "a"})]},
        "tools[0].function.parameters",
    ),
    "parameters-dangling-ref": (
        {
            "tools": [
                function(parameters={"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}})
            ]
        },
        "tools[0].function.parameters",
    ),
    "parameters-remote-ref": (
        {"tools": [function(parameters={"$ref": "https://example.com/s.json"})]},
        "tools[0].function.parameters",
    ),
    "too-many-tools": ({"tools": [function(f"f{i}") for i in range(129)]}, "tools"),
    "choice-unknown-string": ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
    "choice-unknown-tool": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
    ),
    "choice-named-without-tools": ({"tool_choice": NAMED}, "tool_choice"),
    "choice-required-without-tools": ({"tool_choice": "required"}, "tool_choice"),
    "choice-malformed": ({"tools": TOOLS, "tool_choice": {"name": "get_weather"}}, "tool_choice"),
    "choice-number": ({"tools": TOOLS, "tool_choice": 1}, "tool_choice"),
    "parallel-not-boolean": ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    "auto-without-flags": ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    "tools-default-auto-without-flags": ({"tools": TOOLS}, "tools"),
    "legacy-functions": ({"functions": [{"name": "f"}]}, "functions"),
    "message-tool-calls-bad": (
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
        "messages[0].tool_calls[0]",
    ),
}


@pytest.mark.parametrize("case", list(BAD_TOOLS), ids=list(BAD_TOOLS))
def test_bad_tools_are_a_400_naming_the_field(servers, case):
    client, _ = servers()
    fields, param = BAD_TOOLS[case]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    response = httpx.post(f"{client.base_url}chat/completions", json=body, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"] and "Traceback" not in response.text
    if case == "auto-without-flags":
        assert "--enable-auto-tool-choice and --tool-call-parser" in error["message"]


# -- flags -------------------------------------------------------------------------------------


def test_launch_flags_for_tools_and_reasoning(capsys):
    from jaxserve.cli import build_parser

    argv = ["launch", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--reasoning-parser", "qwen3"]  # fmt: skip
    settings = settings_from_args(build_parser(argv).parse_args(argv), "m")
    assert settings.enable_auto_tool_choice and settings.tool_call_parser == "hermes"
    assert settings.reasoning_parser == "qwen3"
    argv = ["launch", "--enable-auto-tool-choice"]
    assert run_launch(build_parser(argv).parse_args(argv)) == 2  # before loading anything
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser"):
        assert flag in text, flag
    assert "{hermes,llama3_json,mistral}" in text and "{deepseek_r1,qwen3}" in text


@pytest.mark.parametrize(("parser", "output", "content", "calls"), CASES)
def test_parsers_give_the_same_message_however_the_text_is_cut(parser, output, content, calls):
    """Fed a character at a time, a parser gives exactly what it gives for the whole text."""
    from jaxserve.server.chat.tool_parsers import make_tool_parser

    def parse(pieces: list[str]) -> tuple[str, list[tuple[str | None, str]]]:
        tool_parser = make_tool_parser(parser, parallel=True)
        message = MessageDelta()
        for piece in pieces:
            message.extend(tool_parser.feed(piece))
        message.extend(tool_parser.finish())
        return message.content, [(d.name, d.arguments) for d in message.tool_calls]

    whole = parse([output])
    assert parse(list(output)) == whole
    assert whole[0] == (content or "") and [name for name, _ in whole[1]] == [c for c, _ in calls]


@pytest.mark.parametrize(
    ("parser", "text", "content", "num_calls"),
    [
        ("llama3_json", "<|python_tag|> It is sunny.", "It is sunny.", 0),
        ("llama3_json", " <|python_tag|>\n\n It is sunny.", "It is sunny.", 0),
        ("llama3_json", '<|python_tag|>\n {"name": "get_time", "parameters": {}}', "", 1),
        ("llama3_json", "<|python_tag|>   ", "", 0),
        ("hermes", "<tool_call> <tool_call>", "<tool_call> <tool_call>", 0),
        (
            "hermes",
            '<tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
            "<tool_call>\n",
            1,
        ),
    ],
)
def test_whitespace_after_a_marker_is_the_same_whole_and_streamed(
    parser, text, content, num_calls
) -> None:
    """Whitespace after llama3's ``<|python_tag|>`` is dropped (as vLLM strips it) whether it
    arrives with the tag or in a later delta; after a Hermes ``<tool_call>`` that opens no
    call it is content. Each used to differ between a streamed and a whole output."""
    from jaxserve.server.chat.tool_parsers import make_tool_parser

    for pieces in ([text], list(text), [text[:15], text[15:]]):
        tool_parser = make_tool_parser(parser, parallel=True)
        message = MessageDelta()
        for piece in pieces:
            message.extend(tool_parser.feed(piece))
        message.extend(tool_parser.finish())
        assert (message.content, len(message.tool_calls)) == (content, num_calls), pieces


@pytest.mark.parametrize(
    "text",
    [
        "[TOOL_CALLS] is how the marker looks",
        "[TOOL_CALLS]get_weather",  # no [ARGS] before the end
        "Use [TOOL_CALLS]get_weather[AR",
        "[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e",  # an id, then the end
        "[TOOL_CALLS]get_weather[CALL_ID]not an id[ARGS]{}",
        '[TOOL_CALLS]get_weather[ARGS], "arguments": {"a": 1}',  # no object after [ARGS]
    ],
)
def test_mistral_marker_without_a_call_stays_text(text) -> None:
    from jaxserve.server.chat.tool_parsers import make_tool_parser

    for pieces in ([text], list(text)):
        tool_parser = make_tool_parser("mistral", parallel=True)
        message = MessageDelta()
        for piece in pieces:
            message.extend(tool_parser.feed(piece))
        message.extend(tool_parser.finish())
        assert message.content == text and not message.tool_calls


def test_mistral_v11_calls_keep_the_first_without_parallel_calls() -> None:
    from jaxserve.server.chat.tool_parsers import make_tool_parser

    text = '[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'
    tool_parser = make_tool_parser("mistral", parallel=False)
    message = tool_parser.feed(text)
    message.extend(tool_parser.finish())
    assert [(d.name, d.arguments) for d in message.tool_calls] == [("get_time", "{}")]
    assert message.content == ""


def test_mistral_v11_call_ids_are_the_models(servers) -> None:
    """``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}``: the call's id is the one the model wrote,
    whole and streamed; a call without one gets a fresh id of nine letters and digits, the
    only form Mistral's chat templates take back in a tool message (as vLLM makes them)."""
    output = (
        '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", "days": 2}'
        "[TOOL_CALLS]get_time[ARGS]{}"
    )
    client, _ = servers("mistral")
    whole = ask(client, output, tools=TOOLS).choices[0].message
    assert calls_of(whole) == [("get_weather", PARIS), ("get_time", {})]
    ids = [c.id for c in whole.tool_calls]
    assert ids[0] == "a1B2c3D4e" and re.fullmatch("[A-Za-z0-9]{9}", ids[1])
    _, assembled = ask_streamed(client, output, tools=TOOLS)
    streamed = assembled.choices[0].message.tool_calls
    assert streamed[0].id == "a1B2c3D4e" and re.fullmatch("[A-Za-z0-9]{9}", streamed[1].id)
