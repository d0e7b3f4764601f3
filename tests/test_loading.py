"""Loading a safetensors checkpoint: parallel reads through small staging buffers give exactly
the weights the weight table says (every layout: transposed, fused parts, experts, interleaved),
host memory stays at the staging buffers, and a broken checkpoint names its file and tensor."""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
import threading
import tracemalloc
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from jaxserve.config import ModelConfig
from jaxserve.models.families.fields import HF_LAYER_PREFIX
from jaxserve.models.families.registry import layer_fields, load_model_config, model_fields
from jaxserve.models.layers import fuse_projections
from jaxserve.models.loading.checkpoint_loader import load_weights
from jaxserve.models.loading.checkpoint_reader import CheckpointReader, WeightsError
from jaxserve.models.loading.dummy import dummy_weights
from jaxserve.models.loading.field_conversion import to_field, to_field_into
from jaxserve.models.loading.load_progress import LoadCancelled, format_rate
from jaxserve.runner.model_weights import WeightsLoading
from tests.conftest import fixture_dir

KiB, MiB = 1024, 1024**2


def host_reference(model_dir: Path, config: ModelConfig) -> dict[tuple, np.ndarray]:
    """Every field made on the host with numpy, as the loader made them before."""
    with safe_open(model_dir / "model.safetensors", framework="numpy") as f:

        def field_value(field, prefix: str) -> np.ndarray:
            parts = [field.from_hf(f.get_tensor(n), config) for n in field.hf_names(config, prefix)]
            return parts[0] if not field.per_expert else np.stack(parts)

        out = {(field.name,): field_value(field, "") for field in model_fields(config)}
        for layer in range(config.num_layers):
            prefix = HF_LAYER_PREFIX.format(layer=layer)
            for field in layer_fields(config, layer):
                out[("layers", layer, field.name)] = field_value(field, prefix)
    return out


@pytest.mark.parametrize("family", ["llama", "phi3", "qwen3_moe", "gpt_oss"])
def test_parallel_reads_in_small_pieces_give_the_table_s_weights(family: str) -> None:
    """Three threads, 1 KiB buffers (tensors in many pieces, experts sharing a buffer), the
    conversion to bf16 on the device: equal to numpy's transposes and casts."""
    model_dir = fixture_dir(family)
    config = load_model_config(model_dir)
    weights = load_weights(model_dir, config, jnp.bfloat16, num_threads=3, staging_bytes=6 * KiB)
    for path, expected in host_reference(model_dir, config).items():
        value = weights
        for key in path:
            value = value[key] if isinstance(key, int) else getattr(value, key)
        assert value.dtype == jnp.bfloat16, path
        np.testing.assert_array_equal(np.asarray(value), expected.astype(jnp.bfloat16), path)


