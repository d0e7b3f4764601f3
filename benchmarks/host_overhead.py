"""Host overhead per engine step on the CPU: schedule + step-input building + output update.

No model runs: the sampled token is computed on the host, so what is timed is exactly the
Python work the engine does around each device step. Default: 256 running requests decoding
after a 512-token prompt, Llama-3-8B vocabulary and max_model_len 4096.

    python -m benchmarks.host_overhead [--num-seqs 256] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

from jaxserve.engine.kv_cache import KVCacheManager
from jaxserve.engine.request import Request, Sequence
from jaxserve.engine.scheduler import Scheduler
from jaxserve.runner.buckets import Buckets
from jaxserve.runner.input_builder import InputBuilder
from jaxserve.sampling_params import SamplingParams
from jaxserve.units import human_int


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--max-model-len", type=human_int, default=4096)
    args = parser.parse_args()

    block_size = 16
    num_blocks = args.num_seqs * (args.max_model_len // block_size)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    scheduler = Scheduler(kv, args.num_seqs, 8192, args.max_model_len)
    buckets = Buckets.of(
        max_num_batched_tokens=8192,
        max_num_seqs=args.num_seqs,
        max_model_len=args.max_model_len,
        block_size=block_size,
    )
    builder = InputBuilder(
        buckets,
        block_size=block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.num_seqs,
        num_slots=num_blocks * block_size,
        vocab_size=128256,
    )
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=10**6, ignore_eos=True)
    for i in range(args.num_seqs):
        prompt = [(i * 7919 + j) % 128000 for j in range(args.prompt_len)]
        request = Request(str(i), None, prompt, params, arrival_time=time.time())
        seq = Sequence(str(i), request, 0, seed=i)
        request.seqs.append(seq)
        scheduler.add(seq)
    # Prefill everything (untimed), then time decode steps.
    while any(s.num_computed_tokens < s.num_tokens for s in scheduler.waiting) or scheduler.waiting:
        out = scheduler.schedule()
        builder.update_states(out)
        scheduler.update_from_output(out)
        for item in out.scheduled:
            if item.completes_sequence:
                item.seq.output_token_ids.append(1)

    times = {"schedule": [], "build": [], "update": [], "total": []}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        builder.update_states(out)
        batch, rows = builder.build_batch(out)
        seqs = [item.seq for item in out.scheduled]
        flags = builder.sampler_flags(rows, batch.kv_lens)
        builder.sampling_inputs(seqs, rows, batch.kv_lens, flags)
        t2 = time.perf_counter()
        scheduler.update_from_output(out)
        for item in out.scheduled:
            item.seq.output_token_ids.append(2)
        t3 = time.perf_counter()
        assert len(out.scheduled) == args.num_seqs
        for key, value in zip(times, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
            value_ms = value * 1e3
            times[key].append(value_ms)
    print(f"{args.num_seqs} running sequences, {args.steps} decode steps (median ms per step)")
    for key, values in times.items():
        print(f"  {key:9s} {statistics.median(values):7.3f} ms")


if __name__ == "__main__":
    main()
