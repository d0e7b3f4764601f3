"""The start-up says what it is doing: devices, model and dtype, attention path, weight-loading
progress, capacity and each compile stage; ``LLM()`` shows it too, and start-up memory does not
grow with the largest token bucket.

One subprocess runs ``jaxserve.LLM()`` as a fresh notebook would (nothing has set up logging),
on a one-layer model with a wide KV (16 KV heads of 128) and random weights, so that running
the largest bucket's reference attention would take 2 GiB of host memory.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.engine_config import EngineConfig
from jaxserve.models.families.registry import load_model_config
from jaxserve.models.loading.checkpoint_loader import load_weights
from jaxserve.runner.devices import describe_attention, quiet_backend_probe
from jaxserve.runner.runner import ModelRunner
from jaxserve.runner.sampling import SamplerFlags
from pallas_kernels.ragged_paged_attention import dispatch
from tests.conftest import fixture_dir

NUM_VARIANTS = len(SamplerFlags.compact_variants())  # the CPU's default

GiB = 1024**3
WIDE_KV_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
# Token buckets 16 and 32. The reference attention gathers every query row's whole context:
# K and V rows of [T, 4096, 16, 128] f32, 2 GiB at T = 32 (1 GiB at 16, the bucket run).
# NOTE: the peak is VmHWM, this process's own; getrusage's ru_maxrss would also count the
# parent's resident memory (the pytest process's) when the child was started.
LLM_SCRIPT = """
import re, sys
from pathlib import Path
import jaxserve
jaxserve.LLM(sys.argv[1], load_format="dummy", dtype="float32", max_num_seqs=1,
             max_num_batched_tokens=32, num_gpu_blocks_override=256)
