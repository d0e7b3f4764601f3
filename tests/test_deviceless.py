"""``benchmarks/deviceless.py``: the model step it compiles for a GPU without one must stay the
engine's step (its arguments as ``StepPrograms`` passes them), and the GPU it describes must be
the one named. The compile itself needs the CUDA plugin, which CI does not install; here the
same abstract step lowers on the CPU."""

from __future__ import annotations

import importlib.util

import jax
import pytest

from benchmarks import deviceless
from pallas_kernels.lora import dispatch as lora_dispatch
from tests.conftest import fixture_dir


def test_target_config_states_the_gpu() -> None:
    text = deviceless.target_config(deviceless.GPUS["h200"])
    assert 'name: "NVIDIA H200"' in text
    assert "core_count: 132" in text
    assert "memory_bandwidth: 4800000000000" in text
    assert "major: 9\n    minor: 0\n  feature_extension: ACCELERATED_FEATURES" in text
    assert text.count("{") == text.count("}")  # the text format's messages are closed


@pytest.mark.parametrize(
    "spec",
    [
        deviceless.StepSpec(fixture_dir("llama"), 16, max_model_len=256, num_pages=64),
        deviceless.StepSpec(
            fixture_dir("llama"),
            32,
            kv_cache_dtype="fp8",
            max_loras=2,
            max_model_len=256,
            num_pages=64,
        ),
        deviceless.StepSpec(
            fixture_dir("qwen3"), 64, whole_prompts=True, max_model_len=64, num_pages=64
        ),
    ],
    ids=["plain", "fp8-cache-lora", "whole-prompts"],
)
def test_the_abstract_step_lowers_as_the_engine_calls_it(spec: deviceless.StepSpec) -> None:
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    fn, args, kwargs = deviceless._abstract_step(spec, cpu)
    lowered = fn.lower(*args, **kwargs)
    kv_cache, hidden = lowered.out_info[:2]
    first_pages = args[1][0][0]
    assert hidden.shape[0] == spec.tokens
    assert len(kv_cache) == len(args[1]) and kv_cache[0][0].dtype == first_pages.dtype
    assert ("lora_weights" in kwargs) == bool(spec.max_loras)


def test_as_gpu_answers_as_the_gpu_would_and_restores_jax(monkeypatch) -> None:
    monkeypatch.setattr(deviceless, "compile_only_device", lambda gpu: object())
    saved = jax.default_backend, jax.devices, jax.device_count
    with deviceless.as_gpu("h100"):
        assert jax.default_backend() == "gpu" and jax.device_count() == 1
        (device,) = jax.devices()
        assert (device.compute_capability, device.core_count, device.platform) == (
            "9.0",
            132,
            "gpu",
        )
        # the kernels' dispatch sees one GPU: the LoRA product takes its GPU rule
        assert lora_dispatch.choose(8)[0] == "triton"
        assert lora_dispatch.choose(1)[0] == "reference"
    assert (jax.default_backend, jax.devices, jax.device_count) == saved
    assert jax.default_backend() == "cpu"


def _has_cuda_plugin() -> bool:
    return importlib.util.find_spec("jax_plugins") is not None and (
        importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
    )


@pytest.mark.skipif(_has_cuda_plugin(), reason="the CUDA plugin is installed here")
def test_without_the_plugin_the_error_says_what_to_install() -> None:
    deviceless.compile_only_device.cache_clear()
    with pytest.raises(SystemExit, match="needs the CUDA plugin.*jax-cuda13-plugin"):
        deviceless.compile_only_device("h100")
