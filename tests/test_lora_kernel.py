"""The grouped LoRA kernel (pallas_kernels/lora): the Pallas Triton shrink and expand against the
dense reference over a grid of tokens, slots used, ranks, in/out sizes and base-model tokens;
its sort and tiles; the choice of path; the model's product through the dispatch.

On the CPU (CI) the kernel runs in Pallas interpret mode on small shapes and is lowered to
Triton IR for an (abstract) H200; the ``gpu`` test runs it natively at Llama-3-8B's shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lora import dispatch, reference, split_k
from pallas_kernels.lora import triton as lt

# The Pallas Triton backend warns at lowering that it is deprecated (jax 0.11).
DEPRECATED = "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    slots: tuple[int, ...]  # each token's slot, 0: the base model
    num_slots: int  # M
    rank: int  # R per projection
    size_x: int
    size_os: tuple[int, ...]  # one expand per output (their A matrices joined)
    dtype: str = "float32"
    config: lt.LoraKernelConfig = lt.LoraKernelConfig(block_k=16, block_n=16)


def _mixed(num_tokens: int, num_slots: int, seed: int) -> tuple[int, ...]:
    return tuple(int(s) for s in np.random.default_rng(seed).integers(0, num_slots + 1, num_tokens))


CPU_CASES = [
    # Decode at batch 1: one token on one slot of eight.
    Case("one_token_one_slot_of_8", (5,), 8, 16, 64, (48,)),
    # Only base-model tokens: zeros, no weight read.
    Case("base_tokens_only", (0, 0, 0, 0, 0), 4, 8, 32, (32,)),
    # Tokens of every slot and the base, shuffled; X and O the tiles do not divide; K split.
    Case(
        "mixed_ragged_split",
        _mixed(37, 4, 1),
        4,
        8,
        40,
        (24,),
        config=lt.LoraKernelConfig(block_k=16, block_n=16, num_splits=2),
    ),  # fmt: skip
    # q, k, v: one shrink over the joined A, three expands; a rank below the 16-wide tile.
    Case("qkv_rank4_three_expands", _mixed(19, 3, 2), 3, 4, 32, (32, 16, 16)),
    # Many tokens on one slot crossing 16-row blocks, a few on another, bf16.
    Case("one_slot_many_rows_bf16", (2,) * 40 + (1, 0, 1), 2, 16, 64, (64,), "bfloat16"),
    # Most slots unused at 8 slots, 64-row tiles, fp16, gate/up.
    Case(
        "few_of_8_slots_fp16",
        _mixed(24, 2, 3),
        8,
        8,
        48,
        (40, 40),
        "float16",
        config=lt.LoraKernelConfig(block_m=64, block_k=32, block_n=32),
    ),  # fmt: skip
    # One decode token on the two launches (the default at every size).
    Case(
        "one_token_two_launches",
        (5,),
        8,
        16,
        64,
        (48,),
        config=lt.LoraKernelConfig(block_k=16, block_n=16, fused=False),
    ),  # fmt: skip
    # Fused (one launch): q, k, v of mixed slots and the base, X the 16-wide steps do not divide.
    Case(
        "fused_qkv_ragged_x",
        _mixed(7, 3, 4),
        3,
        16,
        40,
        (48, 16, 16),
        config=lt.LoraKernelConfig(block_k=16, block_n=16, fused=True),
    ),  # fmt: skip
    # Fused in bf16 at decode, an output the column tiles do not divide.
    Case(
        "fused_decode_bf16",
        _mixed(12, 4, 5),
        4,
        16,
        64,
        (40,),
        "bfloat16",
        lt.LoraKernelConfig(fused=True),
    ),  # fmt: skip
    # Fused over several row tiles (forced): rows of one slot crossing 16-row blocks, rank 32.
    Case(
        "fused_rows_across_tiles",
        (1,) * 20 + (2, 0) * 6,
        2,
        32,
        32,
        (24, 24),
        config=lt.LoraKernelConfig(block_k=16, block_n=16, fused=True),
    ),  # fmt: skip
]


# The split-K one launch (``split_k.py``): the cases whose rank it takes, at forced splits of X
# (1, 2, 4: the splits' atomic adds, a split past X's end) and at its own plan.
SPLIT_K_CASES = [c for c in CPU_CASES if c.rank >= 16 and not c.rank & (c.rank - 1)]


def make_inputs(case: Case, seed: int):
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(case.dtype)
    n = len(case.size_os)
    x = rng.normal(size=(len(case.slots), case.size_x))
    a = rng.normal(size=(case.num_slots, n * case.rank, case.size_x)) / np.sqrt(case.size_x)
    bs = [
        rng.normal(size=(case.num_slots, case.rank, o)) / np.sqrt(case.rank) for o in case.size_os
    ]
    return (
        jnp.asarray(x, dtype),
        jnp.asarray(a, dtype),
        tuple(jnp.asarray(b, dtype) for b in bs),
        jnp.asarray(case.slots, jnp.int32),
    )


def numpy_deltas(x, a, bs, slots) -> list[np.ndarray]:
    """Token by token, in float64: x @ A[s - 1]^T @ B[s - 1] (A stored [n * R, X]), zeros for
    slot 0."""
    x, a = np.asarray(x, np.float64), np.swapaxes(np.asarray(a, np.float64), 1, 2)
    outs = []
    rank = a.shape[2] // len(bs)
    for i, b in enumerate(bs):
        b = np.asarray(b, np.float64)
        out = np.zeros((x.shape[0], b.shape[2]))
        for t, s in enumerate(np.asarray(slots)):
            if s:
                out[t] = x[t] @ a[s - 1][:, i * rank : (i + 1) * rank] @ b[s - 1]
        outs.append(out)
    return outs


def tolerance(dtype: str) -> float:
    return {"float32": 1e-4, "float16": 1e-2, "bfloat16": 6e-2}[dtype]


@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_interpret_matches_reference(case: Case):
    seed = int(np.random.default_rng().integers(2**31))  # fresh inputs every run
    x, a, bs, slots = make_inputs(case, seed)
    got = lt.lora_deltas(x, a, bs, slots, config=case.config, interpret=True)
    ref = reference.lora_deltas(x, a, bs, slots)
    want = numpy_deltas(x, a, bs, slots)
    base = np.asarray(slots) == 0
    for g, r, w in zip(got, ref, want, strict=True):
        assert g.shape == w.shape and g.dtype == x.dtype
        np.testing.assert_allclose(np.asarray(r, np.float64), w, atol=tolerance(case.dtype))
        np.testing.assert_allclose(
            np.asarray(g, np.float64), w, atol=tolerance(case.dtype), err_msg=f"{seed=}"
        )
        assert (np.asarray(g)[base] == 0).all()  # the base model's rows: exactly zero


def test_tokens_sort_by_slot_with_the_base_model_last():
    slots = jnp.array([0, 3, 1, 0, 3, 2, 1], jnp.int32)
    order, sizes = lt.sort_tokens(slots, 4)
    assert np.asarray(order).tolist() == [2, 6, 5, 1, 4, 0, 3]
    assert np.asarray(sizes).tolist() == [2, 1, 2, 0]


def test_the_shrink_splits_x_while_few_tiles_hold_rows():
    def splits(tokens: int, slots: int, size_x: int = 4096) -> int:
        tiles = lt.plan(tokens, slots, size_x, 132, lt.LoraKernelConfig())
        assert tiles.num_splits is not None
        return tiles.num_splits

    assert splits(1, 8) == 32  # decode at batch 1: 2 busy tiles, 32 splits of 128
    assert splits(64, 64) == 4  # 4 token blocks + 64 slots
    assert splits(256, 64) == 4
    assert splits(1, 1, 64) == 1  # X of one block_k step: never more splits than steps
    assert splits(1, 1, 512) == 4
    assert lt.plan(256, 1, 4096, 132, lt.LoraKernelConfig()).block_m == 64
    with pytest.raises(ValueError, match="block_k=24 must be a power of two"):
        lt.LoraKernelConfig(block_k=24)
    with pytest.raises(ValueError, match="num_splits=3 must be a power of two"):
        lt.LoraKernelConfig(num_splits=3)
    x, a = jnp.zeros((2, 8)), jnp.zeros((2, 4, 8))
    assert "b (2, 3, 8) must be [2, 4, O]" in str(
        lt.unsupported_reason(x, a, [jnp.zeros((2, 3, 8))])
    )
    assert "dtypes" in str(lt.unsupported_reason(x, a, [jnp.zeros((2, 4, 8), jnp.bfloat16)]))


def test_one_launch_only_when_asked_for_and_where_the_rank_fills_its_tile():
    """The fused form (shrink and expand in one launch) runs when the config asks for it (it
    measured slower than two launches in a step), at ranks that are powers of two from 16."""
    auto, on = lt.LoraKernelConfig(), lt.LoraKernelConfig(fused=True)
    assert not lt.use_fused(auto, 16) and not lt.use_fused(auto, 64)
    assert lt.use_fused(on, 16) and lt.use_fused(on, 64)
    assert not lt.use_fused(on, 8) and not lt.use_fused(on, 24)  # the rank's tile
    # its steps along X: longer than the shrink's, up to X's own power of two
    assert lt.plan(1, 8, 4096, 132, auto, fused=True).block_k == lt.FUSED_BLOCK_K
    assert lt.plan(1, 8, 40, 132, auto, fused=True).block_k == 64
    assert lt.plan(1, 8, 4096, 132, auto).block_k == 128


def test_dispatch_takes_the_reference_off_the_gpu_and_the_kernel_when_asked(monkeypatch):
    case = CPU_CASES[3]
    x, a, bs, slots = make_inputs(case, 0)
    want = reference.lora_deltas(x, a, bs, slots)
    monkeypatch.delenv(dispatch.LORA_KERNEL_ENV, raising=False)
    assert dispatch.choose()[0] == "reference"  # the CPU
    assert "dense one-hot product" in dispatch.describe()
    monkeypatch.setenv(dispatch.LORA_KERNEL_ENV, "triton")
    assert dispatch.choose()[0] == "interpret"
    got = dispatch.lora_deltas(x, a, bs, slots)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4)
    monkeypatch.setenv(dispatch.LORA_KERNEL_ENV, "yes")
    with pytest.raises(ValueError, match="JAXSERVE_LORA_KERNEL='yes' must be one of"):
        dispatch.choose()


def test_on_one_gpu_up_to_four_slots_take_the_dense_product(monkeypatch):
    """``auto`` on one GPU: the dense product for at most ``DENSE_MAX_SLOTS`` slots (faster with
    one on an H100), the kernel above; ``triton`` forces the kernel at any count. The
    start-up line says which and why. (The GPU is stood in for: the kernel is not called.)"""
    from pallas_kernels import env_choice

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(env_choice, "devices_per_model", lambda: 1)
    monkeypatch.delenv(dispatch.LORA_KERNEL_ENV, raising=False)
    assert dispatch.DENSE_MAX_SLOTS == 4
    assert dispatch.choose(1) == ("reference", "JAXSERVE_LORA_KERNEL=auto: 1 slot, at most 4")
    assert dispatch.choose(4)[0] == "reference"
    assert dispatch.choose(5) == ("triton", "JAXSERVE_LORA_KERNEL=auto: 5 slots, more than 4")
    assert dispatch.choose() == ("triton", "JAXSERVE_LORA_KERNEL=auto")
    assert dispatch.describe(1) == (
        "LoRA product: dense one-hot product over every slot (XLA: GEMMs; float32 sums for "
        "steps of at most 64 tokens) (JAXSERVE_LORA_KERNEL=auto: 1 slot, at most 4)"
    )
    assert dispatch.describe(64).startswith("LoRA product: Pallas Triton grouped kernel (")
    called = []
    monkeypatch.setattr(lt, "lora_deltas", lambda *a, **k: called.append("kernel"))
    real = reference.lora_deltas
    monkeypatch.setattr(
        reference, "lora_deltas", lambda *a, **k: called.append("dense") or real(*a, **k)
    )
    x, a, bs, slots = make_inputs(CPU_CASES[3], 0)
    for num_slots in (1, dispatch.DENSE_MAX_SLOTS, dispatch.DENSE_MAX_SLOTS + 1):
        stacked = jnp.concatenate([a] * num_slots)[:num_slots]
        dispatch.lora_deltas(x, stacked, [jnp.concatenate([b] * num_slots)[:num_slots] for b in bs],
                             jnp.minimum(slots, num_slots))  # fmt: skip
    assert called == ["dense", "dense", "kernel"]
    monkeypatch.setenv(dispatch.LORA_KERNEL_ENV, "triton")
    assert dispatch.choose(1) == ("triton", "JAXSERVE_LORA_KERNEL=triton")


@pytest.mark.parametrize("form", ["fused", "split_k"])
def test_a_step_above_the_decode_sizes_takes_two_launches_whatever_the_form(monkeypatch, form):
    """The one-launch forms serve steps of at most ``ONE_LAUNCH_MAX_TOKENS`` tokens; a larger
    step (a prefill's) takes two launches (split-K's float32 outputs planned 42 GiB at 8,192
    tokens). Recorded, not run: (module, fused) of each call."""
    monkeypatch.setenv(dispatch.LORA_KERNEL_ENV, "triton")
    monkeypatch.setenv(dispatch.LORA_FORM_ENV, form)
    called = []
    for module in (lt, split_k):
        monkeypatch.setattr(
            module,
            "lora_deltas",
            lambda *a, _m=module, config=None, **k: called.append((_m, config and config.fused)),
        )
    case = SPLIT_K_CASES[0]
    x, a, bs, slots = make_inputs(case, 0)
    for tokens in (dispatch.ONE_LAUNCH_MAX_TOKENS, dispatch.ONE_LAUNCH_MAX_TOKENS + 1):
        rows = np.arange(tokens) % x.shape[0]
        dispatch.lora_deltas(x[rows], a, bs, slots[rows])
    one_launch = (split_k, None) if form == "split_k" else (lt, True)
    assert called == [one_launch, (lt, False)]


@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.parametrize("form", ["fused", "split_k"])
def test_dispatch_runs_the_form_asked_for(monkeypatch, form):
    """``JAXSERVE_LORA_FORM`` picks the kernel's form (each matching the reference), and the
    start-up line names it; a rank the one-launch forms cannot tile takes two launches."""
    monkeypatch.setenv(dispatch.LORA_KERNEL_ENV, "triton")
    monkeypatch.setenv(dispatch.LORA_FORM_ENV, form)
    called = []
    for module in (lt, split_k):
        real = module.lora_deltas
        monkeypatch.setattr(
            module,
            "lora_deltas",
            lambda *a, _r=real, _m=module, **k: called.append(_m) or _r(*a, **k),
        )
    for case in (SPLIT_K_CASES[0], next(c for c in CPU_CASES if c.rank == 8)):
        x, a, bs, slots = make_inputs(case, 0)
        got = dispatch.lora_deltas(x, a, bs, slots)
        for g, w in zip(got, numpy_deltas(x, a, bs, slots), strict=True):
            np.testing.assert_allclose(np.asarray(g, np.float64), w, atol=1e-4)
    one_launch = split_k if form == "split_k" else lt
    assert called == [one_launch, lt]  # the rank-8 case: two launches
    assert f"{form.replace('_', '-')} form (JAXSERVE_LORA_FORM={form})" in dispatch.describe()
    monkeypatch.setenv(dispatch.LORA_FORM_ENV, "three")
    with pytest.raises(ValueError, match="JAXSERVE_LORA_FORM='three' must be one of"):
        dispatch.describe()


@pytest.mark.filterwarnings(DEPRECATED)
def test_the_model_product_through_the_kernel_equals_the_dense_one(monkeypatch):
    """models/lora.py's q/k/v, o, gate/up and down terms on the kernel (interpreted)."""
    from jaxserve.models import lora as ops

    m, h, r, heads = 3, 32, 4, (2, 16)
    keys = iter(jax.random.split(jax.random.key(1), 16))
    shapes = {"qkv_a": (m, 3 * r, h), "q_b": (m, r, 32), "k_b": (m, r, 16), "v_b": (m, r, 16),
              "o_a": (m, r, 32), "o_b": (m, r, h), "gate_up_a": (m, 2 * r, h),
              "gate_b": (m, r, 48), "up_b": (m, r, 48), "down_a": (m, r, 48),
              "down_b": (m, r, h)}  # fmt: skip
    layer = ops.LoraLayer(**{k: jax.random.normal(next(keys), s) for k, s in shapes.items()})
    inputs = ops.LoraInputs(ops.LoraWeights([layer]), jnp.array([0, 2, 1, 3, 2, 0, 3], jnp.int32))
    x = jax.random.normal(next(keys), (7, h))
    hidden = jax.random.normal(next(keys), (7, 48))

    def terms():
        lora = ops.LayerLora(layer, inputs.routing(x.dtype))
        return (
            *ops.qkv_deltas(x, lora, heads, (1, 16)),
            ops.o_delta(x.reshape(7, 2, 16), lora),
            *ops.gate_up_deltas(x, lora),
            ops.down_delta(hidden, lora),
        )

    monkeypatch.setenv(dispatch.LORA_KERNEL_ENV, "reference")
    dense = terms()
    monkeypatch.setenv(dispatch.LORA_KERNEL_ENV, "triton")
    for got, want in zip(terms(), dense, strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.parametrize("form", ["two_launch", "fused", "split_k"])
def test_a_norms_weight_read_in_equals_the_rows_scaled_first_bit_for_bit(monkeypatch, form):
    """``x_scale`` (a norm's weight over its unscaled rows, ``LayerLora.normed``): each form's
    terms equal, bit for bit, its terms over ``x_scale * x`` (``rms_norm``'s product), which
    the two launches' shrink forms as it reads x; and the reference's with ``x_scale``."""
    monkeypatch.setenv(dispatch.LORA_KERNEL_ENV, "triton")
    monkeypatch.setenv(dispatch.LORA_FORM_ENV, form)
    seed = int(np.random.default_rng().integers(2**31))
    case = dataclasses.replace(SPLIT_K_CASES[0], dtype="bfloat16")
    x, a, bs, slots = make_inputs(case, seed)
    scale = jax.random.normal(jax.random.key(seed), x.shape[1:], x.dtype) + 1
    got = dispatch.lora_deltas(x, a, bs, slots, x_scale=scale)
    first = dispatch.lora_deltas(scale * x, a, bs, slots)
    dense = reference.lora_deltas(x, a, bs, slots, x_scale=scale)
    for g, f, d in zip(got, first, dense, strict=True):
        assert g.dtype == x.dtype
        assert bool(jnp.array_equal(g, f)), f"{seed=}"
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(d, np.float32), atol=0.1)


