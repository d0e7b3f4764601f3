"""The fp8 programs' XLA options (issue 36, item 5): ``$JAXSERVE_FP8_XLA_OPTIONS`` names one of
``FP8_XLA_OPTION_SETS`` (the autotuner's default, untimed GEMMs, cuBLAS, or both), the model step
of fp8 weights compiles under it on a GPU, every other program and backend keeps its own, a
name outside the sets is an error naming the variable, and the start-up log says which runs.
``$JAXSERVE_POOLING_XLA_OPTIONS`` does the same for the pooling steps that read no cache (a
decoder's whole prompts, an encoder's step)."""

from __future__ import annotations

import jax
import pytest

import jaxserve
from jaxserve import SamplingParams
from jaxserve.runner import programs
from jaxserve.runner.programs import (
    FP8_XLA_OPTION_SETS,
    FP8_XLA_OPTIONS_ENV,
    INVARIANT_GPU_OPTIONS,
    POOLING_XLA_OPTIONS_ENV,
    compiler_options,
    describe_fp8_compile,
)
from tests.conftest import FIXTURES, fixture_dir


@pytest.fixture
def on_a_gpu(monkeypatch):
    """The options' choice as a GPU backend makes it (nothing compiles here)."""
    monkeypatch.setattr(programs.jax, "default_backend", lambda: "gpu")


def test_the_default_is_untimed_gemms(monkeypatch, on_a_gpu) -> None:
    """Measured on an H100: the 2,048-token fp8 step compiles 5x faster at autotune level 0
    and runs no slower (docs/quantization.md)."""
    monkeypatch.delenv(FP8_XLA_OPTIONS_ENV, raising=False)
    assert compiler_options(False, fp8_weights=True) == {"xla_gpu_autotune_level": 0}
    assert describe_fp8_compile() == (
        "fp8 programs' compile: each GEMM by its shape's heuristic, untimed "
        "(JAXSERVE_FP8_XLA_OPTIONS=autotune0)"
    )


@pytest.mark.parametrize("name", sorted(FP8_XLA_OPTION_SETS))
def test_each_set_reaches_fp8_programs_on_a_gpu_only(monkeypatch, on_a_gpu, name) -> None:
    monkeypatch.setenv(FP8_XLA_OPTIONS_ENV, name)
    assert compiler_options(False, fp8_weights=True) == FP8_XLA_OPTION_SETS[name]
    assert compiler_options(False, fp8_weights=False) == {}  # bf16 programs keep XLA's own
    assert compiler_options(True, fp8_weights=True) == INVARIANT_GPU_OPTIONS  # the mode's own
    assert f"({FP8_XLA_OPTIONS_ENV}={name})" in describe_fp8_compile()


def test_off_the_gpu_no_option_is_set(monkeypatch) -> None:
    monkeypatch.setenv(FP8_XLA_OPTIONS_ENV, "cublas-autotune0")
    assert jax.default_backend() == "cpu"
    assert compiler_options(False, fp8_weights=True) == {}


def test_an_unknown_set_names_the_variable_and_the_sets(monkeypatch, on_a_gpu) -> None:
    monkeypatch.setenv(FP8_XLA_OPTIONS_ENV, "fast")
    with pytest.raises(ValueError, match=r"JAXSERVE_FP8_XLA_OPTIONS='fast' must be one of "):
        compiler_options(False, fp8_weights=True)


def test_the_probe_times_the_served_sets() -> None:
    from benchmarks.probes.fp8_compile import OPTION_SETS

    assert OPTION_SETS is FP8_XLA_OPTION_SETS


