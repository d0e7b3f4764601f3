"""The MLP's gate/up GEMM with SwiGLU in its epilogue, as a Pallas Mosaic GPU kernel (Hopper).

A prefill or embedding step multiplies every token row by the fused ``[K, 2N]`` gate/up weight,
then SwiGLU reads that ``[M, 2N]`` product back and writes ``[M, N]``. XLA fuses SwiGLU into no
GEMM (``benchmarks/probes/swiglu_pass.py``: in no weight layout, with its Triton GEMMs or
cuBLAS), so the pass costs its bytes: on an H100, 95 us of each layer of a 16,384-token
Qwen3-Embedding-0.6B step (2.76 ms of the step). Here each program owns a ``[block_m,
block_n]`` tile of the output and accumulates both of its products at once: per K step, TMA
brings the x tile and the matching gate and up tiles (columns ``j`` and ``N + j`` of the fused
weight, as the models hold it) into shared memory, ``num_stages`` steps in flight
(``plgpu.emit_pipeline``), and two wgmmas add into two float32 accumulators. The epilogue
applies ``silu(gate) * up`` in float32 and stores the tile in x's dtype: the ``[M, 2N]``
product is never written.

Two forms (``SwigluMatmulConfig.warp_specialized``):
- one warpgroup a program, a program a tile: the simple form;
- persistent and warp-specialized, as fast Hopper GEMMs are: one program an SM walks the tiles,
  a memory warpgroup keeps ``num_stages`` K steps of TMA copies in flight
  (``plgpu.emit_pipeline_warp_specialized``) while two compute warpgroups each multiply
  ``block_m`` rows of a ``[2 block_m, block_n]`` tile (the gate and up tiles shared), and a
  tile's epilogue and store overlap the next tile's copies.
  Its ping-pong schedule (``pingpong=True``) gives each compute warpgroup whole tiles of its
  own instead: the program walks pairs of column-adjacent tiles, one K loop over the pair's
  first member then its second, and warpgroup w multiplies member w's steps and lets the
  others pass; so one warpgroup's epilogue runs while the other's products do, as far as the
  ring's stages let the memory warpgroup run ahead (CUTLASS's "ping-pong" Hopper GEMMs).
On an H100 (2026-12-07, ``benchmarks/probes/swiglu_pass.py``) at the Qwen3-Embedding-0.6B
MLP's 16,384-token step the persistent form took 0.300 ms (687 TFLOP/s) against XLA's GEMM and
pass 0.372 ms, the simple form 0.42-0.64 ms: ``dispatch`` takes the persistent form where the
rows fill its tiles.

``gelu_matmul`` runs the persistent form with one weight tile a K step and the epilogue
``gelu(acc + b)`` (Phi through Abramowitz and Stegun's erfc: Mosaic GPU infers no layout for
``erf``), for an encoder's intermediate projection, where XLA writes the product and runs GELU
as a pass (110 us a layer of a 16,384-token BGE-large step on an H100): 0.278 ms against
XLA's GEMM and pass 0.297 there (H100, 2026-12-07, before the epilogue's instructions were cut
from 27 an element to 18). The epilogue does not overlap the tensor cores' work (the two
compute warpgroups share a tile), so its instructions are the kernel's cost over the GEMM.

M, N and K must be multiples of the tiles ``plan`` picks;
``unsupported_reason`` says why a call does not fit, and the caller keeps XLA's path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8_matmul.mosaic_gpu import num_sms

DTYPES = (jnp.bfloat16, jnp.float16)
SMEM_BYTES = 227 * 1024  # shared memory one block may use on H100 / H200
INTERPRET_PROGRAMS = 2  # the persistent form's programs in interpret mode (a CPU has no SMs)
LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class SwigluMatmulConfig:
    """Static tiles of one call. ``block_n``: the output's columns a program (each of its two
    float32 accumulators is ``[block_m, block_n]``: at 128 x 64 they take 128 registers a
    thread of the warpgroup). Warp-specialized, a program's tile has ``rows`` = 2 block_m."""

    block_m: int = 128  # 64 or 128 (wgmma's M is 64 a warpgroup instruction)
    block_n: int = 64  # 16 to 128, a multiple of 16
    block_k: int = 64  # 32, 64 or 128
    num_stages: int = 4
    warp_specialized: bool = False  # the persistent form: 2 compute warpgroups of block_m rows
    # The persistent form's schedule: the two compute warpgroups share each tile (False), or
    # take the tiles of a pair in turn, each a [block_m, block_n] tile of its own, so that one's
    # epilogue runs while the other's products do (True: "ping-pong").
    pingpong: bool = False

    def __post_init__(self):
        if self.block_m not in (64, 128):
            raise ValueError(f"{self.block_m=} must be 64 or 128")
        if self.block_n % 16 or not 16 <= self.block_n <= 128:
            raise ValueError(f"{self.block_n=} must be a multiple of 16 in [16, 128]")
        if self.block_k not in (32, 64, 128):
            raise ValueError(f"{self.block_k=} must be 32, 64 or 128")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"{self.num_stages=} must be in [1, 8]")
        if self.pingpong and not self.warp_specialized:
            raise ValueError("pingpong=True is a schedule of the persistent form only")

    @property
    def rows(self) -> int:
        """A tile's rows: block_m, or block_m for each of two compute warpgroups sharing it."""
        return self.block_m * (2 if self.warp_specialized and not self.pingpong else 1)


