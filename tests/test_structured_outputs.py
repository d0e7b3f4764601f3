"""Structured outputs end to end: constrained decoding on the tiny Llama fixture, whose random
weights would almost never write valid JSON, a regex match or a grammar's sentence by chance:
only the constraint makes the outputs valid.

Through the ``openai`` SDK over HTTP for the API's behaviour (every request spelling,
streaming, ``parse`` with a Pydantic model, 400s for bad input, a client that leaves), through
``jaxserve.LLM`` where a test needs one batch it controls (tokens unchanged beside constrained
requests, preemption, a reasoning section), and on each fixture tokenizer alone.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import httpx
import jsonschema
import numpy as np
import openai
import pydantic
import pytest

import jaxserve
from jaxserve import SamplingParams
from jaxserve.engine.grammar import GrammarCompiler, GrammarError
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.runner.step import SchedulerOutput
from jaxserve.sampling_params import StructuredOutputsParams
from tests.conftest import FAMILIES, fixture_dir, tiny_server, wait_for
from tests.test_engine import make_llm

MODEL = "tiny"
COMPILE_TIMEOUT_S = 1.0
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
        "scores": {"type": "array", "items": {"type": "integer", "maximum": 9}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
GBNF = 'root ::= greeting " " name\ngreeting ::= "hello" | "hi"\nname ::= [a-z] [a-z] [a-z]?'
GBNF_MATCH = r"(hello|hi) [a-z]{2,3}"
LARK = 'start: ("yes" | "no") "-" DIGIT DIGIT?\nDIGIT: /[0-9]/'
LARK_MATCH = r"(yes|no)-[0-9]{1,2}"


@pytest.fixture(scope="module")
def server():
    with tiny_server(
        MODEL,
        min_step_s=0.002,  # a long stream is still running when its client leaves
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=64,
        grammar_compile_timeout_s=COMPILE_TIMEOUT_S,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def llm() -> jaxserve.LLM:
    return make_llm()


def texts(completion) -> list[str]:
    return [choice.text for choice in completion.choices]


# -- outputs follow the constraint ---------------------------------------------------------


def test_a_hundred_sampled_outputs_under_a_json_schema_all_validate(client) -> None:
    result = client.completions.create(
        model=MODEL,
        prompt=["the river", "a b c", "42", "{"],
        n=25,
        temperature=1.0,
        seed=7,
        max_tokens=150,
        extra_body={"structured_outputs": {"json": PERSON}},
    )
    assert len(result.choices) == 100
    for choice in result.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.text), PERSON)
    assert len({c.text for c in result.choices}) > 10  # sampled, not one forced answer


def test_response_format_json_schema_and_json_object_on_chat_and_completions(client) -> None:
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "who?"}],
        n=4,
        temperature=0.9,
        seed=1,
        max_tokens=150,
        response_format=schema_format,  # type: ignore[arg-type]
    )
    for choice in chat.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    completion = client.completions.create(
        model=MODEL,
        prompt="x",
        n=4,
        temperature=0.9,
        seed=2,
        max_tokens=200,
        extra_body={"response_format": {"type": "json_object"}},
    )
    finished = [c.text for c in completion.choices if c.finish_reason == "stop"]
    assert finished  # any object may nest deeper than the budget; those that end are objects
    for text in finished:
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    ("body", "pattern"),
    [
        ({"structured_outputs": {"regex": REGEX}}, REGEX),
        ({"guided_regex": REGEX}, REGEX),
        ({"structured_outputs": {"choice": ["sunny day", "rain"]}}, r"sunny day|rain"),
        ({"guided_choice": ["sunny day", "rain"]}, r"sunny day|rain"),
        ({"structured_outputs": {"grammar": GBNF}}, GBNF_MATCH),
        ({"guided_grammar": LARK}, LARK_MATCH),
    ],
)
def test_regex_choice_and_grammar_outputs_match(client, body, pattern) -> None:
    result = client.completions.create(
        model=MODEL, prompt="the", n=8, temperature=1.0, seed=3, max_tokens=40, extra_body=body
    )
    for choice in result.choices:
        assert choice.finish_reason == "stop"
        assert re.fullmatch(pattern, choice.text), choice.text
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "go"}],
        temperature=0,
        max_tokens=40,
        extra_body=body,
    )
    assert re.fullmatch(pattern, chat.choices[0].message.content or "")


def test_streaming_with_a_constraint_reassembles_to_a_valid_output(client) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "json please"}],
        temperature=1.0,
        seed=11,
        max_tokens=150,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    pieces, finish = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop" and len([p for p in pieces if p]) > 3
    jsonschema.validate(json.loads("".join(pieces)), PERSON)
    events = client.completions.create(
        model=MODEL,
        prompt="a",
        temperature=1.0,
        seed=12,
        max_tokens=40,
        stream=True,
        extra_body={"guided_regex": REGEX},
    )
    assert re.fullmatch(REGEX, "".join(e.choices[0].text for e in events if e.choices))


class Reading(pydantic.BaseModel):
    station: str = pydantic.Field(max_length=5)
    celsius: int = pydantic.Field(ge=-40, le=50)
    raining: bool


def test_sdk_parse_with_a_pydantic_model(client) -> None:
    result = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "weather"}],
        response_format=Reading,
        temperature=0.8,
        seed=5,
        max_tokens=120,
    )
    parsed = result.choices[0].message.parsed
    assert isinstance(parsed, Reading) and -40 <= parsed.celsius <= 50


# -- bad input is a 400 that names the field -----------------------------------------------

# A chain of GBNF rules: its conversion to Lark is quadratic (about 6 s on one core, far past
# COMPILE_TIMEOUT_S on any machine), and is killed at the deadline.
SLOW_GRAMMAR = (
    "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} "a"\n' for i in range(3000)) + 'r3000 ::= "b"'
)


@pytest.mark.parametrize(
    ("route", "body", "param", "words"),
    [
        ("completions", {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        (
            "completions",
            {"structured_outputs": {"json": "{not json"}},
            "structured_outputs.json",
            "not valid JSON",
        ),
        ("chat", {"guided_json": {"type": "strng"}}, "guided_json", "strng"),
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}},
            "response_format",
            "not",
        ),
        (
            "completions",
            {"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}},
            "structured_outputs.json",
            "uniqueItems",
        ),
        ("completions", {"guided_regex": "[a-"}, "guided_regex", "regex"),
        (
            "chat",
            {"structured_outputs": {"regex": "(ab"}},
            "structured_outputs.regex",
            "regex",
        ),
        (
            "completions",
            {"structured_outputs": {"grammar": "root ::= ( "}},
            "structured_outputs.grammar",
            "grammar",
        ),
        ("chat", {"guided_grammar": "start: undefined_rule"}, "guided_grammar", "undefined_rule"),
        ("completions", {"guided_choice": []}, "guided_choice", "choice"),
        (
            "completions",
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        ("chat", {"guided_regex": "a", "response_format": {"type": "json_object"}}, None, "one"),
        ("chat", {"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
        (
            "completions",
            {"structured_outputs": {"grammar": SLOW_GRAMMAR}},
            "structured_outputs.grammar",
            "took longer",
        ),
    ],
)
def test_bad_constraints_are_a_400_naming_the_field(http, route, body, param, words) -> None:
    if route == "chat":
        request = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **body}
    else:
        request = {"model": MODEL, "prompt": "x", **body}
    # (the slow schema's "took longer" 400 is the timeout's own proof: a clock bound, 5 s past
    # a 0.1 s timeout for a 0.5 s compile, could not tell it from no timeout at all)
    for stream in (False, True):
        r = http.post(
            f"/v1/{'chat/' if route == 'chat' else ''}completions",
            json=request | {"stream": stream},
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert param is None or error["param"] == param, error
        assert words in error["message"], error
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


# -- engine state: freed when a client leaves ----------------------------------------------


def test_a_client_that_leaves_mid_constraint_frees_its_matchers_and_rows(server, http) -> None:
    core = server.engine.core
    body = {
        "model": MODEL,
        "prompt": "x",
        "n": 2,
        "max_tokens": 200,
        "stream": True,
        "structured_outputs": {"regex": "[a-z]{200}"},
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        # Sample 1 joins once sample 0's prompt is in: then both hold a matcher and a row.
        wait_for(
            lambda: core.structured_outputs.num_matchers == core.runner.inputs.num_rows_in_use == 2,
            10,
            "both samples' matchers and rows",
        )
    wait_for(lambda: core.num_unfinished() == 0, 30, "the aborted request to retire")
    assert core.structured_outputs.num_matchers == 0
    # The next step hands the finished ids to the runner, which frees their rows: what is left
    # is the row of that step's own request, freed in turn by the step after it.
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "y"}).status_code == 200
    assert core.runner.inputs.num_rows_in_use == 1


# -- one batch, through the offline API ----------------------------------------------------


def test_unconstrained_requests_give_the_same_tokens_beside_constrained_ones(llm) -> None:
    plain = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=4, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=5, max_tokens=12, logprobs=2),
    ]
    prompts = [{"prompt_token_ids": [5 + i, 17, 40 + i]} for i in range(len(plain))]
    alone = llm.generate(prompts, plain, use_tqdm=False)
    constrained = [
        SamplingParams(temperature=0.7, seed=9, max_tokens=40, guided_regex=REGEX),
        SamplingParams(temperature=0, max_tokens=100, structured_outputs={"json": PERSON}),
    ]
    together = llm.generate(
        prompts + [{"prompt_token_ids": [9, 9]}] * 2, plain + constrained, use_tqdm=False
    )
    for a, b in zip(alone, together, strict=False):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert re.fullmatch(REGEX, together[3].outputs[0].text)
    jsonschema.validate(json.loads(together[4].outputs[0].text), PERSON)


def test_preempted_constrained_sequences_resume_their_grammar() -> None:
    small = make_llm(num_gpu_blocks_override=32, enable_prefix_caching=False)  # 128 slots
    params = SamplingParams(
        temperature=1.0, seed=1, max_tokens=60, guided_regex="[a-z]{20}-[0-9]{30}"
    )
    outputs = small.generate(
        [{"prompt_token_ids": [3, 4, 5, i]} for i in range(6)], params, use_tqdm=False
    )
    assert small.engine.scheduler.num_preemptions > 0
    for out in outputs:
        assert re.fullmatch("[a-z]{20}-[0-9]{30}", out.outputs[0].text), out.outputs[0]
    assert small.engine.structured_outputs.num_matchers == 0


def test_the_constraint_starts_after_the_reasoning_end_tokens(llm) -> None:
    end = 7  # the id that closes the reasoning section, forced first by a logit bias
    bias = {end: 100.0}
    free = llm.generate(
        {"prompt_token_ids": [3, 4]},
        SamplingParams(
            temperature=0,
            max_tokens=20,
            logit_bias=bias,
            structured_outputs={"choice": ["yes", "no"], "reasoning_end": [end]},
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert free.token_ids[0] == end and free.finish_reason == "stop"
    after = llm.engine.tokenizer.decode(free.token_ids[1:])
    assert after in ("yes", "no")
    bound = llm.generate(
        {"prompt_token_ids": [3, 4]},
        SamplingParams(temperature=0, max_tokens=20, logit_bias=bias, guided_choice=["yes", "no"]),
        use_tqdm=False,
    )[0].outputs[0]
    assert bound.token_ids[0] != end and bound.text in ("yes", "no")


def test_an_optional_reasoning_section_is_the_model_s_choice(llm) -> None:
    """``reasoning_start`` (qwen3's ``<think>``): the first token may open the section (then the
    grammar waits for ``reasoning_end``) or be the grammar's, which then holds at once."""
    start, end = 9, 7

    def generate(bias: dict[int, float]):
        spec = {"choice": ["yes", "no"], "reasoning_end": [end], "reasoning_start": [start]}
        params = SamplingParams(
            temperature=0, max_tokens=20, logit_bias=bias, structured_outputs=spec
        )
        return llm.generate({"prompt_token_ids": [3, 4]}, params, use_tqdm=False)[0].outputs[0]

    # The start id outranks the grammar's first tokens; the end id is then the free choice.
    opened = generate({start: 50.0, end: 100.0})
    assert opened.token_ids[:2] == [start, end], opened.token_ids
    assert llm.engine.tokenizer.decode(opened.token_ids[2:]) in ("yes", "no")
    # Without the start id first, the grammar holds from the first token: no end id, ever.
    held = generate({start: -100.0, end: 100.0})
    assert held.text in ("yes", "no") and end not in held.token_ids, held.token_ids
    assert held.finish_reason == "stop"