def test_a_weight_of_another_dtype_is_applied_before_the_kernel(monkeypatch):
    """A norm's weight in float32 over bf16 rows makes a float32 product (as ``rms_norm``
    would): the kernel, which takes one dtype, gets no scale; the reference runs it."""
    monkeypatch.setenv(dispatch.LORA_KERNEL_ENV, "triton")
    case = dataclasses.replace(CPU_CASES[0], dtype="bfloat16")
    x, a, bs, slots = make_inputs(case, 3)
    scale = jnp.linspace(0.5, 1.5, x.shape[1], dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"x_scale float32\[64\] must be bfloat16\[64\]"):
        lt.lora_deltas(x, a, bs, slots, scale, interpret=True)
    got = dispatch.lora_deltas(x, a, bs, slots, x_scale=scale)
    want = reference.lora_deltas(x, a, bs, slots, x_scale=scale)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == jnp.float32 and bool(jnp.array_equal(g, w))


def test_the_model_reads_q_k_v_and_gate_up_as_the_norms_rows_and_weight(monkeypatch):
    """With ``LayerLora.normed`` set, the q/k/v and gate/up terms take the norm's unscaled
    rows and its weight (the kernel scales as it reads); o and down take their own inputs."""
    from jaxserve.models import lora as ops

    seen = []
    monkeypatch.setattr(
        ops.dispatch,
        "lora_deltas",
        lambda x, a, bs, slots, mask, x_scale: (
            seen.append((x, x_scale)) or tuple(jnp.zeros((x.shape[0], b.shape[2])) for b in bs)
        ),
    )
    m, h, r = 2, 32, 4
    dims = {"q": (h, 32), "k": (h, 16), "v": (h, 16), "o": (32, h)}
    dims |= {"gate": (h, 48), "up": (h, 48), "down": (48, h)}
    shapes = ops.LoraShapes(m, r, (dims,))
    layer = ops.zeros(shapes, jnp.float32).layers[0]
    inputs = ops.LoraInputs(ops.LoraWeights([layer]), jnp.array([1, 0, 2], jnp.int32))
    rows, weight, x = jnp.ones((3, h)), jnp.full((h,), 2.0), jnp.full((3, h), 2.0)
    lora = ops.with_normed(ops.LayerLora(layer, inputs.routing(x.dtype)), rows, weight)
    ops.qkv_deltas(x, lora, (2, 16), (1, 16))
    ops.gate_up_deltas(x, lora)
    ops.o_delta(x.reshape(3, 2, 16), lora)
    ops.down_delta(jnp.ones((3, 48)), lora)
    assert [(s[0] is rows, s[1] is weight) for s in seen] == [(True, True)] * 2 + [
        (False, False)
    ] * 2
    assert ops.with_normed(None, rows, weight) is None