def plan(n: int, k: int, config: SwigluMatmulConfig) -> SwigluMatmulConfig:
    """``config`` with ``block_n`` and ``block_k`` halved until they divide N and K (down to 16
    and 32; ``unsupported_reason`` refuses what is left over)."""
    block_n, block_k = config.block_n, config.block_k
    while n % block_n and block_n > 16:
        block_n //= 2
    while k % block_k and block_k > 32:
        block_k //= 2
    return dataclasses.replace(config, block_n=block_n, block_k=block_k)


def smem_bytes(config: SwigluMatmulConfig, itemsize: int, views: int = 2) -> int:
    """Shared memory of one program: the pipeline's stages (an x tile and ``views`` weight
    tiles: gate and up, or one), then the output tile (a warpgroup's block_m rows each)."""
    stage = (config.rows + views * config.block_n) * config.block_k * itemsize
    out_rows = config.block_m * (2 if config.warp_specialized else 1)  # a buffer a warpgroup
    return config.num_stages * stage + out_rows * config.block_n * itemsize


def _check_smem(name: str, tiles: SwigluMatmulConfig, itemsize: int, views: int) -> None:
    smem = smem_bytes(tiles, itemsize, views)
    if smem > SMEM_BYTES:
        raise ValueError(
            f"{name}: {tiles} needs {smem:,} bytes of shared memory; the limit is "
            f"{SMEM_BYTES:,}: lower num_stages or block_k"
        )


