"""Which of batch-invariant mode's scenarios give other bits on this GPU, under which XLA options.

The GPU test (``tests/test_batch_invariant.py``) asserts that none does; this probe says, per
set of the step's XLA compiler options, how many of the target's 48 logit rows differ from the
target alone in each scenario, and whether they are prompt rows (0-44) or decode rows (45-47):
with the options XLA's autotuner picks a GEMM by timing or by the shape's heuristic, on Triton
or on cuBLAS.

    python -m benchmarks.probes.batch_invariant_bits      # on the H200, about 2 minutes
    python -m benchmarks.probes.batch_invariant_bits 0 1  # the first two option sets only
"""

from __future__ import annotations

import json
import sys

from tests.test_batch_invariant import SCENARIOS, TARGET, differing_rows, target_logits

VARIANTS = {
    "autotuned (XLA's default)": {},
    "autotune level 0": {"xla_gpu_autotune_level": 0},
    "cuBLAS, autotune level 0": {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False},
    "cuBLAS, autotuned": {"xla_gpu_enable_triton_gemm": False},
}


def main() -> None:
    prompt = len(TARGET)
    picked = [int(i) for i in sys.argv[1:]] or range(len(VARIANTS))
    for name, options in [list(VARIANTS.items())[i] for i in picked]:
        alone = target_logits("bfloat16", True, [], None, on_gpu=True, compiler_options=options)
        for scenario, (others, chunk) in SCENARIOS.items():
            got = target_logits(
                "bfloat16", True, others, chunk, on_gpu=True, compiler_options=options
            )
            rows = differing_rows(alone, got)
            worst = float(abs(alone - got).max())
            print(
                json.dumps(
                    dict(
                        options=name,
                        scenario=scenario,
                        prompt_rows=sum(r < prompt for r in rows),
                        decode_rows=sum(r >= prompt for r in rows),
                        max_abs=worst,
                    )
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
