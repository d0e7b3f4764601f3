"""Speculative decoding: the cost of a verify step, the n-gram drafter's host time, and the
end-to-end batch-1 speed-up with n-gram drafting (docs/speculative_decoding.md).

1. Verify cost, through the runner (as benchmarks/decode_roofline.py): B sequences with
   ``context`` cached tokens each run a step of 1 + k tokens (their last token and k drafted
   ones, logits and sampling at all k + 1 positions), k = 0 (a plain decode step) .. 7.
   Reported: device ms (steps back to back), sync ms (``ModelRunner.execute``: inputs,
   dispatch, device, read back, as the engine runs a verify step), and each against k = 0.
   From these, the speed-up a mean acceptance length L would give: L * t(0) / t(k).
2. The n-gram drafter's host time per step at batch 1 .. 256 (2,048-token histories).
3. End to end at batch 1: the demo model (or --e2e-model) on a repetitive prompt, greedy, with
   and without each method: ``ngram``, ``draft_model`` with the fixture draft
   (``tests/fixtures/spec/draft``, or --draft-model; only for the demo model or a model of its
   tokenizer) and ``eagle3`` with the fixture head (``tests/fixtures/spec/eagle3``, or
   --eagle3-head; a head trained for the target): output tokens/s, the speed-up, the
   acceptance length, and that the tokens are the same.
4. EAGLE-3 drafting at the published Llama-3.1-8B head shape on the Llama-3-8B target: each
   propose call waited for (host work and the chain), its host part alone, and the step time
   as the engine runs it: the drafts left on the device for the verify step ("device"),
   drafted on the device behind each verify step before the host reads it back ("ahead",
   ``JAXSERVE_DRAFT_AHEAD``), with the next verify step also dispatched before the last is
   read back ("async", ``JAXSERVE_ASYNC_VERIFY``), and brought to the host first ("host").
5. Under load: offline throughput at batch 256 (Llama-3-8B shape, random prompts) with n-gram
   speculation on and off, each measured twice on its own engine (new prompts each run, the
   same in both arms): speculation must not make a full batch slower (above
   ``disable_by_batch_size`` a step drafts nothing).

    python -m benchmarks.spec_decode                  # Llama-3-8B shape, dummy bf16 weights
    python -m benchmarks.spec_decode --smoke          # tiny CPU run
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # before JAX starts

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.common import BANDWIDTH, ROOT
from jaxserve.config import builtin_config_dir
from jaxserve.engine.request import Request, Sequence
from jaxserve.engine.spec_decode import NgramProposer
from jaxserve.engine.step_log import StepLog
from jaxserve.engine_config import EngineConfig
from jaxserve.models.families.registry import load_model_config
from jaxserve.runner.runner import ModelRunner
from jaxserve.runner.step import DeviceDrafts, ScheduledSeq, SchedulerOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.units import cdiv


def verify_batch(runner: ModelRunner, batch: int, context: int, max_k: int, rng) -> list[Sequence]:
    """``batch`` sequences with ``context`` cached tokens (random pages), room for ``max_k``
    drafted tokens more; the runner's rows made for them."""
    bs = runner.block_size
    pages_per = cdiv(context + max_k + 1, bs)
    pages = rng.permutation(runner.num_blocks)[: batch * pages_per].reshape(batch, pages_per)
    params = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True)
    seqs, items = [], []
    for i in range(batch):
        prompt = rng.integers(100, 20000, size=context + 1).tolist()
        request = Request(str(i), None, prompt, params, arrival_time=0.0)
        seq = Sequence(str(i), request, 0, seed=i, block_ids=pages[i].tolist())
        seq.num_computed_tokens = context
        request.seqs.append(seq)
        seqs.append(seq)
        items.append(ScheduledSeq(seq, 1, context, is_new=True))
    runner.inputs.update_states(SchedulerOutput(items, batch))
    return seqs


def verify_step(seqs: list[Sequence], k: int, rng) -> SchedulerOutput:
    """Each sequence's last token and ``k`` drafted tokens (random ids)."""
    items = []
    for seq in seqs:
        draft = rng.integers(100, 20000, size=k).tolist()
        items.append(ScheduledSeq(seq, 1 + k, seq.num_computed_tokens, draft_token_ids=draft))
    return SchedulerOutput(items, len(seqs) * (1 + k))