# -- each tokenizer alone ------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_random_walks_through_the_mask_give_valid_documents_on_each_fixture_tokenizer(
    family,
) -> None:
    tokenizer = Tokenizer(fixture_dir(family))
    compiler = GrammarCompiler(tokenizer.hf_tokenizer, tokenizer.vocab_size, (1,))
    grammar = compiler.compile(StructuredOutputsParams(json=json.dumps(PERSON)))
    assert compiler.compile(StructuredOutputsParams(json=json.dumps(PERSON))) is grammar
    rng = np.random.default_rng(0)
    for _ in range(5):
        matcher, tokens = grammar.deep_copy(), []
        while not matcher.is_stopped():
            bits = np.unpackbits(
                np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little"
            )
            allowed = [t for t in np.flatnonzero(bits[: tokenizer.vocab_size]) if t != 1]
            token = int(rng.choice(allowed)) if allowed else 1
            assert matcher.consume_token(token)
            if token == 1:
                break
            tokens.append(token)
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), PERSON)
    with pytest.raises(GrammarError) as bad:
        compiler.compile(StructuredOutputsParams(regex="(x"))
    assert bad.value.param == "structured_outputs.regex"
    compiler.close()


# -- StructuredOutputs alone: the engine's grammar steps ------------------------------------


def _constrained_step(num_seqs: int, reasoning_end: tuple[int, ...] = ()):
    """A request of ``num_seqs`` samples and the step that runs all of them for the first time
    (duck-typed Sequence / ScheduledSeq / SchedulerOutput: what StructuredOutputs reads)."""
    spec = StructuredOutputsParams(choice=("yes", "no"), reasoning_end=reasoning_end)
    request = SimpleNamespace(request_id="r", seqs=[])
    request.seqs = [
        SimpleNamespace(
            seq_id=f"r#{i}",
            request=request,
            params=SimpleNamespace(structured_outputs=spec),
            output_token_ids=[],
            num_resolved_outputs=0,
            is_finished=False,
        )
        for i in range(num_seqs)
    ]
    items = [_item(s, is_new=True) for s in request.seqs]
    sched = SchedulerOutput(items, len(items))
    return request, sched