@pytest.mark.filterwarnings(DEPRECATED)
def test_lowers_to_triton_for_an_h200(verify_triton_modules):
    """The Pallas -> Triton IR lowering of the shrink (split, masked) and the expands, the
    fused launch and the split-K launch (masked atomic adds)."""
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)
    x = jax.ShapeDtypeStruct((64, 4096), jnp.bfloat16)
    a = jax.ShapeDtypeStruct((8, 48, 4096), jnp.bfloat16)
    bs = tuple(jax.ShapeDtypeStruct((8, 16, o), jnp.bfloat16) for o in (4096, 1024, 1024))
    slots = jax.ShapeDtypeStruct((64,), jnp.int32)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(lt.lora_deltas).trace(x, a, bs, slots)
        text = lowered.lower(lowering_platforms=("cuda",)).as_text()
        one = jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16)  # decode, the fused form asked for
        asked = functools.partial(lt.lora_deltas, config=lt.LoraKernelConfig(fused=True))
        lowered = jax.jit(asked).trace(one, a, bs, jax.ShapeDtypeStruct((1,), jnp.int32))
        fused = lowered.lower(lowering_platforms=("cuda",)).as_text()
        scale = jax.ShapeDtypeStruct((4096,), jnp.bfloat16)  # a norm's weight, read in
        lowered = jax.jit(lt.lora_deltas).trace(x, a, bs, slots, scale)
        scaled = lowered.lower(lowering_platforms=("cuda",)).as_text()
        split = functools.partial(split_k.lora_deltas, config=lt.LoraKernelConfig())
        lowered = jax.jit(split).trace(one, a, bs, jax.ShapeDtypeStruct((1,), jnp.int32))
        one_split = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") >= 2
    assert scaled.count("__gpu$xla.gpu.triton") == text.count("__gpu$xla.gpu.triton")
    assert fused.count("__gpu$xla.gpu.triton") == 1 and "lora_fused" in fused
    assert one_split.count("__gpu$xla.gpu.triton") == 1 and "lora_split_k" in one_split


