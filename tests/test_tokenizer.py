"""Tokenizer: chat template in a sandbox, incremental detokenization."""

from __future__ import annotations

import threading
import time

import pytest

from jaxserve.engine.tokenizer import (
    IncrementalDetokenizer,
    TemplateError,
    Tokenizer,
    load_tokenizer,
)
from jaxserve.engine_config import EngineConfig, default_model_dir
from tests.conftest import fixture_dir

TEXT = "naïve café 日本語 🙂 def foo(x):\n    return x + 1"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(fixture_dir("llama"))


def test_incremental_detokenization_never_splits_characters(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = tok.detokenizer(tok.encode("Hi", add_special_tokens=True))
    deltas = [detok.add([t]) for t in ids]
    assert "".join(deltas) == TEXT == detok.text
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas)  # multi-byte characters span several tokens here


def test_python_fallback_detokenizer_agrees(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    slow = IncrementalDetokenizer(tok, [0])
    slow._stream = None  # force the windowed decode path
    assert "".join(slow.add([t]) for t in ids) == TEXT


def test_chat_template_renders_in_sandbox(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(TemplateError, match="not allowed"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], evil=True)


def test_sandbox_blocks_attribute_escapes(tok: Tokenizer) -> None:
    from jaxserve.engine import tokenizer as module

    template = module._compile_template("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(Exception, match="unsafe|access"):
        template.render()


def test_dummy_tokenizer_round_trips_every_id() -> None:
    tok = Tokenizer(None, dummy_vocab_size=1000)
    assert tok.vocab_size == 1000
    assert tok.encode("<t5> <t999>", add_special_tokens=False) == [5, 999]
    detok = tok.detokenizer([5])
    assert detok.add([7, 999]).split() == ["<t7>", "<t999>"]


@pytest.mark.parametrize("model", ["llama", "qwen2", "demo"])
@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decode_agrees_with_transformers(model, skip_special_tokens) -> None:
    tokenizer = Tokenizer(default_model_dir() if model == "demo" else fixture_dir(model))
    ids = tokenizer.encode(TEXT, add_special_tokens=True) + list(range(0, 300, 7))
    expected = tokenizer._hf.decode(ids, skip_special_tokens=skip_special_tokens)
    assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected


def test_a_long_decode_lets_other_threads_run(tok: Tokenizer) -> None:
    """/detokenize of 600,000 ids must not hold the event loop and the step loop: the decode
    releases the GIL, so a thread that ticks every millisecond keeps ticking through it."""
    ids = list(range(10, 100)) * 20_000  # 1.8 million ids
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    start = time.perf_counter()
    tok.decode(ids, skip_special_tokens=False)
    seconds = time.perf_counter() - start
    done.set()
    ticker.join()
    assert max(gaps) < 0.5 * seconds, (
        f"a {seconds:.3f} s decode stopped the ticker {max(gaps):.3f} s"
    )


def test_templates_tojson_keeps_key_order_and_does_not_escape_html() -> None:
    tok_with = Tokenizer(fixture_dir("llama"))
    tok_with.chat_template = "{{ messages[0]['content'] | tojson }}|{{ tools | tojson(indent=2) }}"
    text = tok_with.apply_chat_template(
        [{"role": "user", "content": {"b": "<a>", "a": "é"}}], tools=[{"z": 1, "y": 2}]
    )
    assert text == '{"b": "<a>", "a": "é"}|[\n  {\n    "z": 1,\n    "y": 2\n  }\n]'


def test_chat_template_from_a_file_or_inline_replaces_the_models(tmp_path) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    messages = [{"role": "user", "content": "hi"}]
    for value in (str(path), template):
        config = EngineConfig(model=str(fixture_dir("llama")), chat_template=value)
        tokenizer = load_tokenizer(config, vocab_size=320)
        assert tokenizer.apply_chat_template(messages) == "[user] hi\n"


def test_a_model_that_ships_no_template_chats_with_one() -> None:
    config_only = default_model_dir().parent / "configs" / "llama-3-8b"
    config = EngineConfig(model=str(config_only), load_format="dummy")
    with pytest.raises(TemplateError, match="no chat template"):
        load_tokenizer(config, vocab_size=64).apply_chat_template(
            [{"role": "user", "content": "a"}]
        )
    config = EngineConfig(
        model=str(config_only), load_format="dummy", chat_template="{{ messages[0]['content'] }}!"
    )
    tokenizer = load_tokenizer(config, vocab_size=64)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "a"}]) == "a!"


def test_a_bad_chat_template_is_named_at_start(tmp_path) -> None:
    model = str(fixture_dir("llama"))
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_tokenizer(EngineConfig(model=model, chat_template="no/such/file.jinja"), 320)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="broken.jinja does not parse"):
        load_tokenizer(EngineConfig(model=model, chat_template=str(broken)), 320)


def test_launch_takes_chat_template() -> None:
    from jaxserve.cli import build_parser
    from jaxserve.server.launch.flags import engine_config_from_args

    argv = ["launch", "--chat-template", "t.jinja"]
    assert engine_config_from_args(build_parser(argv).parse_args(argv)).chat_template == "t.jinja"