def test_an_fp8_engines_model_step_is_jitted_with_them(monkeypatch) -> None:
    """``--quantization fp8``: the model step's jit asks for the fp8 options (CPU options stand
    in for the GPU's, which the CPU compiler refuses), every step compiles and runs under them,
    and a bf16 engine asks for none."""
    asked = []

    def cpu_options(batch_invariant: bool, fp8_weights: bool = False, pooling: bool = False):
        asked.append(fp8_weights)
        return {"xla_cpu_enable_fast_math": False} if fp8_weights else {}

    monkeypatch.setattr(programs, "compiler_options", cpu_options)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for quantization in (None, "fp8"):
        llm = jaxserve.LLM(
            str(fixture_dir("llama")),
            quantization=quantization,
            max_model_len=64,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            num_gpu_blocks_override=32,
            warmup=False,
        )
        out = llm.generate({"prompt_token_ids": list(range(5, 25))}, params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        llm.shutdown()
    assert asked == [False, True]


def test_the_start_up_log_names_the_set_for_fp8_weights_on_a_gpu(monkeypatch) -> None:
    """The line is there for fp8 weights on a GPU only (the rest of the start-up lines read the
    real backend: the GPU is stood in for where the fp8 line decides)."""
    import jax.numpy as jnp

    from jaxserve.engine_config import EngineConfig
    from jaxserve.models.families.registry import load_model_config
    from jaxserve.runner import devices

    fp8 = devices.QuantScheme(method="fp8", weight_format="fp8")
    int8 = devices.QuantScheme(method="int8", weight_format="int8")
    monkeypatch.setenv(FP8_XLA_OPTIONS_ENV, "autotune0")
    assert not devices._fp8_on_gpu(fp8)  # the CPU compiles fp8 programs under no option set
    monkeypatch.setattr(devices.jax, "default_backend", lambda: "gpu")
    assert devices._fp8_on_gpu(fp8)
    assert not devices._fp8_on_gpu(int8) and not devices._fp8_on_gpu(None)
    monkeypatch.undo()
    monkeypatch.setattr(devices, "_fp8_on_gpu", lambda quant: quant is fp8)
    config = load_model_config(str(fixture_dir("llama")))

    def lines(quant):
        return devices.startup_lines(config, EngineConfig(), jnp.float32, 64, quant)

    assert describe_fp8_compile() in lines(fp8)
    assert not any("fp8 programs' compile" in line for line in lines(int8))


def test_holds_fp8_finds_fp8_arrays_at_any_depth() -> None:
    from jaxserve.runner.programs import holds_fp8

    plain = {"w": jax.numpy.zeros((2, 2), jax.numpy.bfloat16), "n": None}
    assert not holds_fp8(plain) and not holds_fp8(None)
    assert holds_fp8({**plain, "deep": [(jax.numpy.zeros(2, jax.numpy.float8_e4m3fn),)]})
    assert holds_fp8([jax.numpy.zeros(2, jax.numpy.float8_e5m2)])


def test_an_fp8_eagle3_heads_chain_is_jitted_with_them(monkeypatch) -> None:
    """``speculative_config`` quantization fp8: the drafter's chains ask for the fp8 options
    (CPU options stand in for the GPU's) and drafts under them; an unquantized head asks for
    none."""
    from pathlib import Path

    from jaxserve.engine_config import default_model_dir
    from jaxserve.runner import drafting

    asked = []

    def cpu_options(batch_invariant: bool, fp8_weights: bool = False, pooling: bool = False):
        asked.append(fp8_weights)
        return {"xla_cpu_enable_fast_math": False} if fp8_weights else {}

    monkeypatch.setattr(drafting, "compiler_options", cpu_options)
    head = Path(__file__).parent / "fixtures" / "spec" / "eagle3"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for quantization in (None, "fp8"):
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
        llm = jaxserve.LLM(
            str(default_model_dir()),
            speculative_config={**spec, "quantization": quantization},
            max_model_len=128,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            num_gpu_blocks_override=64,
            dtype="float32",
            warmup=False,
        )
        out = llm.generate({"prompt_token_ids": list(range(5, 25))}, params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 6
        assert llm.engine.spec_stats.num_draft_tokens > 0  # the chain ran
        llm.shutdown()
    # each drafter's two programs: its chain, and the chain of a call drafted ahead
    assert asked == [False, False, True, True]


def test_the_probes_runner_carries_no_set_of_its_own(monkeypatch) -> None:
    """``fp8_compile`` compiles each row under its set alone: its runner's programs are jitted
    under ``default`` (no options), and the served setting is back afterwards."""
    import argparse

    from benchmarks.probes import fp8_compile

    seen = []

    class Stop(Exception):
        pass

    def runner(*args, **kwargs):
        seen.append(fp8_compile.os.environ.get(FP8_XLA_OPTIONS_ENV))
        raise Stop

    monkeypatch.setattr(fp8_compile, "ModelRunner", runner)
    monkeypatch.setenv(FP8_XLA_OPTIONS_ENV, "cublas")
    args = argparse.Namespace(
        model=str(fixture_dir("llama")), buckets=[16], max_model_len=64, blocks=8
    )
    with pytest.raises(Stop):
        fp8_compile.measure("fp8", args, ["default"])
    assert seen == ["default"]
    assert fp8_compile.os.environ[FP8_XLA_OPTIONS_ENV] == "cublas"


@pytest.mark.parametrize("name", sorted(FP8_XLA_OPTION_SETS))
def test_each_set_reaches_pooling_steps_on_a_gpu_only(monkeypatch, on_a_gpu, name) -> None:
    """By default cuBLAS's GEMMs for a decoder's whole prompts and XLA's own options for an
    encoder (timed on an H100); a set named reaches both, and neither generation steps nor
    fp8 ones."""
    monkeypatch.delenv(POOLING_XLA_OPTIONS_ENV, raising=False)
    assert compiler_options(False, pooling=True) == FP8_XLA_OPTION_SETS["cublas"]
    merger_off = programs.ENCODER_GPU_XLA_OPTIONS
    assert compiler_options(False, pooling=True, encoder=True) == merger_off
    monkeypatch.setenv(POOLING_XLA_OPTIONS_ENV, name)
    assert compiler_options(False, pooling=True) == FP8_XLA_OPTION_SETS[name]
    assert compiler_options(False, pooling=True, encoder=True) == {
        **FP8_XLA_OPTION_SETS[name],
        **merger_off,
    }
    assert compiler_options(False) == {}
    monkeypatch.setenv(FP8_XLA_OPTIONS_ENV, "default")
    assert compiler_options(False, fp8_weights=True, pooling=True) == {}  # fp8's set
    assert compiler_options(True, pooling=True) == INVARIANT_GPU_OPTIONS


def test_the_encoder_step_keeps_its_gemms_apart_on_a_gpu(monkeypatch, on_a_gpu) -> None:
    """XLA's dot merger joined a BERT layer's q and k GEMMs, leaving their biases to passes of
    their own: the encoder step turns it off on a GPU, over the pooling set; not elsewhere."""
    monkeypatch.delenv(POOLING_XLA_OPTIONS_ENV, raising=False)
    merger_off = {"xla_gpu_dot_merger_threshold_mb": 0}
    assert compiler_options(False, pooling=True, encoder=True) == merger_off
    monkeypatch.setenv(POOLING_XLA_OPTIONS_ENV, "cublas")
    cublas = FP8_XLA_OPTION_SETS["cublas"]
    assert compiler_options(False, pooling=True, encoder=True) == {**cublas, **merger_off}
    assert compiler_options(False, pooling=True) == cublas  # a decoder's: not the merger's
    monkeypatch.setattr(programs.jax, "default_backend", lambda: "cpu")
    assert compiler_options(False, pooling=True, encoder=True) == {}


def test_an_unknown_pooling_set_names_the_variable(monkeypatch, on_a_gpu) -> None:
    monkeypatch.setenv(POOLING_XLA_OPTIONS_ENV, "fast")
    with pytest.raises(ValueError, match=r"JAXSERVE_POOLING_XLA_OPTIONS='fast' must be one of "):
        compiler_options(False, pooling=True)


def test_pooling_steps_without_cache_are_jitted_with_them(monkeypatch) -> None:
    """A decoder's pooling runner over whole prompts and an encoder's runner ask for the
    pooling options (CPU options stand in for the GPU's); the paged pooling path asks for
    none."""
    from jaxserve.runner import encoder_runner

    asked = []

    def cpu_options(
        batch_invariant: bool, fp8_weights: bool = False, pooling: bool = False, encoder=False
    ):
        asked.append(pooling)
        return {"xla_cpu_enable_fast_math": False} if pooling else {}

    monkeypatch.setattr(programs, "compiler_options", cpu_options)
    monkeypatch.setattr(encoder_runner, "compiler_options", cpu_options)
    embed = dict(
        runner="pooling", max_model_len=64, max_num_batched_tokens=64, warmup=False,
        enable_prefix_caching=False,
    )  # fmt: skip
    qwen3 = str(FIXTURES.parent / "embeddings" / "qwen3_last")
    bert = str(FIXTURES.parent / "encoders" / "bert_embed")
    for model, attention in ((qwen3, "whole"), (qwen3, "paged"), (bert, None)):
        if attention is not None:
            monkeypatch.setenv("JAXSERVE_POOLING_ATTENTION", attention)
        llm = jaxserve.LLM(model, **embed)
        assert len(llm.embed([[5, 6, 7, 8]], use_tqdm=False)[0].outputs.embedding) > 0
        llm.shutdown()
    assert asked == [True, False, True]