def unsupported_reason(x: Any, w: Any, config: SwigluMatmulConfig, views: int = 2) -> str | None:
    """Why the kernel does not take ``x [M, K] @ w [K, views N]`` (shapes and dtypes only; the
    gate and up halves, or ``gelu_matmul``'s one weight), or None."""
    if x.ndim != 2 or w.ndim != 2:
        return f"x {x.shape} and w {w.shape} must be 2-D"
    (m, k), (k_w, width) = x.shape, w.shape
    if k_w != k or width % views:
        shape = "[K, 2N]" if views == 2 else "[K, N]"
        return f"x {x.shape} and w {w.shape} ({shape}) disagree on K or have an odd width"
    if x.dtype != w.dtype or x.dtype not in DTYPES:
        return f"x {x.dtype} and w {w.dtype}: the kernel takes bfloat16 or float16, both alike"
    n = width // views
    tiles = plan(n, k, config)
    if m % tiles.rows:
        return f"{m} rows: the kernel takes a multiple of {tiles.rows} (its tile's rows)"
    if n % tiles.block_n or k % tiles.block_k:
        return f"N={n}, K={k}: N must be a multiple of 16 and K of 32"
    if tiles.pingpong and (n // tiles.block_n) % 2:
        return f"N={n}: the ping-pong schedule takes an even number of {tiles.block_n}-column tiles"
    return None


def _kernel(x_ref, w_ref, o_ref, o_smem, *, tiles: SwigluMatmulConfig, n_blocks: int):
    """One ``[block_m, block_n]`` output tile: both products over K, then SwiGLU."""
    i, j = lax.axis_index("m"), lax.axis_index("n")
    block_m, block_n, block_k = tiles.block_m, tiles.block_n, tiles.block_k

    def scope(gate_acc, up_acc):
        def step(_, x_smem, gate_smem, up_smem):
            plgpu.wgmma(gate_acc, x_smem, gate_smem)
            plgpu.wgmma(up_acc, x_smem, up_smem)
            plgpu.wgmma_wait(0)  # the stage's buffers are free for the next TMA when it returns

        plgpu.emit_pipeline(
            step,
            grid=(x_ref.shape[1] // block_k,),
            in_specs=[
                plgpu.BlockSpec((block_m, block_k), lambda s: (i, s)),
                plgpu.BlockSpec((block_k, block_n), lambda s: (s, j)),  # gate: columns j
                plgpu.BlockSpec((block_k, block_n), lambda s: (s, n_blocks + j)),  # up: N + j
            ],
            max_concurrent_steps=tiles.num_stages,
        )(x_ref, w_ref, w_ref)
        return gate_acc[...], up_acc[...]

    acc = plgpu.ACC((block_m, block_n), jnp.float32)
    gate, up = pl.run_scoped(scope, acc, acc)
    o_smem[...] = _swiglu(None, gate, up).astype(o_smem.dtype)
    plgpu.commit_smem()
    rows, columns = pl.ds(i * block_m, block_m), pl.ds(j * block_n, block_n)
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[rows, columns])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _warp_specialized(
    tiles: SwigluMatmulConfig, k: int, views: int, body=None, context=None
) -> Any:
    """The K loop of one tile: the memory warpgroup's TMA copies of the x rows and of the
    tile's ``views`` weight tiles (gate and up; or the one), ``num_stages`` steps ahead of the
    two compute warpgroups' ``body``."""

    def ignore(*_, **__):  # (the allocations do not depend on the body or the context)
        return None

    k_steps = k // tiles.block_k
    if tiles.pingpong:  # the pair's first tile's K steps, then its second's
        grid: tuple[int, ...] = (2, k_steps)
        x_spec = plgpu.BlockSpec((tiles.rows, tiles.block_k), lambda _, s: (0, s))
        weight = plgpu.BlockSpec((tiles.block_k, tiles.block_n), lambda member, s: (s, member))
    else:
        grid = (k_steps,)
        x_spec = plgpu.BlockSpec((tiles.rows, tiles.block_k), lambda s: (0, s))
        weight = plgpu.BlockSpec((tiles.block_k, tiles.block_n), lambda s: (s, 0))
    return plgpu.emit_pipeline_warp_specialized(
        body or ignore,
        grid=grid,
        memory_registers=40,
        in_specs=[x_spec] + [weight] * views,
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=tiles.num_stages,
        compute_context=context or ignore,
    )


@dataclasses.dataclass(frozen=True)
class _Epilogue:
    """What a tile's compute warpgroup does around its products: ``start`` before the K loop
    (a bias tile's copy in flight), ``apply`` on the float32 products once they are done."""

    views: int  # the weight tiles a tile multiplies by: 2 (gate, up) or 1
    apply: Any  # (columns, *products) -> [block_m, block_n] float32
    start: Any = None  # (columns) -> None


def _tile_body(o_ref, o_smem, rows, columns, tiles: SwigluMatmulConfig, epilogue: _Epilogue):
    """(the pipeline's step, its compute context) for one compute warpgroup's ``rows`` of the
    tile: its products over K into float32 accumulators, then the epilogue's values stored
    through the warpgroup's output buffer once the last tile's store has read it."""
    wg = lax.axis_index("wg")

    def step(_, x_smem, *rest):
        *w_smems, accs = rest
        mine = x_smem.at[pl.ds(wg * tiles.block_m, tiles.block_m)]
        for acc, w_smem in zip(accs, w_smems, strict=True):
            plgpu.wgmma(acc, mine, w_smem)
        plgpu.wgmma_wait(0)  # the stage is released to the memory warpgroup on return
        return accs

    def context(run):
        def accumulate(*accs):
            if epilogue.start is not None:
                epilogue.start(columns)
            run(accs)
            _store(o_ref, o_smem, rows, columns, epilogue, accs)

        acc = plgpu.ACC((tiles.block_m, tiles.block_n), jnp.float32)
        pl.run_scoped(accumulate, *[acc] * epilogue.views)

    return step, context


def _store(o_ref, o_smem, rows, columns, epilogue: _Epilogue, accs) -> None:
    """A compute warpgroup's epilogue: its values from the float32 products, stored through its
    output buffer once the last tile's store has read it."""
    wg = lax.axis_index("wg")
    values = epilogue.apply(columns, *(acc[...] for acc in accs))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store
    o_smem[wg] = values.astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[rows, columns])