def time_step(runner: ModelRunner, sched: SchedulerOutput, iters: int) -> tuple[float, float]:
    """(back-to-back seconds per step, synchronous seconds per step) of ``sched``."""
    runner.execute(sched)  # compiles
    start = time.perf_counter()
    for _ in range(iters):
        step = runner.dispatch(sched)
        runner.sample(step, None)
    jax.block_until_ready(step.sampled_ids)
    back_to_back = (time.perf_counter() - start) / iters
    sync = []
    for _ in range(iters):
        start = time.perf_counter()
        runner.execute(sched)
        sync.append(time.perf_counter() - start)
    return back_to_back, statistics.median(sync)


def verify_costs(args: argparse.Namespace) -> list[dict]:
    batches = [int(b) for b in args.batches.split(",")]
    max_k = args.max_k
    most = max(batches) * (max_k + 1)
    config = EngineConfig(
        model=args.model,
        load_format="dummy",
        dtype=args.dtype,
        max_model_len=args.context + max_k + 16,
        max_num_seqs=most,
        max_num_batched_tokens=max(16, most),
        warmup=False,
        num_gpu_blocks_override=max(batches) * cdiv(args.context + max_k + 1, 16) + 64,
        block_size=16,
    )
    runner = ModelRunner(load_model_config(args.model), config)
    rng = np.random.default_rng(0)
    rows = []
    for batch in batches:
        seqs = verify_batch(runner, batch, args.context, max_k, rng)
        base = None
        for k in range(max_k + 1):
            device, sync = time_step(runner, verify_step(seqs, k, rng), args.iters)
            base = base or (device, sync)
            row = {
                "batch": batch,
                "k": k,
                "device_ms": device * 1e3,
                "sync_ms": sync * 1e3,
                "device_x": device / base[0],
                "sync_x": sync / base[1],
            }
            rows.append(row)
            print(
                f"row batch={batch} k={k} device_ms={row['device_ms']:.3f} "
                f"sync_ms={row['sync_ms']:.3f} x{row['device_x']:.3f}",
                flush=True,
            )
        finished = [s.seq_id for s in seqs]
        runner.inputs.update_states(SchedulerOutput([], 0, finished_seq_ids=finished))
    return rows