peak_kib = re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)
print("peak_rss_bytes", int(peak_kib) * 1024)
"""


@pytest.fixture(scope="module")
def notebook_start(tmp_path_factory) -> tuple[str, int]:
    """(stderr, peak RSS in bytes) of ``jaxserve.LLM()`` in a fresh process."""
    model_dir = tmp_path_factory.mktemp("wide-kv")
    (model_dir / "config.json").write_text(json.dumps(WIDE_KV_CONFIG))
    proc = subprocess.run(
        [sys.executable, "-c", LLM_SCRIPT, str(model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    peak = int(re.search(r"peak_rss_bytes (\d+)", proc.stdout).group(1))  # type: ignore[union-attr]
    return proc.stderr, peak


def test_llm_shows_each_startup_stage_in_order_where_logging_is_not_set_up(notebook_start):
    stderr, _ = notebook_start
    expected = [
        r"INFO .* jaxserve\.runner\.runner: Devices: 1 x cpu\n",
        r"Model: .*wide-kv.* \(llama, 1 layer, .* parameters, random weights .*\), dtype "
        r"float32 \(--dtype\), max model len 4,096\n",
        r"Attention: pure-jnp reference \(no Pallas kernel runs on the cpu backend\)\n",
        r"KV cache size: 4,096 tokens \(KV cache dtype float32\)\n",
        r"Compiling the model step for 2 token buckets \(16, 32\)\n",
        r"Compiled model step for \d+ tokens \(2/2\)",
        rf"Compiling the logits, the prompt logprobs and {NUM_VARIANTS} sampler variants for "
        rf"the buckets of 16, 32 tokens \({4 + NUM_VARIANTS} programs\)\n",
        r"Compiled the programs of \d+ tokens \(2/2\)",
        r"Weights ready \d+\.\d s after the compile \(\d+\.\d s to load, beside it\)\n",
        r"Allocated the KV cache \(64\.0 MiB\)",
        r"Compiled 2 step shapes in",
    ]
    # Made on a thread of their own while the step compiles: logged in no fixed place.
    assert re.search(r"Made random weights in \d+\.\d s\n", stderr), stderr
    position = 0
    for pattern in expected:
        match = re.compile(pattern).search(stderr, position)
        assert match is not None, f"{pattern!r} not found after position {position}:\n{stderr}"
        position = match.end()


def test_startup_peak_memory_stays_below_what_running_the_largest_bucket_takes(notebook_start):
    """Warm-up compiles the 32-token bucket but does not run it: before, running it took the
    start to 2.6 GB (its attention alone gathers 2 GiB); now the start peaks at about 1.6 GB."""
    _, peak = notebook_start
    assert peak < 2 * GiB, f"peak RSS {peak / GiB:.2f} GiB"


# The tiny llama fixture with two token buckets (16, 32), warmed up by the tests themselves.
SMALL_CONFIG = EngineConfig(
    model=str(fixture_dir("llama")),
    dtype="float32",
    max_model_len=128,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    block_size=4,
    num_gpu_blocks_override=128,
    warmup=False,
)


def test_warm_up_compiles_every_bucket_but_runs_only_the_smallest(monkeypatch):
    config = SMALL_CONFIG
    runner = ModelRunner(load_model_config(config.model_dir), config)
    runner.kv_cache = None  # allocated by warm-up, as with warmup=True
    ran = []
    run_step = runner.programs.run_step

    def recording_run_step(kv_cache, batch, *args):
        ran.append(batch.input_ids.shape[0])
        return run_step(kv_cache, batch, *args)

    monkeypatch.setattr(runner.programs, "run_step", recording_run_step)
    runner.warmup()
    programs = runner.programs
    assert sorted(programs.compiled_steps) == list(runner.buckets.token_buckets) == [16, 32]
    assert sorted(programs.compiled_prompt_lp) == sorted(programs.compiled_logits) == [16, 32]
    # the variants of one sequence bucket: both token buckets sample 8 rows
    assert sorted({rows for rows, _ in programs.compiled_samplers}) == [8]
    assert len(programs.compiled_samplers) == NUM_VARIANTS
    assert ran == [16, 16]  # the second reads its input ids from the first's samples
    assert runner.kv_cache is not None


def test_warm_up_warns_when_a_steps_temporaries_exceed_the_headroom(caplog, monkeypatch):
    """Before the KV cache: each compiled step's temporaries, as XLA planned them, against the
    activation headroom the cache leaves; the largest over it is named with the way out. On an
    accelerator only (``checks_step_memory``; the CPU's temporaries come from the host's
    memory, which the plan does not size): the CPU stands in for one here."""
    import dataclasses

    from jaxserve.runner import warmup

    config = SMALL_CONFIG
    for headroom, accelerator, warned in ((None, True, False), (1, True, True), (1, False, False)):
        monkeypatch.setattr(warmup, "checks_step_memory", lambda a=accelerator: a)
        runner = ModelRunner(load_model_config(config.model_dir), config)
        runner.kv_cache = None  # allocated by warm-up, as with warmup=True
        if headroom is not None:
            runner.capacity = dataclasses.replace(runner.capacity, activation_bytes=headroom)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jaxserve.runner.warmup"):
            runner.warmup()
        steps = runner.programs.compiled_steps
        temps = [step.memory_analysis().temp_size_in_bytes for step in steps.values()]
        assert all(0 < t < runner.capacity.activation_bytes for t in temps) != (headroom == 1)
        assert (
            re.search(
                r"The model step of 32 tokens needs [\d.]+ [KMG]iB of temporary buffers, more "
                r"than the 0.0 MiB of activation headroom planned beside the KV cache: .*Smaller "
                r"steps \(--max-num-batched-tokens\), fewer KV blocks "
                r"\(--num-gpu-blocks-override\) or a larger allocator pool "
                r"\(XLA_PYTHON_CLIENT_MEM_FRACTION above --gpu-memory-utilization\)",
                caplog.text,
            )
            is not None
        ) == warned, caplog.text


def test_the_background_compile_checks_its_steps_against_the_headroom_too(caplog, monkeypatch):
    """Serving early, the larger buckets compile after the KV cache: each check names the
    largest step compiled so far (16 tokens before the cache, 32 after the background)."""
    import dataclasses

    from jaxserve.runner import warmup

    monkeypatch.setattr(warmup, "checks_step_memory", lambda: True)  # as on an accelerator
    config = dataclasses.replace(SMALL_CONFIG, serve_while_compiling=True)
    runner = ModelRunner(load_model_config(config.model_dir), config)
    runner.kv_cache = None
    runner.capacity = dataclasses.replace(runner.capacity, activation_bytes=1)
    with caplog.at_level(logging.WARNING, logger="jaxserve.runner.warmup"):
        runner.warmup()
        assert runner.programs.background.thread is not None
        runner.programs.background.thread.join(timeout=120)
    steps = re.findall(r"The model step of (\d+) tokens needs", caplog.text)
    assert steps == ["16", "32"], caplog.text
    runner.programs.background.stop()


def test_backend_probe_shows_only_at_debug_level(caplog):
    quiet_backend_probe()
    probe = logging.getLogger("jax._src.xla_bridge")
    message = "Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so"
    with caplog.at_level(logging.INFO):
        probe.info(message)
        probe.info("Another backend message")
    assert [r.getMessage() for r in caplog.records] == ["Another backend message"]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="jax._src.xla_bridge"):
        probe.info(message)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("DEBUG", message)]


def test_attention_line_names_the_reference_and_why_on_cpu():
    config = load_model_config(fixture_dir("llama"))
    line = describe_attention(config, jnp.float32, block_size=16, tensor_parallel_size=1)
    assert line == "Attention: pure-jnp reference (no Pallas kernel runs on the cpu backend)"


def test_head_dim_256_takes_mosaic_for_steps_with_a_long_prefill(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper_or_newer", lambda: True)
    monkeypatch.delenv("JAXSERVE_ATTENTION", raising=False)
    k_pages = jax.ShapeDtypeStruct((1, 16, 8, 256), jnp.bfloat16)
    for tokens, want in ((16, "triton"), (512, "triton"), (1024, "gpu"), (8192, "gpu")):
        q = jax.ShapeDtypeStruct((tokens, 16, 256), jnp.bfloat16)
        assert dispatch.choose_kernel(q, k_pages)[0] == want


@pytest.mark.parametrize(
    ("is_hopper", "head_dim", "want"),
    [
        (True, 128, "gpu"),  # the Mosaic kernel's fp8 path
        (False, 128, "triton"),  # Ada (compute capability 8.9): tiles converted in registers
        (True, 256, "triton"),  # a head size the Mosaic fp8 path does not take
    ],
)
def test_an_fp8_cache_takes_a_kernel_wherever_one_reads_it(monkeypatch, is_hopper, head_dim, want):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper_or_newer", lambda: is_hopper)
    monkeypatch.setattr(dispatch, "_compute_capability", lambda: "8.9")
    monkeypatch.delenv("JAXSERVE_ATTENTION", raising=False)
    q = jax.ShapeDtypeStruct((1, 8, head_dim), jnp.bfloat16)
    for kv_dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        k_pages = jax.ShapeDtypeStruct((1, 16, 2, head_dim), kv_dtype)
        assert dispatch.choose_kernel(q, k_pages)[0] == want


@pytest.mark.parametrize(
    ("is_hopper", "env", "dtype", "head_dim", "want"),
    [
        (True, None, jnp.bfloat16, 128, ("gpu", None)),
        (True, None, jnp.float16, 256, ("triton", "faster than the Mosaic GPU kernel")),
        (True, "mosaic", jnp.float16, 256, ("gpu", None)),
        (True, None, jnp.bfloat16, 96, ("gpu", None)),
        (False, None, jnp.bfloat16, 128, ("triton", "needs Hopper or newer")),
        (False, None, jnp.float16, 80, ("triton", "this GPU has 8.0")),
        (True, None, jnp.bfloat16, 112, ("triton", "head_dim=112")),
        (True, None, jnp.bfloat16, 80, ("triton", "head_dim=80")),
        (True, None, jnp.float32, 128, ("reference", "the Triton kernel does not run it either")),
        (False, None, jnp.bfloat16, 288, ("reference", "multiples of 16 up to 256")),
        (True, "triton", jnp.bfloat16, 128, ("triton", "JAXSERVE_ATTENTION=triton")),
        (False, "mosaic", jnp.bfloat16, 128, ("reference", "JAXSERVE_ATTENTION=mosaic")),
        (True, "reference", jnp.bfloat16, 128, ("reference", "JAXSERVE_ATTENTION=reference")),
        (True, "Auto", jnp.bfloat16, 128, ("gpu", None)),
    ],
)
def test_choose_kernel_on_a_gpu_says_why_it_falls_back(
    monkeypatch, is_hopper, env, dtype, head_dim, want
):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper_or_newer", lambda: is_hopper)
    monkeypatch.setattr(dispatch, "_compute_capability", lambda: "8.0")
    if env is None:
        monkeypatch.delenv("JAXSERVE_ATTENTION", raising=False)
    else:
        monkeypatch.setenv("JAXSERVE_ATTENTION", env)
    q = jax.ShapeDtypeStruct((1, 8, head_dim), dtype)
    k_pages = jax.ShapeDtypeStruct((1, 16, 2, head_dim), dtype)
    kernel, reason = dispatch.choose_kernel(q, k_pages)
    assert kernel == want[0]
    if want[1] is None:
        assert reason is None
    else:
        assert want[1] in reason


def test_attention_line_on_a_pre_hopper_gpu_names_the_triton_kernel(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper_or_newer", lambda: False)
    monkeypatch.setattr(dispatch, "_compute_capability", lambda: "8.9")
    monkeypatch.delenv("JAXSERVE_ATTENTION", raising=False)
    config = load_model_config(fixture_dir("gemma2"))
    line = describe_attention(config, jnp.bfloat16, block_size=16, tensor_parallel_size=1)
    assert line == (
        "Attention: Pallas Triton kernel (the Mosaic GPU kernel needs Hopper or newer "
        "(compute capability 9.0); this GPU has 8.9)"
    )


def test_attention_env_rejects_an_unknown_backend(monkeypatch):
    monkeypatch.setenv("JAXSERVE_ATTENTION", "flash")
    q = jax.ShapeDtypeStruct((1, 8, 64), jnp.bfloat16)
    k_pages = jax.ShapeDtypeStruct((1, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="JAXSERVE_ATTENTION='flash' must be one of auto, mosaic"):
        dispatch.choose_kernel(q, k_pages)


def write_sharded_checkpoint(source: Path, target: Path, num_shards: int) -> int:
    """``source``'s tensors split over ``num_shards`` files with an index; returns their bytes."""
    tensors = load_file(source / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for shard, chunk in enumerate(np.array_split(np.array(names), num_shards), 1):
        file = f"model-{shard:05d}-of-{num_shards:05d}.safetensors"
        save_file({str(name): tensors[str(name)] for name in chunk}, target / file)
        weight_map.update(dict.fromkeys(map(str, chunk), file))
    index = {"metadata": {}, "weight_map": weight_map}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    (target / "config.json").write_text((source / "config.json").read_text())
    return sum(t.nbytes for t in tensors.values())


def test_loading_a_sharded_checkpoint_logs_bytes_and_shards(tmp_path, caplog):
    num_bytes = write_sharded_checkpoint(fixture_dir("llama"), tmp_path, num_shards=3)
    config = load_model_config(tmp_path)
    with caplog.at_level(logging.INFO, logger="jaxserve.models.loading.checkpoint_loader"):
        load_weights(tmp_path, config, jnp.float32, progress_above_bytes=0)
    lines = [r.getMessage() for r in caplog.records]
    progress = [re.match(r"Loading weights: (\d+)% \(.* of .*\), shard (\d) of 3, at", line)
                for line in lines[:-1]]  # fmt: skip
    assert all(progress), lines
    percents = [int(m.group(1)) for m in progress]  # type: ignore[union-attr]
    assert percents == sorted(set(percents)) and percents[0] >= 10 and percents[-1] >= 90
    assert {int(m.group(2)) for m in progress} == {1, 2, 3}  # type: ignore[union-attr]
    assert re.fullmatch(
        rf"Loaded weights: {num_bytes / 1024**2:.1f} MiB from 3 shards in \d+\.\d s "
        r"\((\d+\.\d\d GB/s|\d+(\.\d)? MB/s)\)",  # a small checkpoint: MB/s
        lines[-1],
    )


def test_loading_a_small_checkpoint_logs_one_line(caplog):
    model_dir = fixture_dir("llama")
    with caplog.at_level(logging.INFO, logger="jaxserve.models.loading.checkpoint_loader"):
        load_weights(model_dir, load_model_config(model_dir), jnp.float32)
    assert [r.getMessage()[:30] for r in caplog.records] == ["Loaded weights: 0.4 MiB from 1"]


def test_programs_lower_with_fewer_collections_and_the_threshold_comes_back() -> None:
    import gc

    from jaxserve.runner.warmup import fewer_collections

    before = gc.get_threshold()
    with fewer_collections(50_000):
        assert gc.get_threshold() == (50_000, *before[1:])
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError), fewer_collections():
        raise RuntimeError("a lowering failed")
    assert gc.get_threshold() == before