def _item(seq, **fields) -> SimpleNamespace:
    """A duck-typed ScheduledSeq that completes its sequence, with no drafted tokens."""
    return SimpleNamespace(
        seq=seq, completes_sequence=True, draft_token_ids=[], num_sampled=1, **fields
    )


def _allowed(row: np.ndarray, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def test_a_step_s_tokens_reach_the_grammars_and_the_next_masks_fill_beside_the_output():
    """accept_step advances every matcher at once and names the grammars that completed and
    the tokens a grammar refused; start_masks fills a mask of its own on the worker (the GIL
    handed over every 0.1 ms meanwhile, the interval restored once the fill is done) and
    returns a future of it."""
    import sys

    from jaxserve.engine.structured_outputs import MASK_SWITCH_INTERVAL_S, StructuredOutputs
    from jaxserve.runner.step import RunnerOutput

    tokenizer = Tokenizer(fixture_dir("llama"))
    vocab = tokenizer.vocab_size
    compiler = GrammarCompiler(tokenizer.hf_tokenizer, vocab, (1,))
    grammar = compiler.compile(StructuredOutputsParams(choice=("yes", "no")))
    request, sched = _constrained_step(2)
    outputs = StructuredOutputs(vocab)
    outputs.add_request(request, grammar)
    outputs.update_states(sched)
    assert outputs.num_matchers == 2
    interval = sys.getswitchinterval()
    fill, during_fill = outputs._fill, []

    def recording_fill(*args):
        during_fill.append(sys.getswitchinterval())
        return fill(*args)

    outputs._fill = recording_fill
    future = outputs.start_masks(sched)
    masks = future.result()
    assert during_fill == [pytest.approx(MASK_SWITCH_INTERVAL_S)]
    assert sys.getswitchinterval() == interval
    assert masks.shape == (2, outputs.mask_width) and masks.dtype == np.int32
    allowed = _allowed(masks[0], vocab)
    assert 0 < len(allowed) < vocab and (masks[1] == masks[0]).all()
    # the mask is reused: a row with no matcher allows every token, whatever it held before
    unconstrained = _item(SimpleNamespace(seq_id="free"))
    first_row = masks[0].copy()
    mixed = outputs.start_masks(SchedulerOutput([unconstrained, *sched.scheduled], 3))
    assert (mixed.result()[0] == -1).all() and (mixed.result()[1] == first_row).all()
    refused = int(np.setdiff1d(np.arange(2, vocab), allowed)[0])
    result = RunnerOutput(token_ids=np.array([allowed[0], refused], np.int32))
    accepted = outputs.accept_step(sched, result)
    assert "r#1" in accepted.errors and "broke the constraint" in accepted.errors["r#1"]
    assert "r#0" not in accepted.errors
    for _ in range(8):  # the first sample runs to the end of its grammar
        if "r#0" in accepted.complete:
            break
        token = _allowed(outputs.start_masks(sched).result()[0], vocab)[0]
        accepted = outputs.accept_tokens([(request.seqs[0], int(token))])
    assert "r#0" in accepted.complete and not accepted.errors
    outputs.free(request)
    assert outputs.num_matchers == 0
    outputs.close()
    compiler.close()


def test_the_constraint_starts_after_the_reasoning_ends():
    from jaxserve.engine.structured_outputs import StructuredOutputs

    tokenizer = Tokenizer(fixture_dir("llama"))
    vocab = tokenizer.vocab_size
    compiler = GrammarCompiler(tokenizer.hf_tokenizer, vocab, (1,))
    grammar = compiler.compile(StructuredOutputsParams(choice=("yes", "no")))
    request, sched = _constrained_step(1, reasoning_end=(5, 6))
    outputs = StructuredOutputs(vocab)
    outputs.add_request(request, grammar)
    outputs.update_states(sched)
    seq = request.seqs[0]
    for token in (9, 5, 7, 5):  # free text, and an end that is not (5, 6) yet
        assert outputs.accept_tokens([(seq, token)]).errors == {}
        assert (token_masks(outputs, sched) == -1).all()  # unconstrained while reasoning
    outputs.accept_tokens([(seq, 6)])
    assert len(_allowed(token_masks(outputs, sched)[0], vocab)) < vocab
    outputs.close()
    compiler.close()


def token_masks(outputs, sched) -> np.ndarray:
    """i32[num_scheduled, W]: ``start_masks``, waited for, in an array of its own."""
    return outputs.start_masks(sched).result().copy()