def _pair_body(
    o_ref, o_smem, rows, first, k_steps: int, tiles: SwigluMatmulConfig, epilogue: _Epilogue
):
    """(the pipeline's step, its compute context) for a tile pair: compute warpgroup w
    multiplies the K steps of member w (columns ``first + w block_n``) and lets the other's
    pass, so its epilogue (after its last K step) runs while the other warpgroup's products do,
    as far as the ring's stages let the memory warpgroup run ahead."""
    wg = lax.axis_index("wg")
    columns = pl.ds(first + wg * tiles.block_n, tiles.block_n)

    def step(indices, x_smem, *rest):
        *w_smems, accs = rest
        member, s = indices

        @pl.when(member == wg)
        def _():
            if epilogue.start is not None:
                pl.when(s == 0)(lambda: epilogue.start(columns))
            for acc, w_smem in zip(accs, w_smems, strict=True):
                plgpu.wgmma(acc, x_smem, w_smem)
            plgpu.wgmma_wait(0)  # the stage is released to the memory warpgroup on return
            pl.when(s == k_steps - 1)(lambda: _store(o_ref, o_smem, rows, columns, epilogue, accs))

        return accs

    def context(run):
        def accumulate(*accs):
            run(accs)

        acc = plgpu.ACC((tiles.block_m, tiles.block_n), jnp.float32)
        pl.run_scoped(accumulate, *[acc] * epilogue.views)

    return step, context