def _is_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


# Llama-3-8B's projections at rank 16 (bf16): qkv (joined A), o, gate/up (joined), down.
GPU_CASES = [
    Case(
        f"llama_{name}_t{t}_m{m}",
        _mixed(t, m, t + m),
        m,
        16,
        x,
        os_,
        "bfloat16",
        lt.LoraKernelConfig(),
    )  # fmt: skip
    for name, x, os_ in (
        ("qkv", 4096, (4096, 1024, 1024)),
        ("o", 4096, (4096,)),
        ("gate_up", 4096, (14336, 14336)),
        ("down", 14336, (4096,)),
    )
    for t, m in ((1, 1), (16, 8), (64, 8), (256, 64))
] + [
    Case(
        f"llama_{name}_t{t}_m{m}_fused",
        _mixed(t, m, t + m),
        m,
        16,
        x,
        os_,
        "bfloat16",
        lt.LoraKernelConfig(fused=True),
    )  # fmt: skip
    for name, x, os_ in (("qkv", 4096, (4096, 1024, 1024)), ("down", 14336, (4096,)))
    for t, m in ((1, 1), (16, 8))
]


@pytest.mark.gpu
@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("case", CPU_CASES + GPU_CASES, ids=lambda c: c.name)
def test_native_matches_reference(case: Case):
    _native_matches(case, lambda *args: lt.lora_deltas(*args, config=case.config))