def ngram_host_times(batches: list[int], length: int, k: int) -> list[dict]:
    """Milliseconds per step of ``NgramProposer.propose`` over ``batch`` sequences of
    ``length`` tokens (a vocabulary of 32k, a tenth of each history copied from earlier in it,
    so matches exist), one new token each per step, as a decode step adds."""
    rng = np.random.default_rng(0)
    rows = []
    for batch in batches:
        proposer = NgramProposer(2, 4)
        seqs = []
        params = SamplingParams(max_tokens=10**6)
        for i in range(batch):
            tokens = rng.integers(0, 32000, size=length)
            src = rng.integers(0, length - 64, size=length // 640)
            for s in src:  # repeated stretches
                dst = int(rng.integers(s + 32, length - 32))
                tokens[dst : dst + 32] = tokens[s : s + 32]
            request = Request(f"n{i}", None, tokens.tolist(), params, arrival_time=0.0)
            seqs.append(Sequence(f"n{i}", request, 0, seed=i))
        proposer.propose(seqs, k)  # the histories' first copy, once per sequence
        times, found = [], 0
        for _ in range(20):
            for seq in seqs:
                seq.append_token(int(rng.integers(0, 32000)))
            start = time.perf_counter()
            drafts = proposer.propose(seqs, k)
            times.append(time.perf_counter() - start)
            found += len(drafts)
        rows.append(
            {"batch": batch, "ms_per_step": statistics.median(times) * 1e3, "drafted": found / 20}
        )
        print(f"ngram batch={batch} host_ms={rows[-1]['ms_per_step']:.3f}", flush=True)
    return rows


def e2e_arms(args: argparse.Namespace) -> list[tuple[str, dict | None]]:
    """(name, speculative_config) of each end-to-end run: off, n-gram, and the draft model and
    the EAGLE-3 head when given (the fixtures belong to the demo model)."""
    k = args.e2e_k
    arms: list[tuple[str, dict | None]] = [
        ("off", None),
        ("ngram", {"method": "ngram", "num_speculative_tokens": k}),
    ]
    if args.draft_model:
        arms.append(
            (
                "draft_model",
                {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": k},
            )
        )
    if args.eagle3_head:
        arms.append(
            ("eagle3", {"method": "eagle3", "model": args.eagle3_head, "num_speculative_tokens": k})
        )
    return arms


def end_to_end(args: argparse.Namespace) -> dict:
    """Batch 1, greedy, a repetitive prompt: tokens/s with and without each drafter."""
    import jaxserve

    text = "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps. " * args.repeats
    results: dict = {}
    outputs = {}
    for name, spec in e2e_arms(args):
        llm = jaxserve.LLM(
            args.e2e_model,
            max_model_len=args.e2e_max_model_len,
            max_num_batched_tokens=args.e2e_max_model_len,  # fewer buckets to compile
            max_num_seqs=8,
            speculative_config=spec,
            **({"dtype": "float32", "warmup": False} if args.smoke else {}),
        )
        prompt = llm.get_tokenizer().encode(text)
        params = jaxserve.SamplingParams(temperature=0, max_tokens=args.e2e_tokens, ignore_eos=True)
        request = {"prompt_token_ids": prompt}
        llm.generate(request, params, use_tqdm=False)  # compiles what warm-up did not
        before = llm.engine.spec_stats.copy()
        start = time.perf_counter()
        out = llm.generate(request, params, use_tqdm=False)[0].outputs[0]
        seconds = time.perf_counter() - start
        stats = llm.engine.spec_stats
        drafts = stats.num_drafts - before.num_drafts
        accepted = stats.num_accepted_tokens - before.num_accepted_tokens
        results[name] = {
            "tokens_per_s": len(out.token_ids) / seconds,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        }
        outputs[name] = out.token_ids
        llm.shutdown()
        print(f"e2e {name}: {results[name]}", flush=True)
    for name in outputs:
        if name != "off":
            results[name]["speedup"] = (
                results[name]["tokens_per_s"] / results["off"]["tokens_per_s"]
            )
            results[name]["same_tokens"] = outputs["off"] == outputs[name]
    return results


def random_eagle3_head(config_dir: Path, out: Path) -> Path:
    """A head directory of ``config_dir``'s shapes (the shipped EAGLE-3 config of Llama-3.1-8B:
    one layer, a 32,000-token draft vocabulary) with random float16 weights: drafting time
    does not depend on the values."""
    from safetensors.numpy import save_file

    from jaxserve.models.loading.eagle3_checkpoint import expected_shapes, read_eagle3_config

    config = read_eagle3_config(config_dir)
    rng = np.random.default_rng(0)
    tensors = {
        name: (0.02 * rng.standard_normal(shape, np.float32)).astype(np.float16)
        for name, shape in expected_shapes(config).items()
    }
    tensors["d2t"] = np.zeros(config.draft_vocab_size, np.int64)  # draft id i -> target id i
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text((config_dir / "config.json").read_text())
    return out


def eagle3_chain_bytes(head, k: int) -> int:
    """Bytes a batch-1 chain of ``k`` draft steps reads at the least: ``fc`` once, the layer,
    its norms and the draft head's ``lm_head`` each step (the embedding: a row a step)."""
    per_step = sum(x.nbytes for x in jax.tree.leaves(head.layer)) + head.lm_head.nbytes
    per_step += head.hidden_norm.nbytes + head.final_norm.nbytes
    return head.fc.nbytes + k * per_step


PROFILE_TOKENS = 16  # batch-1 steps with drafting traced (--profile-dir), after the prompt's


class TimedProposer:
    """Wraps a drafter's ``propose``: each call's seconds, waited for (``block``: the chain's
    time on the device, not its launch) or as the engine runs it."""

    def __init__(self, proposer) -> None:
        self.propose, self.block, self.calls = proposer.propose, True, []
        proposer.propose = self

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.propose(*args, **kwargs)
        if self.block and isinstance(out, DeviceDrafts):
            out.ids.block_until_ready()
        self.calls.append(time.perf_counter() - start)
        return out

    def median_ms(self) -> float | None:
        """The median call of the last run (its prompt's own call left out), then forgets."""
        decode = sorted(self.calls)[: max(1, len(self.calls) - 1)]
        self.calls = []
        return 1e3 * statistics.median(decode) if decode else None


def eagle3_drafting(args: argparse.Namespace) -> list[dict]:
    """EAGLE-3 at the published Llama-3.1-8B head shape (random weights) on the Llama-3-8B
    target: each ``propose`` call's time (the head's chain of k steps over the target's kept
    states), and the step time, at each batch, with the drafts left on the device for the
    verify step (the engine's way) and brought to the host first (as before ``DeviceDrafts``)."""
    import tempfile

    import jaxserve

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        head = random_eagle3_head(builtin_config_dir("eagle3-llama-3.1-8b"), Path(tmp))
        llm = jaxserve.LLM(
            args.model,
            load_format="dummy",
            max_model_len=args.context + 256,
            max_num_seqs=max(int(b) for b in args.batches.split(",")),
            **({"max_num_batched_tokens": n} if (n := args.eagle3_batched_tokens) else {}),
            # (a random head's drafts never pay: drafting must not pause, every step is timed)
            speculative_config={
                "method": "eagle3", "model": str(head), "num_speculative_tokens": args.e2e_k,
                "pause_when_unpaid": False, "quantization": args.eagle3_quantization,
            },
        )  # fmt: skip
        timed = TimedProposer(llm.engine.proposer)
        floor_ms = 1e3 * eagle3_chain_bytes(llm.engine.proposer.draft_weights, args.e2e_k)
        floor_ms /= BANDWIDTH
        print(f"eagle3 byte floor of a propose call (k={args.e2e_k}): {floor_ms:.3f} ms")
        rng = np.random.default_rng(0)
        params = jaxserve.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        for batch in [int(b) for b in args.batches.split(",")]:
            prompts = [
                {"prompt_token_ids": rng.integers(1000, 100000, args.context // 2).tolist()}
                for _ in range(batch)
            ]
            llm.generate(prompts, params, use_tqdm=False)  # compiles what warm-up did not
            timed.calls.clear()
            for drafts in ("device", "ahead", "async", "host"):
                row = eagle3_batch(llm, timed, prompts, params, drafts, args)
                quantization = args.eagle3_quantization
                rows.append(
                    {"batch": batch, "k": args.e2e_k, "quantization": quantization,
                     "floor_ms": floor_ms, **row}
                )  # fmt: skip
                print(f"eagle3 {rows[-1]}", flush=True)
            # a traced run apart from the timed ones, verify steps dispatched ahead of the host
            llm.engine.device_drafts, llm.engine.proposer.drafts_ahead = True, True
            llm.engine.async_verify, llm.engine.proposer.ahead_always = True, False
            if args.profile_dir and batch == 1:
                with jax.profiler.trace(
                    str(Path(args.profile_dir) / "eagle3_b1"), create_perfetto_trace=True
                ):
                    traced = dataclasses.replace(params, max_tokens=PROFILE_TOKENS + 1)
                    llm.generate(prompts, traced, use_tqdm=False)
            llm.engine.proposer.drafts_ahead = llm.engine.async_verify = False
        llm.shutdown()
    return rows


def eagle3_batch(llm, timed: TimedProposer, prompts, params, drafts: str, args) -> dict:
    """One batch with the drafts left on the device, drafted ahead of the host behind each
    verify step (``JAXSERVE_DRAFT_AHEAD``: the engine calls ``propose`` only where a step
    cannot take them), or brought to the host first (``drafts``): a run whose calls are
    waited for (their time; in the "ahead" mode it also compiles the calls drafted ahead,
    which warm-up left out), then the timed run as the engine runs it (the step time; with
    ``--step-log-dir`` its step log ``eagle3_b{batch}_{drafts}_steps.jsonl``)."""
    llm.engine.device_drafts = drafts != "host"
    llm.engine.proposer.drafts_ahead = drafts in ("ahead", "async")
    llm.engine.proposer.ahead_always = drafts == "ahead"  # behind steps read back first too
    llm.engine.async_verify = drafts == "async"
    taken = llm.engine.proposer.ahead_taken
    timed.block = True
    llm.generate(prompts, params, use_tqdm=False)
    propose_ms = timed.median_ms()
    timed.block = False
    steps, verified_ahead = llm.engine.num_steps, llm.engine.num_verified_ahead
    log = None
    if args.step_log_dir:  # the timed run's host spans (propose, dispatch, wait, ...)
        name = f"eagle3_b{len(prompts)}_{drafts}_steps.jsonl"
        log = llm.engine.step_log = StepLog(Path(args.step_log_dir) / name)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    if log is not None:
        llm.engine.step_log = None
        log.flush()
    return {
        "drafts": drafts,
        # None: no call (above the batch where the engine drafts, it drafts nothing)
        "propose_ms": propose_ms,  # host work and the chain on the device
        "propose_host_ms": timed.median_ms(),  # as the engine ran it (device: the host's part)
        "ms_per_step": 1e3 * wall / max(1, llm.engine.num_steps - steps),
        "ahead_taken": llm.engine.proposer.ahead_taken - taken,  # steps that took them
        # steps dispatched before the last one was read back (the "async" mode)
        "verified_ahead": llm.engine.num_verified_ahead - verified_ahead,
    }


def under_load(args: argparse.Namespace) -> dict:
    """Output tokens/s of ``--load-batch`` requests at once, n-gram speculation off and on."""
    import jaxserve

    vocab = load_model_config(args.model).vocab_size

    def prompts(seed: int, count: int) -> list[dict]:
        """Random prompts, new ones each run: the same again would come from the prefix cache."""
        rng = np.random.default_rng(seed)
        return [
            {"prompt_token_ids": rng.integers(vocab // 100, vocab, args.load_input_len).tolist()}
            for _ in range(count)
        ]

    params = jaxserve.SamplingParams(
        temperature=0, max_tokens=args.load_output_len, ignore_eos=True
    )
    ngram = {"method": "ngram", "num_speculative_tokens": args.e2e_k, "prompt_lookup_max": 4}
    runs: dict[str, list[float]] = {"off": [], "ngram": []}
    for name, spec in (("off", None), ("ngram", ngram)):
        llm = jaxserve.LLM(
            args.model,
            load_format="dummy",
            max_model_len=args.load_input_len + args.load_output_len,
            max_num_seqs=args.load_batch,
            max_num_batched_tokens=2048,
            speculative_config=spec,
        )
        llm.generate(prompts(0, 8), params, use_tqdm=False)  # compiles what warm-up did not
        for run in (1, 2):
            batch = prompts(run, args.load_batch)  # the same in both arms
            start = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            runs[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
            print(f"load {name} batch={args.load_batch}: {runs[name][-1]:.0f} tok/s", flush=True)
        llm.shutdown()
    return {
        "batch": args.load_batch,
        "tokens_per_s": runs,
        "ratio_best": max(runs["ngram"]) / max(runs["off"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(builtin_config_dir("llama-3-8b")))
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--max-k", type=int, default=7)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--e2e-model", default="", help="end to end: the demo model by default")
    parser.add_argument("--e2e-tokens", type=int, default=256)
    parser.add_argument("--e2e-max-model-len", type=int, default=1024)  # the demo model's
    parser.add_argument("--e2e-k", type=int, default=4, help="num_speculative_tokens end to end")
    parser.add_argument(
        "--draft-model",
        default=str(ROOT / "tests/fixtures/spec/draft"),
        help="end to end: the draft_model arm's draft ('' leaves the arm out)",
    )
    parser.add_argument(
        "--eagle3-head",
        default=str(ROOT / "tests/fixtures/spec/eagle3"),
        help="end to end: the eagle3 arm's head ('' leaves the arm out)",
    )
    parser.add_argument(
        "--eagle3-quantization",
        default=None,
        choices=("fp8", "int8"),
        help="eagle3_8b: the head's speculative_config quantization (default: bf16)",
    )
    parser.add_argument(
        "--eagle3-batched-tokens",
        type=int,
        default=None,
        help="eagle3_8b: the engine's max_num_batched_tokens (fewer step buckets to compile)",
    )
    parser.add_argument("--repeats", type=int, default=12, help="of the prompt's sentence")
    parser.add_argument("--ngram-batches", default="1,8,64,256")
    parser.add_argument("--load-batch", type=int, default=256)
    parser.add_argument("--load-input-len", type=int, default=512)
    parser.add_argument("--load-output-len", type=int, default=128)
    parser.add_argument(
        "--parts",
        default="verify,ngram_host,end_to_end,eagle3_8b,under_load",
        help="which parts to run, comma-separated (the docstring's 1-5)",
    )
    parser.add_argument(
        "--profile-dir",
        default=None,
        help="trace EAGLE-3's batch-1 steps here (DIR/eagle3_b1): the verify step and the "
        "drafting's programs side by side",
    )
    parser.add_argument(
        "--step-log-dir",
        default=None,
        help="EAGLE-3's timed runs' step logs here (eagle3_bN_steps.jsonl: the engine's host "
        "spans per step, benchmarks/step_log_summary.py)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model and grid, on the CPU")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.model = str(ROOT / "tests/fixtures/models/llama")
        args.batches, args.context, args.max_k, args.iters = "1,4", 32, 3, 3
        args.e2e_tokens, args.ngram_batches = 32, "1,8"  # the demo model end to end
        args.e2e_max_model_len, args.repeats = 256, 3
        args.parts = ",".join(
            p for p in args.parts.split(",") if p not in ("eagle3_8b", "under_load")
        )
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    parts = {
        "verify": lambda: verify_costs(args),
        "ngram_host": lambda: ngram_host_times(
            [int(b) for b in args.ngram_batches.split(",")], 2048, 4
        ),
        "end_to_end": lambda: end_to_end(args),
        "eagle3_8b": lambda: eagle3_drafting(args),
        "under_load": lambda: under_load(args),
    }
    chosen = args.parts.split(",")
    unknown = set(chosen) - set(parts)
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from {sorted(parts)}")
    report: dict = {"verify": [], "ngram_host": [], "end_to_end": {}, "eagle3_8b": []}
    for name in chosen:
        report[name] = parts[name]()
        if args.output_json:  # what ran so far, should a later part be cut off
            Path(args.output_json).write_text(json.dumps(report, indent=2))
    print(f"\n{'batch':>5} {'k':>2} {'device ms':>9} {'x k=0':>6} {'sync ms':>8} {'x k=0':>6}")
    for r in report["verify"]:
        print(
            f"{r['batch']:5d} {r['k']:2d} {r['device_ms']:9.3f} {r['device_x']:6.3f} "
            f"{r['sync_ms']:8.3f} {r['sync_x']:6.3f}"
        )
    print("\nspeed-up at batch 1 for a mean acceptance length L (L * t(0) / t(k), device):")
    for r in report["verify"]:
        if r["batch"] == min(int(b) for b in args.batches.split(",")) and r["k"]:
            gains = "  ".join(
                f"L={n}: {n / r['device_x']:.2f}x" for n in (2, 3, 4) if n <= r["k"] + 1
            )
            print(f"   k={r['k']}: {gains}")
    e2e = report["end_to_end"]
    if e2e:
        print(f"\nend to end, batch 1: off {e2e['off']['tokens_per_s']:.1f} tok/s")
    for name, r in e2e.items():
        if name != "off":
            print(
                f"   {name}: {r['tokens_per_s']:.1f} tok/s ({r['speedup']:.2f}x, acceptance "
                f"length {r['mean_acceptance_length']:.2f}, same tokens: {r['same_tokens']})"
            )
    print("\nEAGLE-3 drafting (Llama-3.1-8B head shape, random weights) on the Llama-3-8B target:")
    for r in report["eagle3_8b"]:
        host = r["propose_host_ms"]  # None: every timed step took a call drafted ahead
        propose = (
            "no drafting (above the engine's drafting batch)"
            if r["propose_ms"] is None
            else f"propose {r['propose_ms']:.3f} ms (k={r['k']}; byte floor {r['floor_ms']:.3f} "
            f"ms{'' if host is None else f'; the host part {host:.3f} ms'})"
        )
        ahead = f", {r['ahead_taken']} steps took drafts made ahead" if r["ahead_taken"] else ""
        if r.get("verified_ahead"):
            ahead += f", {r['verified_ahead']} dispatched before the last was read back"
        print(f"   batch {r['batch']}, drafts {r['drafts']}: {propose}, "
              f"{r['ms_per_step']:.2f} ms a step{ahead}")  # fmt: skip
    if "under_load" in report:
        load = report["under_load"]
        runs = load["tokens_per_s"]
        print(
            f"\nbatch {load['batch']}: off {' / '.join(f'{t:.0f}' for t in runs['off'])} tok/s, "
            f"ngram {' / '.join(f'{t:.0f}' for t in runs['ngram'])} tok/s "
            f"(best on / best off {load['ratio_best']:.3f})"
        )


if __name__ == "__main__":
    main()