def _persistent_kernel(x_ref, w_ref, o_ref, *scratch, tiles: SwigluMatmulConfig, epilogue):
    """One program an SM: its share of the ``[rows, block_n]`` output tiles (cooperative), or of
    the pairs of column-adjacent ``[block_m, block_n]`` tiles of one row block (ping-pong), in
    row-block-major order (the programs in flight share a few row blocks of x and all of w, in
    L2). Weight view v of output tile j is the weight's columns ``v N + j block_n`` on (gate,
    then up)."""
    (m, k), n = x_ref.shape, o_ref.shape[1]
    block_n, n_blocks = tiles.block_n, n // tiles.block_n
    group = 2 if tiles.pingpong else 1  # column tiles a unit of work
    wg = lax.axis_index("wg")
    if scratch:  # the epilogue's own scratch (a bias tile's buffers), bound by the caller
        epilogue = epilogue(*scratch)

    def views(j):
        width = group * block_n
        return [w_ref.at[:, pl.ds(v * n + j * block_n, width)] for v in range(epilogue.views)]

    def scope(allocations, o_smem):
        @plgpu.nd_loop(((m // tiles.rows) * n_blocks // group,), collective_axes="sm")
        def _unit(loop: plgpu.NDLoopInfo):
            (index,) = loop.index
            i, j = (group * index) // n_blocks, (group * index) % n_blocks
            x_rows = pl.ds(i * tiles.rows, tiles.rows)
            if tiles.pingpong:
                k_steps = k // tiles.block_k
                body = _pair_body(o_ref, o_smem, x_rows, j * block_n, k_steps, tiles, epilogue)
            else:
                rows = pl.ds(i * tiles.rows + wg * tiles.block_m, tiles.block_m)
                columns = pl.ds(j * block_n, block_n)
                body = _tile_body(o_ref, o_smem, rows, columns, tiles, epilogue)
            _warp_specialized(tiles, k, epilogue.views, *body)(
                x_ref.at[x_rows], *views(j), allocations=allocations
            )

    pipeline = _warp_specialized(tiles, k, epilogue.views)
    pl.run_scoped(
        scope,
        pipeline.get_allocations(x_ref.at[pl.ds(0, tiles.rows)], *views(0)),
        plgpu.SMEM((2, tiles.block_m, block_n), o_ref.dtype),
        collective_axes="wg",
    )
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _num_programs(m: int, n: int, tiles: SwigluMatmulConfig, interpret: Any) -> int:
    """The persistent form's programs: one an SM (two in interpret mode), at most a tile (or a
    tile pair) each."""
    work = (m // tiles.rows) * (n // tiles.block_n) // (2 if tiles.pingpong else 1)
    return min(work, INTERPRET_PROGRAMS if interpret else num_sms())


def _swiglu(_, gate, up):
    """silu(gate) * up, float32: the sigmoid as 1 / (1 + 2^(-gate log2 e)), a reciprocal and a
    power of two, both approximate (``approx_math``): 8 instructions an element where
    ``jax.nn.sigmoid`` took 14 (2026-12-07 PTX of the Qwen3-0.6B tile)."""
    return gate * up / (1.0 + jnp.exp2(gate * -LOG2E))


SWIGLU = _Epilogue(views=2, apply=_swiglu)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def swiglu_matmul(
    x: jax.Array,  # [M, K]  bf16 | f16
    w: jax.Array,  # [K, 2N]  x's dtype: gate's N columns, then up's
    *,
    config: SwigluMatmulConfig = SwigluMatmulConfig(),
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> jax.Array:  # [M, N] x's dtype
    """``silu(x @ w[:, :N]) * (x @ w[:, N:])`` on the Mosaic GPU kernel; see the module
    docstring (``reference`` has the semantics)."""
    reason = unsupported_reason(x, w, config)
    if reason is not None:
        raise ValueError(f"swiglu_matmul: {reason}")
    (m, k), n = x.shape, w.shape[1] // 2
    tiles = plan(n, k, config)
    _check_smem("swiglu_matmul", tiles, x.dtype.itemsize, views=2)
    common: dict[str, Any] = dict(
        out_type=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=True
        ),
        kernel_name="swiglu_matmul",
        interpret=plgpu.InterpretGPUParams() if interpret is True else interpret,
    )
    if tiles.warp_specialized:
        return plgpu.kernel(
            functools.partial(_persistent_kernel, tiles=tiles, epilogue=SWIGLU),
            grid=(_num_programs(m, n, tiles, interpret),),
            grid_names=("sm",),
            num_threads=3,
            thread_name="wg",
            **common,
        )(x, w)
    return plgpu.kernel(
        functools.partial(_kernel, tiles=tiles, n_blocks=n // tiles.block_n),
        scratch_types=[plgpu.SMEM((tiles.block_m, tiles.block_n), x.dtype)],
        grid=(m // tiles.block_m, n // tiles.block_n),
        grid_names=("m", "n"),
        **common,
    )(x, w)


INV_SQRT2 = 0.7071067811865476
# Abramowitz and Stegun 7.1.26: erfc(z) = t (a1 + t (a2 + ... + t a5)) exp(-z^2), t = 1 / (1 + p z)
# for z >= 0, within 1.5e-7 of erf (Mosaic GPU infers no layout for erf itself, JAX 0.11.2)
_ERFC_P = 0.3275911
_ERFC_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def normal_tail(h: jax.Array) -> jax.Array:
    """Phi(-|h|) = erfc(|h| / sqrt 2) / 2, float32, in the fewest operations: the constants
    folded (1 / sqrt 2 into p, 1/2 into the coefficients, exp(-h^2 / 2) as a power of two)."""
    t = 1.0 / (1.0 + (_ERFC_P * INV_SQRT2) * jnp.abs(h))
    poly = 0.5 * _ERFC_A[-1]
    for a in reversed(_ERFC_A[:-1]):
        poly = 0.5 * a + t * poly
    return t * poly * jnp.exp2(h * (h * (-0.5 * LOG2E)))


def normal_cdf(h: jax.Array) -> jax.Array:
    """Phi(h) = 1 - Phi(-h) for h >= 0, Phi(-|h|) below, float32."""
    tail = normal_tail(h)
    return jnp.where(h >= 0, 1.0 - tail, tail)


def exact_gelu(h: jax.Array) -> jax.Array:
    """h Phi(h) (GELU through erf), float32: ``h - h tail`` or ``h tail`` by h's sign, so the
    epilogue spends about 18 instructions an element (27 as ``h * normal_cdf(h)`` through
    ``exp``, 2026-12-07 PTX of the BGE-large tile); its two transcendentals (the reciprocal
    and the power of two) are the approximate ones (``approx_math``)."""
    ht = h * normal_tail(h)
    return jnp.where(h >= 0, h - ht, ht)


def _bias_gelu_kernel(x_ref, w_ref, b_ref, o_ref, b_smem, barriers, *, tiles: SwigluMatmulConfig):
    """``_persistent_kernel`` with one weight view and the epilogue ``gelu(acc + b)``: each
    compute warpgroup copies its tile's bias columns into its buffer as the K loop starts and
    waits for them before the epilogue."""
    wg = lax.axis_index("wg")

    mine = b_smem.at[wg, pl.ds(0, tiles.block_n)]  # its buffer's row (padded: bias_row)

    def start(columns):
        plgpu.copy_gmem_to_smem(b_ref.at[columns], mine, barriers.at[wg])

    def apply(_, acc):
        plgpu.barrier_wait(barriers.at[wg])
        h = acc + mine[...].astype(jnp.float32)[None, :]
        return exact_gelu(h)

    epilogue = _Epilogue(views=1, apply=apply, start=start)
    _persistent_kernel(x_ref, w_ref, o_ref, tiles=tiles, epilogue=epilogue)


GELU_CONFIG = SwigluMatmulConfig(block_n=128, num_stages=3, warp_specialized=True)
# The ping-pong schedule's tiles: a warpgroup's own 128 x 128 tile (128 x 64 for SwiGLU's two
# products), the deepest ring that fits beside the two output buffers (224 KB of 227). No
# spills in a deviceless H200 compile (168 registers, 2026-12-07); not yet timed.
GELU_PINGPONG_CONFIG = SwigluMatmulConfig(128, 128, 64, 5, warp_specialized=True, pingpong=True)
SWIGLU_PINGPONG_CONFIG = SwigluMatmulConfig(128, 64, 64, 6, warp_specialized=True, pingpong=True)
TMA_SMEM_ALIGNMENT = 128  # bytes: where a tensor copy may land in shared memory


def bias_row(block_n: int, itemsize: int) -> int:
    """The elements of a warpgroup's row of the bias buffer: ``block_n`` rounded up to 128
    bytes, so the second warpgroup's copy lands aligned (at 64 bytes, a tile of 32 bf16 columns
    stopped the GPU with a misaligned address)."""
    per_line = TMA_SMEM_ALIGNMENT // itemsize
    return -(-block_n // per_line) * per_line


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def gelu_matmul(
    x: jax.Array,  # [M, K]  bf16 | f16
    w: jax.Array,  # [K, N]  x's dtype
    b: jax.Array,  # [N]  x's dtype
    *,
    config: SwigluMatmulConfig = GELU_CONFIG,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> jax.Array:  # [M, N] x's dtype
    """``gelu(x @ w + b)`` (exact GELU, through erf, in float32; one rounding) on the persistent
    kernel: an encoder's intermediate projection with its bias and activation in the epilogue,
    where XLA writes the product and runs GELU as a pass of its own (``reference``)."""
    reason = unsupported_reason(x, w, config, views=1)
    if reason is None and (b.shape != (w.shape[1],) or b.dtype != x.dtype):
        reason = f"b {b.shape} {b.dtype}: one {x.dtype} value a column of w {w.shape}"
    if reason is None and not config.warp_specialized:
        reason = "it runs on the persistent form only (warp_specialized=True)"
    if reason is not None:
        raise ValueError(f"gelu_matmul: {reason}")
    (m, k), n = x.shape, w.shape[1]
    tiles = plan(n, k, config)
    _check_smem("gelu_matmul", tiles, x.dtype.itemsize, views=1)
    return plgpu.kernel(
        functools.partial(_bias_gelu_kernel, tiles=tiles),
        out_type=jax.ShapeDtypeStruct((m, n), x.dtype),
        scratch_types=[
            plgpu.SMEM((2, bias_row(tiles.block_n, x.dtype.itemsize)), x.dtype),
            plgpu.Barrier(num_barriers=2),
        ],
        grid=(_num_programs(m, n, tiles, interpret),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        # approx_math: ex2.approx and rcp.approx for the epilogue's transcendentals (their
        # relative errors, about 2^-22, are far below the bf16 output's rounding).
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=True
        ),
        kernel_name="gelu_matmul",
        interpret=plgpu.InterpretGPUParams() if interpret is True else interpret,
    )(x, w, b)