@pytest.mark.gpu
@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.skipif(not _is_gpu(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize(
    "case",
    SPLIT_K_CASES + [c for c in GPU_CASES if not c.name.endswith("_fused")],
    ids=lambda c: c.name,
)
def test_split_k_native_matches_reference(case: Case):
    config = dataclasses.replace(case.config, fused=False)
    _native_matches(case, lambda *args: split_k.lora_deltas(*args, config=config))


def _native_matches(case: Case, deltas) -> None:
    seed = int(np.random.default_rng().integers(2**31))
    x, a, bs, slots = make_inputs(case, seed)
    got = deltas(x, a, bs, slots)
    # NOTE: in float64 on the host: on the GPU a float32 XLA matmul runs in TF32 by default,
    # about 1e-3 off, ten times this test's float32 tolerance.
    want = numpy_deltas(x, a, bs, slots)
    base = np.asarray(slots) == 0
    for g, w in zip(got, want, strict=True):
        scale = float(np.abs(w).max()) or 1.0
        np.testing.assert_allclose(
            np.asarray(g, np.float32) / scale, np.asarray(w) / scale,
            atol=tolerance(case.dtype), err_msg=f"{seed=}",
        )  # fmt: skip
        assert (np.asarray(g)[base] == 0).all()


def test_the_start_up_log_says_how_the_lora_product_runs(monkeypatch):
    from jaxserve.engine_config import EngineConfig
    from jaxserve.models.families.registry import load_model_config
    from jaxserve.runner.devices import startup_lines
    from tests.conftest import fixture_dir

    monkeypatch.delenv(dispatch.LORA_KERNEL_ENV, raising=False)
    config = load_model_config(fixture_dir("llama"))
    lines = startup_lines(config, EngineConfig(enable_lora=True), jnp.float32, 128)
    assert (
        "LoRA product: dense one-hot product over every slot (XLA: GEMMs) (the kernel is "
        "Pallas Triton; this is the cpu backend)" in lines
    )
    assert not any(
        "LoRA" in line for line in startup_lines(config, EngineConfig(), jnp.float32, 128)
    )


@pytest.mark.filterwarnings(DEPRECATED)
@pytest.mark.parametrize("splits", [None, 1, 2, 4], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("case", SPLIT_K_CASES, ids=lambda c: c.name)
def test_split_k_interpret_matches_reference(case: Case, splits: int | None):
    seed = int(np.random.default_rng().integers(2**31))  # fresh inputs every run
    x, a, bs, slots = make_inputs(case, seed)
    config = dataclasses.replace(case.config, fused=False, num_splits=splits)
    got = split_k.lora_deltas(x, a, bs, slots, config=config, interpret=True)
    want = numpy_deltas(x, a, bs, slots)
    base = np.asarray(slots) == 0
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == x.dtype
        np.testing.assert_allclose(
            np.asarray(g, np.float64), w, atol=tolerance(case.dtype), err_msg=f"{seed=}"
        )
        assert (np.asarray(g)[base] == 0).all()  # the base model's rows add nothing


def test_split_k_splits_x_until_the_grid_fills_the_sms():
    planned = lt.plan(1, 1, 14336, 132, lt.LoraKernelConfig())  # down at one token
    config = dataclasses.replace(planned, num_splits=None)  # (the shrink's, left out)
    # two row tiles may hold rows, 32 column tiles of 128: 32 splits of its 112 steps of 128
    assert split_k.num_splits(1, 1, 14336, 32, 132, config) == 32
    # gate/up's 224 column tiles fill the SMs with 4 splits
    assert split_k.num_splits(1, 1, 4096, 224, 132, config) == 4
    assert split_k.num_splits(1, 1, 64, 224, 132, config) == 1  # no more splits than steps
    forced = dataclasses.replace(config, num_splits=8)
    assert split_k.num_splits(1, 1, 4096, 224, 132, forced) == 8


def test_split_k_refuses_a_rank_it_cannot_tile():
    x, a, bs, slots = make_inputs(next(c for c in CPU_CASES if c.rank == 8), 0)
    with pytest.raises(ValueError, match="split-K: rank 8: it takes powers of two from 16"):
        split_k.lora_deltas(x, a, bs, slots, interpret=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("num_slots, rank", [(1, 16), (2, 4), (4, 8)])
def test_the_reduced_form_equals_the_gemms(dtype, num_slots, rank):
    """``reference.form_deltas``'s ``reduced`` form (float32 sums, the GPU's decode form)
    against its ``gemm`` form and numpy on fresh random inputs, the base model's tokens among the
    adapters', q/k/v's three outputs from one joined A: expands of at most
    ``SUMMED_MAX_TERMS`` slots x rank summed, more as GEMMs."""
    seed = int(np.random.default_rng().integers(2**31))  # fresh inputs every run
    case = Case("reduced", _mixed(13, num_slots, seed), num_slots, rank, 96, (40, 24, 24), dtype)
    x, a, bs, token_slots = make_inputs(case, seed)
    mask = reference.slot_mask(token_slots, num_slots, x.dtype)
    reduced = reference.form_deltas(x, a, bs, mask, "reduced")
    gemm = reference.form_deltas(x, a, bs, mask, "gemm")
    for got, want, exact in zip(reduced, gemm, numpy_deltas(x, a, bs, token_slots), strict=True):
        atol = tolerance(dtype) * np.abs(exact).max()
        np.testing.assert_allclose(np.asarray(got, np.float64), exact, atol=atol)
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=atol
        )


def test_the_dense_product_takes_the_reduced_form_for_decode_on_the_gpu(monkeypatch):
    """``JAXSERVE_LORA_DENSE``: auto is the reduced form on a GPU for steps of at most
    REDUCED_MAX_TOKENS tokens, the GEMMs above them and off the GPU; gemm and reduced force
    either; anything else names the variable."""
    assert reference.form(16) == "gemm"  # the CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert reference.form(1) == reference.form(reference.REDUCED_MAX_TOKENS) == "reduced"
    assert reference.form(reference.REDUCED_MAX_TOKENS + 1) == "gemm"
    monkeypatch.setenv(reference.FORM_ENV, "gemm")
    assert reference.form(16) == "gemm"
    monkeypatch.setenv(reference.FORM_ENV, "reduced")
    assert reference.form(4096) == "reduced"
    monkeypatch.setenv(reference.FORM_ENV, "sums")
    with pytest.raises(ValueError, match="JAXSERVE_LORA_DENSE='sums' must be one of auto"):
        reference.form(16)
