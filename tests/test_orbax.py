"""Converted (orbax) checkpoints: ``jaxserve convert`` writes the weights as served and
``serve OUT`` / ``LLM(OUT)`` / ``update_weights_from_disk(OUT)`` restore them: bitwise the
safetensors-loaded weights (unquantized and fp8), the same greedy tokens, restored into each
device's shards on a 2-device mesh, and a checkpoint that does not fit (dtype, quantization,
layout, shapes) an error naming both sides that changes nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve import cli
from jaxserve.engine.llm import LLM
from jaxserve.engine_config import EngineConfig
from jaxserve.models.families.registry import load_model_config
from jaxserve.models.loading.checkpoint_reader import WeightsError
from jaxserve.models.loading.orbax_checkpoint import (
    MANIFEST_NAME,
    ConvertedCheckpointError,
    read_manifest,
)
from jaxserve.runner.convert import convert
from jaxserve.runner.devices import resolve_dtype, resolve_quantization
from jaxserve.runner.model_weights import model_weights
from jaxserve.sampling_params import SamplingParams
from tests.conftest import SMALL_ENGINE, fixture_dir, run_with_devices

PROMPTS = [[5, 17, 40, 41, 2, 9], [7, 7, 7, 100, 3]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def converted(out: Path, model: Path | str, **flags) -> Path:
    """``model`` converted into ``out`` as ``jaxserve convert`` does (flags: EngineConfig's)."""
    config = EngineConfig(model=str(model), **{"dtype": "float32", **flags})
    convert(config, out, show_progress=False)
    return out


def served_weights(model: Path, **flags):
    """The weights a start on ``model`` serves (one device), as the runner makes them."""
    config = EngineConfig(model=str(model), **flags)
    dtype, quant = resolve_dtype(config), resolve_quantization(config)
    return model_weights(load_model_config(model), config, dtype, None, quant)[0]


def assert_bitwise_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(a)[0]]
    for path, x, y in zip(paths, jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)), path


def tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return converted(tmp_path_factory.mktemp("orbax") / "llama", fixture_dir("llama"))


def test_convert_writes_the_model_files_and_a_manifest(out) -> None:
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", MANIFEST_NAME} <= names
    assert "weights" in names and not any(n.endswith(".safetensors") for n in names)
    manifest = read_manifest(out)
    assert (manifest.dtype, manifest.quantization, manifest.fused) == ("float32", None, True)
    assert manifest.leaves[".layers[0].fused.wqkv"] == "float32[64,8,16]"
    raw = json.loads((out / MANIFEST_NAME).read_text())
    assert raw["jaxserve_version"] and raw["model_type"] == "llama" and raw["num_layers"] == 2


def test_restored_weights_are_the_safetensors_weights_bitwise(out) -> None:
    restored = served_weights(out)
    assert_bitwise_equal(restored, served_weights(fixture_dir("llama"), dtype="float32"))
    # restored straight into the default device, committed as the runner serves weights
    device = jax.devices()[0]
    assert all(leaf.committed and leaf.devices() == {device} for leaf in jax.tree.leaves(restored))


def test_fp8_weights_restore_bitwise(tmp_path) -> None:
    fp8 = converted(tmp_path / "fp8", fixture_dir("qwen3"), quantization="fp8")
    manifest = read_manifest(fp8)
    # one device: the fp8 projections are joined as the bf16 ones are (per-channel scales)
    assert (manifest.quantization, manifest.fused) == ("fp8", True)
    restored = served_weights(fp8)  # no flag: the checkpoint's quantization
    loaded = served_weights(fixture_dir("qwen3"), dtype="float32", quantization="fp8")
    assert_bitwise_equal(restored, loaded)
    assert restored.layers[0].fused.wqkv.q.dtype == np.dtype("float8_e4m3fn")


def test_flags_that_do_not_match_the_checkpoint_name_both(out) -> None:
    with pytest.raises(ConvertedCheckpointError, match="--dtype bfloat16.*--dtype float32"):
        resolve_dtype(EngineConfig(model=str(out), dtype="bfloat16"))
    with pytest.raises(ConvertedCheckpointError, match=r"--quantization int8.*\(none\)"):
        resolve_quantization(EngineConfig(model=str(out), quantization="int8"))


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    """The llama fixture with other weights, as safetensors."""
    target = tmp_path_factory.mktemp("models") / "other"
    source = fixture_dir("llama")
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("golden.npz"))
    tensors = load_file(source / "model.safetensors")
    rng = np.random.default_rng(0)
    for name, value in tensors.items():
        if "norm" not in name:
            noise = rng.standard_normal(value.shape).astype(value.dtype)
            tensors[name] = value + noise * np.abs(value).mean()
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_llm_on_orbax_samples_as_on_safetensors_and_updates_from_orbax(
    out, other, tmp_path
) -> None:
    source = LLM(str(fixture_dir("llama")), dtype="float32", **SMALL_ENGINE)
    restored = LLM(str(out), **SMALL_ENGINE)  # dtype auto: the checkpoint's float32
    before = tokens(source)
    assert tokens(restored) == before
    source.update_weights_from_disk(other)  # safetensors: the other weights' tokens
    expected = tokens(source)
    assert expected != before
    num_programs = restored.engine.runner.programs.step_fn._cache_size()
    assert restored.update_weights_from_disk(converted(tmp_path / "other", other)) >= 0
    assert tokens(restored) == expected
    assert restored.engine.runner.programs.step_fn._cache_size() == num_programs

    served = restored.weights
    qwen3 = converted(tmp_path / "qwen3", fixture_dir("qwen3"))
    with pytest.raises(WeightsError, match=r"weights do not fit the model: .*layers\[0\]"):
        restored.update_weights_from_disk(qwen3)
    bf16 = converted(tmp_path / "bf16", other, dtype="bfloat16")
    with pytest.raises(ConvertedCheckpointError, match="holds bfloat16.*served in float32"):
        restored.update_weights_from_disk(bf16)
    assert restored.weights is served and tokens(restored) == expected  # nothing changed
    source.shutdown()
    restored.shutdown()


