"""Offline throughput, jaxserve against Hugging Face transformers, in one script (scenario 3).

The same program as ``jaxserve bench throughput`` (jaxserve/bench/throughput.py), here next to
the other benchmark scripts:

    python -m benchmarks.throughput --engine both          # 256 prompts, 512 in / 256 out
    python -m benchmarks.throughput --num-prompts 1000 --input-len 1024 --output-len 128
"""

from __future__ import annotations

import sys

from jaxserve.bench.throughput import main

if __name__ == "__main__":
    sys.exit(main())