def test_no_sampler_variant_branches_on_the_device() -> None:
    """No compiled sampler holds an HLO ``conditional``: on a GPU, XLA copies a conditional's
    predicate to the host and waits for the device to reach it, so a branching sampler would
    stall the engine's host until the step before it had run."""
    from tests.test_engine import make_llm

    llm = make_llm()
    runner = llm.engine.runner
    assert runner.programs.compiled_samplers
    for (rows, flags), compiled in runner.programs.compiled_samplers.items():
        assert " conditional(" not in compiled.as_text(), (rows, flags)
    for bucket, compiled in runner.programs.compiled_logits.items():
        assert " conditional(" not in compiled.as_text(), bucket
    llm.shutdown()


HIDDEN_TORCH_SCRIPT = """
import importlib.util, sys
sys.path.insert(0, sys.argv[1])  # a package named torch that leaves a mark when imported
assert importlib.util.find_spec("torch") is not None
from jaxserve.cli import main
main(["capacity", sys.argv[2]])  # reads the config through transformers
from jaxserve.engine.tokenizer import Tokenizer
Tokenizer(sys.argv[3])
from transformers.utils import is_torch_available
print("torch available to transformers:", is_torch_available())
"""


def test_launch_and_capacity_hide_torch_from_transformers(tmp_path) -> None:
    # where torch is installed, transformers imported it (and torchvision) for each config and
    # tokenizer: 5-9 s of a start on the H200 host; the server never runs it
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    mark = tmp_path / "imported"
    (fake / "__init__.py").write_text(f"open({str(mark)!r}, 'w').close()\n__version__ = '2.11.0'\n")
    demo = Path(__file__).parents[1] / "jaxserve" / "assets" / "demo"
    args = [str(tmp_path / "site"), str(fixture_dir("llama")), str(demo)]
    done = subprocess.run(
        [sys.executable, "-c", HIDDEN_TORCH_SCRIPT, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "torch available to transformers: False" in done.stdout
    assert not mark.exists()