def test_the_command_converts_and_refuses_a_used_directory(tmp_path, capsys) -> None:
    target = tmp_path / "out"
    args = ["convert", str(fixture_dir("llama")), str(target), "--dtype", "float32"]
    assert cli.main([*args, "--disable-tqdm"]) == 0
    assert read_manifest(target).dtype == "float32"
    assert cli.main([*args, "--disable-tqdm"]) == 2  # OUT is not empty
    with pytest.raises(SystemExit):
        cli.main(["convert", "--help"])
    help_text = capsys.readouterr().out
    assert "--quantization" in help_text and "--dtype" in help_text and "OUT" in help_text


SHARDED = """
import sys, jax, numpy as np
from jaxserve.engine_config import EngineConfig
from jaxserve.models.families.registry import load_model_config
from jaxserve.models.loading.orbax_checkpoint import ConvertedCheckpointError
from jaxserve.runner.convert import convert
from jaxserve.runner.model_weights import model_weights
from jaxserve.runner.parallel.sharding import prepare_tp

source, out, fused = sys.argv[1:4]
config = EngineConfig(model=source, dtype="float32", tensor_parallel_size=2)
convert(config, out, show_progress=False)
model_config = load_model_config(source)
tp = prepare_tp(model_config, 2)
loaded, _ = model_weights(model_config, config, np.float32, tp.placement, None)
config_out = EngineConfig(model=out, tensor_parallel_size=2)
restored, _ = model_weights(model_config, config_out, np.float32, tp.placement, None)
for a, b, want in zip(
    jax.tree.leaves(restored), jax.tree.leaves(loaded), jax.tree.leaves(tp.weight_shardings)
):
    assert a.sharding == want, (a.sharding, want)
    for shard in a.addressable_shards:  # each device holds its slice, as loaded
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(b)[shard.index])
one = EngineConfig(model=source, dtype="float32")  # the tp=2 checkpoint on one device: fused
loaded_one, _ = model_weights(model_config, one, np.float32, None, None)
restored_one, _ = model_weights(model_config, EngineConfig(model=out), np.float32, None, None)
assert restored_one.layers[0].fused is not None
assert jax.tree.structure(restored_one) == jax.tree.structure(loaded_one)
for a, b in zip(jax.tree.leaves(restored_one), jax.tree.leaves(loaded_one)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
try:
    model_weights(model_config, EngineConfig(model=fused), np.float32, tp.placement, None)
except ConvertedCheckpointError as exc:
    print("refused:", exc)
print("sharded ok", len(jax.tree.leaves(restored)))
"""


def test_sharded_restore_on_two_devices(out, tmp_path) -> None:
    source = str(fixture_dir("llama"))
    stdout = run_with_devices(SHARDED, 2, source, str(tmp_path / "tp2"), str(out))
    assert "sharded ok" in stdout
    assert "refused:" in stdout and "fused" in stdout and "--tensor-parallel-size" in stdout
    assert read_manifest(tmp_path / "tp2").fused is False


def test_weights_are_written_uncompressed_and_a_compressed_checkpoint_still_restores(
    tmp_path,
) -> None:
    """The weights go to disk as they are (orbax would zstd them: little gained on weights, a
    start's decode paid); a checkpoint orbax compressed (its default) restores the same."""
    import orbax.checkpoint as ocp

    from jaxserve.models.loading.orbax_checkpoint import Manifest, write_checkpoint

    zeros = {"w": jax.numpy.zeros((256, 1024), jax.numpy.float32)}  # 1 MiB; zstd: a few bytes
    manifest = Manifest("test", "float32", None, False, "llama", 1, 1 << 20, {".w": "f32"})
    source = tmp_path / "source"
    source.mkdir()
    write_checkpoint(zeros, source, tmp_path / "plain", manifest, show_progress=False)
    on_disk = sum(f.stat().st_size for f in (tmp_path / "plain").rglob("*") if f.is_file())
    assert on_disk >= 1 << 20
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save((tmp_path / "zstd").absolute(), zeros)
    small = sum(f.stat().st_size for f in (tmp_path / "zstd").rglob("*") if f.is_file())
    assert small < 1 << 19  # orbax's default compressed it
    target = {"w": jax.ShapeDtypeStruct((256, 1024), np.float32, sharding=zeros["w"].sharding)}
    for path in (tmp_path / "plain" / "weights", tmp_path / "zstd"):
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(path.absolute(), target)
        assert np.array_equal(np.asarray(restored["w"]), np.zeros((256, 1024), np.float32))
