"""Operator input (hostile input, round three, finding 10): a malformed ``config.json`` and a
``--max-model-len`` past the model.

A ``rope_parameters.factor`` of ``"abc"`` ended start-up with an error that named no field (or a
traceback, for a type ``float()`` refuses); ``--max-model-len 131072`` on a model made for 1,024
positions started without a word. Both now stop start-up with one line that names the field or
both lengths; ``$JAXSERVE_ALLOW_LONG_MAX_MODEL_LEN=1`` (or vLLM's name) lets the long context
through, with a warning.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest

import jaxserve
from jaxserve.cli import build_parser
from jaxserve.config import ConfigError
from jaxserve.engine_config import EngineConfig
from jaxserve.models.families.registry import load_model_config, model_config_from_dict
from jaxserve.server.launch import serve as launch_module
from jaxserve.server.launch.serve import run_launch
from tests.conftest import fixture_dir, free_port

LLAMA = json.loads((fixture_dir("llama") / "config.json").read_text())


def rope(**fields) -> dict:
    return {"rope_parameters": {"rope_theta": 10000.0, **fields}}


LLAMA3 = {"original_max_position_embeddings": 64, "factor": 8.0}
# (fields replaced in the llama fixture's config.json, the error's words)
MALFORMED = {
    "rope-factor-string": (rope(rope_type="linear", factor="abc"), "rope_parameters.factor"),
    "rope-factor-unused": (rope(rope_type="default", factor="abc"), "rope_parameters.factor"),
    "rope-factor-list": (rope(rope_type="dynamic", factor=[2]), "rope_parameters.factor"),
    "rope-factor-boolean": (rope(rope_type="linear", factor=True), "rope_parameters.factor"),
    "rope-theta": (rope(rope_theta="abc"), "rope_parameters.rope_theta"),
    "rope-low-freq": (
        rope(rope_type="llama3", **LLAMA3, low_freq_factor="x"),
        "rope_parameters.low_freq_factor",
    ),
    "rope-original-length": (
        rope(rope_type="yarn", factor=2.0, original_max_position_embeddings="64"),
        "rope_parameters.original_max_position_embeddings",
    ),
    "rope-beta": (
        rope(rope_type="yarn", factor=2.0, original_max_position_embeddings=64, beta_fast="x"),
        "rope_parameters.beta_fast",
    ),
    "rope-short-factor": (
        rope(
            rope_type="longrope",
            original_max_position_embeddings=64,
            short_factor=["a"] * 8,
            long_factor=[1.0] * 8,
        ),
        "rope_parameters.short_factor",
    ),
    "rope-type": (rope(rope_type=5), "rope_parameters.rope_type"),
    "rope-parameters-string": ({"rope_parameters": "abc"}, "rope_parameters must be an object"),
    "rope-scaling-list": (
        {"rope_parameters": None, "rope_scaling": [1]},
        "rope_scaling must be an object",
    ),
    "partial-rotary-factor": (
        {"partial_rotary_factor": "abc"},
        "partial_rotary_factor must be a number",
    ),
    "sliding-window": ({"sliding_window": "abc"}, "sliding_window must be an integer"),
    "hidden-size": ({"hidden_size": "abc"}, "hidden_size"),
    "eos-token-id": ({"eos_token_id": ["abc"]}, "eos_token_id"),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_a_malformed_field_is_a_config_error_naming_it(case) -> None:
    fields, words = MALFORMED[case]
    with pytest.raises(ConfigError) as error:
        model_config_from_dict(LLAMA | fields)
    assert words in str(error.value)


def test_a_config_that_is_not_an_object_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"config.json must be an object, got \[1\]"):
        model_config_from_dict([1])  # type: ignore[arg-type]


def test_integral_floats_read_as_integers() -> None:
    yarn = rope(rope_type="yarn", factor=2.0, original_max_position_embeddings=64.0)
    scaling = model_config_from_dict(LLAMA | yarn).rope_scaling
    assert scaling is not None and scaling.original_max_position_embeddings == 64
    assert isinstance(scaling.original_max_position_embeddings, int)


def launch(tmp_path, caplog, monkeypatch, model: str, *flags: str) -> tuple[int, list[str]]:
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # launch sets it; restored
    argv = ["launch", model, "--host", "127.0.0.1", "--port", str(free_port()), *flags]
    caplog.set_level(logging.INFO)
    status = run_launch(build_parser(argv).parse_args(argv), memory_query=lambda: "none")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "Traceback" not in caplog.text and "Loaded weights" not in caplog.text
    return status, errors


def test_launch_with_a_malformed_rope_factor_exits_naming_the_field(
    tmp_path, caplog, monkeypatch
) -> None:
    model = tmp_path / "model"
    shutil.copytree(fixture_dir("llama"), model)
    bad = LLAMA | rope(rope_type="linear", factor="abc")
    (model / "config.json").write_text(json.dumps(bad))
    status, errors = launch(tmp_path, caplog, monkeypatch, str(model))
    assert status == 1
    (message,) = errors
    assert "config.json: rope_parameters.factor must be a number, got 'abc'" in message


# -- --max-model-len past the model ------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "limit"),
    [
        ("llama", 256),  # max_position_embeddings
        ("llama_linear", 1024),  # times the linear factor 4
        ("llama_dynamic", 128),  # 64 times the dynamic factor 2
        ("qwen2_yarn", 256),  # yarn: original 64 times 4
        ("llama3", 256),  # llama3 counts it in max_position_embeddings
        ("phi3", 256),  # so does longrope
    ],
)
def test_max_model_len_past_the_derived_limit_is_refused(family, limit, monkeypatch) -> None:
    for name in ("JAXSERVE_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        monkeypatch.delenv(name, raising=False)
    model_config = load_model_config(fixture_dir(family))
    assert model_config.derived_max_model_len == limit
    assert EngineConfig(max_model_len=limit).resolved_max_model_len(model_config) == limit
    assert EngineConfig().resolved_max_model_len(model_config) == (
        model_config.max_position_embeddings
    )
    with pytest.raises(ValueError) as error:
        EngineConfig(max_model_len=limit + 1).resolved_max_model_len(model_config)
    message = str(error.value)
    assert f"max_model_len={limit + 1}" in message and f"the {limit} tokens" in message
    assert "JAXSERVE_ALLOW_LONG_MAX_MODEL_LEN=1" in message
    for name in ("JAXSERVE_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        with monkeypatch.context() as env:
            env.setenv(name, "1")
            long = EngineConfig(max_model_len=4 * limit).resolved_max_model_len(model_config)
            assert long == 4 * limit


def test_launch_refuses_a_max_model_len_past_the_model(tmp_path, caplog, monkeypatch) -> None:
    monkeypatch.delenv("JAXSERVE_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    # Were it to start, it would return at once rather than serve.
    monkeypatch.setattr(launch_module.DrainingServer, "run", lambda self: None)
    model = str(fixture_dir("llama"))
    status, errors = launch(tmp_path, caplog, monkeypatch, model, "--max-model-len", "131072")
    assert status == 1
    (message,) = errors
    assert "--max-model-len 131072" in message and "256 tokens" in message  # the flag named
    assert "max_position_embeddings=256" in message


def test_an_allowed_long_max_model_len_is_served_with_a_warning(monkeypatch, caplog) -> None:
    monkeypatch.setenv("JAXSERVE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    caplog.set_level(logging.WARNING)
    with jaxserve.LLM(
        str(fixture_dir("llama")),
        dtype="float32",
        max_model_len=512,
        num_gpu_blocks_override=40,
        warmup=False,
    ) as llm:
        assert llm.engine.max_model_len == 512
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("max_model_len=512 is longer than the 256 tokens" in w for w in warnings)
