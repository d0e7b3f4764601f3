"""The seam between the engine and the runner: the Runner protocol loads no jax, a step's
token mask crosses it as a value (``dispatch``, ``sample(step, mask)``, ``collect``), and the
output processor is the one writer of a sequence's finish and stop reasons."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.request import Request, Sequence
from jaxserve.runner.packing import ALIGN, pack, unpack, write_rows
from jaxserve.runner.sampling import TOKEN_MASK_LEAF, SamplingInputs, mask_width
from jaxserve.runner.step import ScheduledSeq, SchedulerOutput
from jaxserve.sampling_params import SamplingParams
from tests.conftest import tiny_engine_config

ROOT = Path(__file__).parents[1]


def test_the_runner_protocol_loads_no_jax() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, jaxserve.engine.interfaces; print('jax' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_only_the_output_processor_writes_finish_and_stop_reasons() -> None:
    """Of a sequence: ``RequestOutput.merge`` (outputs.py) copies a delta's into the output a
    client accumulates."""
    writers = []
    for path in sorted((ROOT / "jaxserve" / "engine").rglob("*.py")):
        if path.name == "outputs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                names = target.elts if isinstance(target, ast.Tuple) else [target]
                for name in names:
                    if isinstance(name, ast.Attribute) and name.attr in {
                        "finish_reason",
                        "stop_reason",
                    }:
                        writers.append(f"{path.name}:{node.lineno}")
    assert writers and all(w.startswith("output_processor.py:") for w in writers), writers


def test_write_rows_puts_the_mask_over_the_leading_rows_of_its_leaf() -> None:
    inputs = SamplingInputs.padding(4, 100, use_mask=True)
    packed, layout = pack(inputs)
    mask = np.arange(2 * mask_width(100), dtype=np.int32).reshape(2, -1)
    write_rows(packed, layout, TOKEN_MASK_LEAF, mask)
    expected = np.array(inputs.token_mask)
    expected[:2] = mask
    again, _ = pack(SamplingInputs(**{**vars(inputs), "token_mask": expected}))
    np.testing.assert_array_equal(packed, again)
    with pytest.raises(ValueError, match="do not fit"):
        write_rows(packed, layout, TOKEN_MASK_LEAF, np.zeros((5, mask_width(100)), np.int32))


def test_every_packed_leaf_starts_on_a_256_byte_boundary_and_unpacks_to_itself() -> None:
    # Mosaic GPU kernels refuse inputs that are not 256-byte aligned, and XLA may hand them a
    # slice of the packed buffer as a pointer into it: eight sequences once put leaves at
    # offsets such as 9 and 17 (the H200's "Input buffer 1 is not 256-byte aligned").
    tree = {
        "cu_q_lens": np.arange(9, dtype=np.int32),
        "positions": np.arange(8, dtype=np.int32) + 100,
        "temperature": np.linspace(0.1, 1.0, 65, dtype=np.float32).reshape(5, 13),
        "empty": np.zeros(0, np.int32),
        "seeds": np.array([7, 8, 9], np.uint32),
    }
    packed, layout = pack(tree)
    assert all(offset % ALIGN == 0 for offset in layout.offsets)
    assert ALIGN * 4 == 256 and packed.size == layout.size == 5 * ALIGN  # 9, 8, 65, 0, 3
    back = jax.jit(unpack, static_argnums=1)(jnp.asarray(packed), layout)
    for name, leaf in tree.items():
        np.testing.assert_array_equal(np.asarray(back[name]), leaf)
        assert back[name].dtype == leaf.dtype


def step_of(seq: Sequence, is_new: bool, is_constrained: bool) -> SchedulerOutput:
    start = 0 if is_new else seq.num_tokens - 1
    item = ScheduledSeq(seq, seq.num_tokens - start, start, is_new=is_new)
    return SchedulerOutput([item], item.num_new_tokens, is_constrained=is_constrained)


def test_a_constrained_step_samples_only_what_its_mask_allows() -> None:
    from jaxserve.models.families.registry import load_model_config
    from jaxserve.runner.runner import ModelRunner

    config = tiny_engine_config(
        "t", max_model_len=64, max_num_batched_tokens=16, max_num_seqs=2, warmup=False
    )
    model_config = load_model_config(config.model)
    runner = ModelRunner(model_config, config)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=8)
    request = Request("r", None, [5, 17, 40, 41], params, arrival_time=0.0)
    seq = Sequence("r#0", request, 0, seed=3)
    seq.block_ids = [0, 1]
    width = mask_width(model_config.vocab_size)
    for token in (7, 123):  # each step's mask allows one token
        mask = np.zeros((1, width), np.int32)
        mask.view(np.uint32)[0, token // 32] = np.uint32(1 << (token % 32))
        step = runner.dispatch(step_of(seq, not seq.output_token_ids, True))
        runner.sample(step, mask)
        mask[:] = -1  # the runner copied it: the engine's buffer may take the next step's
        (sampled,) = runner.collect(step).token_ids
        assert sampled == token
        seq.append_token(int(sampled))
    unconstrained = runner.dispatch(step_of(seq, False, False))
    with pytest.raises(ValueError, match="without is_constrained"):
        runner.sample(unconstrained, mask)
    runner.shutdown()