@pytest.mark.parametrize("family", ["llama", "phi3", "qwen2", "qwen3_moe", "gemma3", "deepseek_v3"])
def test_fused_loading_writes_the_joined_arrays_fusing_after_a_load_makes(family: str) -> None:
    """``fuse``: q/k/v and gate/up are written, in pieces and from three threads, into their
    joined arrays; the weights equal ``fuse_projections`` over a plain load (a layer with
    experts joins only q/k/v)."""
    model_dir = fixture_dir(family)
    config = load_model_config(model_dir)
    fused = load_weights(
        model_dir, config, jnp.bfloat16, num_threads=3, staging_bytes=6 * KiB, fuse=True
    )
    after = fuse_projections(load_weights(model_dir, config, jnp.bfloat16))
    assert jax.tree.structure(fused) == jax.tree.structure(after)
    for got, expected in zip(jax.tree.leaves(fused), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    joined = family != "deepseek_v3"  # latent attention has no q/k/v to join
    assert all((lw.fused is not None) == joined for lw in fused.layers)


def test_a_field_is_written_into_memory_taken_before_its_pieces() -> None:
    """``to_field_into`` gives ``to_field``'s value in the buffer it was handed (donated)."""
    config = load_model_config(fixture_dir("llama"))
    field = next(f for f in layer_fields(config, 0) if f.name == "wq")
    stored = np.random.default_rng(0).standard_normal(field.checkpoint_shape_for(config))
    pieces = [jnp.asarray(part) for part in np.array_split(stored.astype(np.float32).ravel(), 3)]
    shape = (1, *stored.shape)
    expected = to_field(pieces, field, config, shape, jnp.bfloat16)
    out = jnp.zeros(field.shape_for(config), jnp.bfloat16)
    got = to_field_into(out, pieces, field, config, shape)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert out.is_deleted()  # the value lives in the buffer made before the pieces


def test_host_memory_is_the_staging_buffers_not_a_tensor(tmp_path) -> None:
    """A checkpoint with two 8 MiB tensors loads through 1 MiB of staging buffers: numpy's
    traced peak stays near that, far below one tensor."""
    source = fixture_dir("llama")
    hf = json.loads((source / "config.json").read_text()) | {"vocab_size": 32768}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = load_model_config(tmp_path)
    tensors = load_file(source / "model.safetensors")
    rng = np.random.default_rng(0)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = rng.standard_normal((32768, 64), np.float32)  # 8 MiB each
    save_file(tensors, tmp_path / "model.safetensors")
    del tensors
    load = lambda: load_weights(tmp_path, config, jnp.bfloat16, num_threads=2, staging_bytes=MiB)
    jax.block_until_ready(load())  # the conversion programs compiled outside the measurement
    tracemalloc.start()
    try:
        weights = jax.block_until_ready(load())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * MiB, f"{peak / MiB:.1f} MiB traced"
    assert weights.embed.shape == (32768, 64)


def test_reader_pieces_with_one_buffer_and_many_threads(tmp_path) -> None:
    """One staging buffer shared by four threads: no thread waits forever, every tensor's
    pieces join to its bytes, and several tensors stack."""
    tensors = {f"t{i}": np.arange(i * 1000, i * 1000 + 999, dtype=np.float32) for i in range(8)}
    tensors["empty"] = np.zeros((0, 3), np.float32)
    save_file(tensors, tmp_path / "a.safetensors")
    files = dict.fromkeys(tensors, tmp_path / "a.safetensors")
    counted = []
    with CheckpointReader(files, lambda f, n: counted.append(n), 1, 256) as reader:
        from concurrent.futures import ThreadPoolExecutor

        def read(names):
            return np.asarray(jnp.concatenate(reader.read_to_device(names)))

        with ThreadPoolExecutor(4) as pool:
            singles = list(pool.map(lambda i: read([f"t{i}"]), range(8)))
        stacked = read(["t1", "t2", "t3"]).reshape(3, 999)
        assert read(["empty"]).size == 0
        np.testing.assert_array_equal(reader.read_to_host("t5"), tensors["t5"])
    for i, single in enumerate(singles):
        np.testing.assert_array_equal(single, tensors[f"t{i}"])
    np.testing.assert_array_equal(stacked, np.stack([tensors[f"t{i}"] for i in (1, 2, 3)]))
    assert sum(counted) == 4 * (8 * 999 + 3 * 999 + 999)


def copy_fixture(tmp_path: Path, tensors: dict[str, np.ndarray]) -> Path:
    save_file(tensors, tmp_path / "model.safetensors")
    shutil.copy(fixture_dir("llama") / "config.json", tmp_path / "config.json")
    return tmp_path


def test_a_misshapen_tensor_names_file_tensor_and_shapes(tmp_path) -> None:
    tensors = load_file(fixture_dir("llama") / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((96, 63), np.float32)
    model_dir = copy_fixture(tmp_path, tensors)
    match = r"model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight' has shape \[96, 63\], expected \[96, 64\]"  # noqa: E501
    with pytest.raises(WeightsError, match=match):
        load_weights(model_dir, load_model_config(model_dir), jnp.float32)


def test_a_cut_short_file_a_bad_header_and_a_missing_shard_are_named(tmp_path) -> None:
    model_dir = copy_fixture(tmp_path, load_file(fixture_dir("llama") / "model.safetensors"))
    config = load_model_config(model_dir)
    data = (model_dir / "model.safetensors").read_bytes()
    (model_dir / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(WeightsError, match=r"model.safetensors: tensor '.*' \(F32\[.*\]\) has"):
        load_weights(model_dir, config, jnp.float32)
    (model_dir / "model.safetensors").write_bytes((9).to_bytes(8, "little") + b"{not json")
    with pytest.raises(WeightsError, match="model.safetensors: not a safetensors file"):
        load_weights(model_dir, config, jnp.float32)
    (model_dir / "model.safetensors").write_bytes(data)
    with safe_open(model_dir / "model.safetensors", framework="numpy") as f:
        weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    index = {"metadata": {}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match="model-00002-of-00002.safetensors: file named by the"):
        load_weights(model_dir, config, jnp.float32)


def test_a_failed_read_gives_its_buffers_back(tmp_path) -> None:
    """Reads that fail return their staging buffers: the other threads, sharing two buffers,
    still finish."""
    tensors = {f"t{i}": np.full(1000, i, np.float32) for i in range(8)}
    save_file(tensors, tmp_path / "a.safetensors")

    class Failing(CheckpointReader):
        def _read(self, info, offset, out):
            if info.name in ("t3", "t5"):
                raise OSError("disk gone")
            super()._read(info, offset, out)

    from concurrent.futures import ThreadPoolExecutor

    with Failing(dict.fromkeys(tensors, tmp_path / "a.safetensors"), None, 2, 512) as reader:
        pool = ThreadPoolExecutor(2)
        futures = {i: pool.submit(reader.read_to_device, [f"t{i}"]) for i in range(8)}
        for i, future in futures.items():
            if i in (3, 5):
                with pytest.raises(OSError, match="disk gone"):
                    future.result(timeout=60)
            else:
                np.testing.assert_array_equal(
                    np.asarray(jnp.concatenate(future.result(timeout=60))), tensors[f"t{i}"]
                )
        pool.shutdown(wait=False)


# -- a start-up that fails or is interrupted stops the load ----------------------------------


def test_a_set_stop_ends_a_load_and_dummy_weights_at_the_next_tensor() -> None:
    model_dir = fixture_dir("llama")
    config = load_model_config(model_dir)
    stop = threading.Event()
    stop.set()
    with pytest.raises(LoadCancelled):
        load_weights(model_dir, config, jnp.float32, stop=stop)
    with pytest.raises(LoadCancelled):
        dummy_weights(config, jnp.float32, stop=stop)


def held_load() -> tuple[WeightsLoading, threading.Thread]:
    """Weights loading on their thread (``shapes`` given) that load until told to stop, then
    raise ``LoadCancelled``; and that thread, once the load has begun."""
    started = threading.Event()

    def load(stop: threading.Event):
        started.set()
        assert stop.wait(60), "the load was never told to stop"
        raise LoadCancelled

    loading = WeightsLoading(load, shapes=object(), stop=threading.Event())
    assert started.wait(60)
    (thread,) = [t for t in threading.enumerate() if t.name.startswith("weights")]
    return loading, thread


def test_cancel_reaches_a_load_on_its_thread() -> None:
    """Guards the start-up that failed while its weights went on loading: nothing stopped the
    load's thread, and the interpreter's exit waited for it (minutes, gigabytes)."""
    loading, thread = held_load()
    loading.cancel()
    thread.join(60)
    assert not thread.is_alive()


def test_a_ctrl_c_while_waiting_for_the_weights_stops_their_load(monkeypatch) -> None:
    """Guards the start that hung after Ctrl-C when the compiles had ended first: the main
    thread waited for the weights, the interrupt left that wait, and its clean-up joined the
    load's thread, which waited to be told to stop. Now the wait raises at once and the load
    stops."""
    from jaxserve.runner import model_weights

    loading, thread = held_load()
    real = loading._future
    assert real is not None

    def interrupted_wait(future):  # the wait for the weights, left by a Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(model_weights, "interruptible_result", interrupted_wait)
    outcome: list[str] = []

    def wait() -> None:
        try:
            loading.wait()
        except KeyboardInterrupt:
            outcome.append("interrupted")

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(20)
    hung = waiter.is_alive()
    loading._stop.set()  # let a hung wait go, whatever happened
    assert not hung and outcome == ["interrupted"], "the wait joined the load's thread"
    thread.join(60)
    assert not thread.is_alive() and isinstance(real.exception(), LoadCancelled)


SIGINT_ON_ANOTHER_THREAD = """
import signal, threading
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job's is SIG_IGN
from tests.test_loading import held_load
loading, _ = held_load()
def ctrl_c_lands_here():  # as the kernel may choose: a thread that is not the main one
    threading.Event().wait(0.5)  # the main thread waits for the weights by then
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)
threading.Thread(target=ctrl_c_lands_here).start()
try:
    loading.wait()
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_a_ctrl_c_taken_by_another_thread_reaches_the_wait_for_the_weights() -> None:
    """Guards the start that could hang after Ctrl-C: the signal went to one of the process's
    other threads, and the main thread, waiting for weights that wait to be told to stop,
    never woke to run Python's handler."""
    proc = subprocess.run(
        [sys.executable, "-c", SIGINT_ON_ANOTHER_THREAD],
        cwd=Path(__file__).resolve().parents[1],  # (the script imports held_load from here)
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "interrupted", proc.stderr[-2000:]


@pytest.mark.parametrize("let_go", ["forget", "cancel"])
def test_a_finished_load_lets_go_of_the_weights_it_made(let_go: str) -> None:
    """Weights leave the device only when nothing holds them, and a finished load held its
    own (in its future, then its result): ``forget`` (a sleeping model: they stayed on the
    device through sleep) and ``cancel`` (a runner shut down: they stayed beside the next
    engine's) drop them; once is enough, again changes nothing."""

    class Weights:
        pass

    loading = WeightsLoading(lambda stop: (Weights(), 1.5), shapes=object(), stop=threading.Event())
    weights, seconds = loading.wait()
    alive = weakref.ref(weights)
    del weights
    getattr(loading, let_go)()
    getattr(loading, let_go)()
    gc.collect()
    assert alive() is None and seconds == 1.5
    with pytest.raises(RuntimeError, match="let go"):
        loading.wait()


@pytest.mark.parametrize(
    ("bytes_per_s", "text"),
    [(2.5e9, "2.50 GB/s"), (1e9, "1.00 GB/s"), (4.4e8, "440 MB/s"), (3.2e6, "3.2 MB/s")],
)
def test_the_load_rate_says_something_for_small_models(bytes_per_s, text) -> None:
    """A small model's load line said "(0.00 GB/s)"."""
    assert format_rate(bytes_per_s) == text
