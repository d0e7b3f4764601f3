"""The benchmark scripts run end to end in their tiny CPU modes (the GPU numbers come from
the same scripts on the H200)."""

from __future__ import annotations

import json
import runpy
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from jaxserve.models.families.registry import load_model_config
from jaxserve.models.loading.checkpoint_loader import load_weights
from tests.conftest import fixture_dir


def run_script(module: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m module args`` in this process."""
    monkeypatch.setattr(sys, "argv", [module, *args])
    runpy.run_module(module, run_name="__main__")


def test_decode_roofline_smoke(tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "roofline.json"
    run_script("benchmarks.decode_roofline", ["--smoke", "--output-json", str(out)], monkeypatch)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 32), (4, 32)]
    assert all(r["device_ms"] > 0 and r["wall_ms"] > 0 for r in rows)
    assert "MBU" in capsys.readouterr().out


def test_batch_invariant_benchmark_smoke(tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "bi.json"
    run_script("benchmarks.batch_invariant", ["--smoke", "--out", str(out)], monkeypatch)
    result = json.loads(out.read_text())
    for mode in ("off", "on"):
        assert sorted(result[mode]["decode_ms"]) == ["1", "4"]
        assert result[mode]["offline_tokens_per_s"] > 0
        memory = result[mode]["step_memory"]
        assert memory["bucket"] == 64 and memory["argument_gib"] > 0 < memory["headroom_gib"]
    assert "on/off" in capsys.readouterr().out


def test_throughput_script_is_the_cli(tmp_path, monkeypatch) -> None:
    out = tmp_path / "t.json"
    args = ["--model", str(fixture_dir("llama")), "--load-format", "auto", "--num-prompts", "2",
            "--input-len", "8", "--output-len", "3", "--max-num-seqs", "2",
            "--max-num-batched-tokens", "16", "--output-json", str(out)]  # fmt: skip
    with pytest.raises(SystemExit) as done:
        run_script("benchmarks.throughput", args, monkeypatch)
    assert done.value.code == 0
    assert json.loads(out.read_text())["output_tokens"] == 2 * 3


def test_structured_outputs_benchmark_smoke(tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "so.json"
    args = ["--smoke", "--output-json", str(out)]
    with pytest.raises(SystemExit) as done:
        run_script("benchmarks.structured_outputs", args, monkeypatch)
    assert done.value.code == 0
    result = json.loads(out.read_text())
    assert result["json_schema"]["output_tokens"] == result["unconstrained"]["output_tokens"]
    assert result["constrained_outputs_well_formed"] == result["batch_size"]
    assert result["schema_compile"]["compile_p99_ms"] > 0
    assert "json schema" in capsys.readouterr().out


def test_host_overhead_smoke(monkeypatch, capsys) -> None:
    run_script("benchmarks.host_overhead", ["--num-seqs", "16", "--steps", "5"], monkeypatch)
    assert "total" in capsys.readouterr().out


def test_throughput_smoke(tmp_path, monkeypatch, capsys) -> None:
    from jaxserve.bench.throughput import main

    out = tmp_path / "t.json"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "throughput",
            "--model",
            str(fixture_dir("llama")),
            "--load-format",
            "auto",
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "32",
            "--block-size",
            "32",
            "--output-json",
            str(out),
        ],
    )
    assert main() == 0
    result = json.loads(out.read_text())
    assert result["output_tokens"] == 16 and result["output_tokens_per_s"] > 0
    assert result["block_size"] == 32  # serve's --block-size, as vLLM's bench takes it
    # A table for people (it printed the raw JSON); the JSON is in --output-json.
    printed = capsys.readouterr().out
    assert "out tok/s" in printed and "jaxserve" in printed and "{" not in printed


def test_throughput_hf_without_torch_is_one_line(monkeypatch, capsys) -> None:
    import importlib.util

    from jaxserve.bench import throughput

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torch" else real_find_spec(name, *a),
    )
    assert "needs PyTorch" in throughput.hf_unavailable()
    monkeypatch.setattr(sys, "argv", ["throughput", "--engine", "hf"])
    assert throughput.main() == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "jaxserve bench throughput: error: --engine hf needs PyTorch, which is not installed "
        "(pip install torch)"
    )


def test_compile_time_smoke(tmp_path, monkeypatch) -> None:
    out = tmp_path / "compile.json"
    run_script(
        "benchmarks.probes.compile_time", ["--smoke", "--output-json", str(out)], monkeypatch
    )
    result = json.loads(out.read_text())
    assert [r["bucket"] for r in result["rows"]] == [16, 32]
    assert all(r["compile_kernel_s"] > 0 and r["compile_reference_s"] > 0 for r in result["rows"])


def test_quantized_decode_roofline_counts_the_quantized_bytes(tmp_path, monkeypatch) -> None:
    out = tmp_path / "roofline.json"
    args = ["--smoke", "--quantization", "int8", "--batches", "1", "--output-json", str(out)]
    run_script("benchmarks.decode_roofline", args, monkeypatch)
    meta = json.loads(out.read_text())["meta"]
    assert meta["quantization"].startswith("Quantization: quantized on load (int8")
    # fixture llama: 2 layers of 53,248 Linear weights at 1 byte (+ f32 scales), the norms and
    # the lm_head in float32; the embedding is left out of the floor.
    linear = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 96 * 3)
    scales = 2 * 4 * (64 + 32 + 32 + 64 + 96 + 96 + 64)
    assert meta["weight_bytes"] == linear + scales + 4 * (2 * 2 * 64 + 64 + 64 * 320)


def test_quant_agreement_smoke(tmp_path, monkeypatch) -> None:
    out = tmp_path / "agreement.json"
    args = ["--model", str(fixture_dir("llama")), "--load-format", "auto", "--num-prompts", "1",
            "--prompt-len", "32", "--quantizations", "int8", "--output-json", str(out)]  # fmt: skip
    run_script("benchmarks.quant_agreement", args, monkeypatch)
    result = json.loads(out.read_text())
    assert result["meta"]["positions"] == 32
    assert 0 < result["int8"]["max_error_over_max_logit"] < 0.08
    assert result["int8"]["agreement_margin_above_0.5"] == 1.0


def test_decode_roofline_over_an_fp8_cache_and_the_comparison(tmp_path, monkeypatch, capsys):
    fp8 = tmp_path / "roofline_kv_fp8.json"
    args = ["--smoke", "--kv-cache-dtype", "fp8", "--output-json", str(fp8)]
    run_script("benchmarks.decode_roofline", args, monkeypatch)
    result = json.loads(fp8.read_text())
    assert result["meta"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert result["meta"]["kv_bytes_per_token"] == 2 * 2 * 2 * 16  # K, V x layers x heads x dim
    # A bf16 run twice as slow per cell: the table says 2.00x.
    slow = {"meta": {**result["meta"], "kv_cache_dtype": "bfloat16"}, "rows": []}
    slow["rows"] = [{**r, "device_ms": 2 * r["device_ms"]} for r in result["rows"]]
    (tmp_path / "roofline_kv_auto.json").write_text(json.dumps(slow))
    # bench throughput's JSON as it writes it now (one engine, flat), and its older form
    flat = {"engine": "jaxserve", "output_tokens_per_s": 150.0, "kv_cache_tokens": 2000}
    nested = {"jaxserve": {"output_tokens_per_s": 100.0, "kv_cache_tokens": 1000}}
    (tmp_path / "throughput_kv_auto.json").write_text(json.dumps(nested))
    (tmp_path / "throughput_kv_fp8.json").write_text(json.dumps(flat))
    greedy = {"positions": 100, "logprob_error_mean": 0.05, "logprob_error_max": 0.3,
              "steps_margin_0.1": 40, "agreement_margin_0.1": 0.975,
              "steps_margin_0.25": 0, "agreement_margin_0.25": None}  # fmt: skip
    (tmp_path / "greedy_kv_fp8.json").write_text(json.dumps(greedy))
    capsys.readouterr()
    run_script("benchmarks.kv_cache_dtype_compare", ["--dir", str(tmp_path)], monkeypatch)
    table = capsys.readouterr().out
    assert "| 1 | 32 |" in table and "| 2.00x |" in table
    assert "fp8 / bf16: 1.50x tokens/s, 2.00x KV tokens" in table
    assert "97.5% of the 40 with a margin >= 0.1, - of the 0 with a margin >= 0.25" in table


def test_greedy_agreement_smoke(tmp_path, monkeypatch, capsys) -> None:
    ref, out = tmp_path / "ref.npz", tmp_path / "fp8.json"
    runs = (
        ["--kv-cache-dtype", "auto", "--save", str(ref)],
        ["--kv-cache-dtype", "fp8", "--reference", str(ref), "--output-json", str(out)],
    )
    for args in runs:
        with pytest.raises(SystemExit) as done:
            run_script("benchmarks.greedy_agreement", ["--smoke", *args], monkeypatch)
        assert done.value.code == 0
    result = json.loads(out.read_text())
    assert result["positions"] == 2 * (20 + 8 - 1)
    assert 0.0 < result["logprob_error_mean"] < 0.2
    assert result["steps_margin_0.1"] > 0 and result["agreement_margin_0.1"] >= 0.8


def test_bench_attention_tiers_smoke(tmp_path, monkeypatch, capsys) -> None:
    """The tiers suite: the Triton kernel beside the reference, Mosaic GPU at head_dim 256."""
    out = tmp_path / "tiers.json"
    args = ["--smoke", "--suite", "tiers", "--out", str(out)]
    with pytest.raises(SystemExit) as done:
        run_script("benchmarks.bench_attention", args, monkeypatch)
    assert done.value.code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["kernel"]) for r in rows] == [
        ("4/2x64", "xla-reference"),
        ("4/2x64", "triton"),
        ("4/2x256 w32", "mosaic"),  # the label names a sliding window
    ]
    assert rows[1]["rel_err"] < 1e-2 and rows[1]["wall_s"] > 0


def test_bench_attention_sinks_smoke(tmp_path, monkeypatch, capsys) -> None:
    """The sinks suite: each GPU kernel without and with sinks, against the reference."""
    out = tmp_path / "sinks.json"
    args = ["--smoke", "--suite", "sinks", "--out", str(out)]
    with pytest.raises(SystemExit) as done:
        run_script("benchmarks.bench_attention", args, monkeypatch)
    assert done.value.code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["kernel"]) for r in rows] == [
        (shape, kernel)
        for shape in ("8/2x64 w16", "8/2x64 w16 sinks")
        for kernel in ("xla-reference", "mosaic", "triton")
    ]
    assert all(r["rel_err"] < 1e-2 for r in rows if r["kernel"] != "xla-reference")


def test_bench_attention_prompts_smoke(tmp_path, monkeypatch, capsys) -> None:
    """The prompts suite: whole prompts on the Mosaic kernel, its causal FLOPs counted."""
    out = tmp_path / "prompts.json"
    args = ["--smoke", "--suite", "prompts", "--out", str(out)]
    with pytest.raises(SystemExit) as done:
        run_script("benchmarks.bench_attention", args, monkeypatch)
    assert done.value.code == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["case"], r["kernel"]) for r in rows] == [
        ("prompts 2x24", "xla-reference"),
        ("prompts 2x24", "mosaic"),
    ]
    assert rows[1]["rel_err"] < 1e-2
    # 2 prompts x 300 causal pairs (24 * 25 / 2) x 4 heads x 64 dims x 4 FLOPs
    assert rows[1]["flops"] == 2 * 300 * 4 * 64 * 4
    assert "| prompts 2x24 | mosaic |" in result["prompts_table"]
    assert "partial" not in result  # written after each case, whole at the end


def test_bench_attention_issue_suite_times_each_order(tmp_path, monkeypatch, capsys) -> None:
    """The issue suite: the native fp8 kernel with each slot's next copies issued at each
    point of the step; all compute the same bits (the error is against the first).
    ``--head-dims`` keeps the cases of those head sizes only (the smoke case's is 64)."""
    rows_of = {}
    for head_dims in ("64", "256"):
        out = tmp_path / f"issue_{head_dims}.json"
        args = ["--smoke", "--suite", "issue", "--head-dims", head_dims, "--out", str(out)]
        with pytest.raises(SystemExit) as done:
            run_script("benchmarks.bench_attention", args, monkeypatch)
        assert done.value.code == 0
        rows_of[head_dims] = json.loads(out.read_text())["rows"]
    rows = rows_of["64"]
    labels = [f"fp8 native bk128 {when}" for when in ("end", "read", "p")]
    assert [r["kernel"] for r in rows] == labels
    assert rows[1]["rel_err"] == rows[2]["rel_err"] == 0.0
    assert rows_of["256"] == []


def test_bench_attention_page_size_applies_to_every_case(tmp_path, monkeypatch, capsys) -> None:
    """``--page-size`` (the served ``--block-size``) replaces each case's pages; the shape
    label names it, and the kernel still matches the reference over the larger pages."""
    out = tmp_path / "prompts.json"
    args = ["--smoke", "--suite", "prompts", "--page-size", "32", "--out", str(out)]
    with pytest.raises(SystemExit) as done:
        run_script("benchmarks.bench_attention", args, monkeypatch)
    assert done.value.code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["kernel"]) for r in rows] == [
        ("4/2x64 p32", "xla-reference"),
        ("4/2x64 p32", "mosaic"),
    ]
    assert rows[1]["rel_err"] < 1e-2


def test_bench_attention_served_steps_pad_as_the_runner_does(tmp_path, monkeypatch) -> None:
    """``--slots`` runs each case as a served step: its 48 tokens in the 64-token bucket, a
    page table of 8 rows (6 dead) of 128 positions; the kernel matches the reference on the
    live rows, and the counts stay the batch's."""
    out = tmp_path / "served.json"
    args = ["--smoke", "--suite", "prompts", "--slots", "8", "--max-model-len", "128"]
    with pytest.raises(SystemExit) as done:
        run_script("benchmarks.bench_attention", [*args, "--out", str(out)], monkeypatch)
    assert done.value.code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["kernel"] for r in rows] == ["xla-reference", "mosaic"]
    assert rows[1]["rel_err"] < 1e-2 and rows[1]["num_tokens"] == 2 * 24


def test_moe_benchmark_smoke(tmp_path, monkeypatch, capsys) -> None:
    """benchmarks/moe.py on the tiny Qwen3-MoE fixture: throughput, decode rows against the
    roofline, and one layer's experts alone."""
    out = tmp_path / "moe.json"
    with pytest.raises(SystemExit) as done:
        run_script("benchmarks.moe", ["--smoke", "--output-json", str(out)], monkeypatch)
    assert done.value.code == 0
    result = json.loads(out.read_text())
    assert result["throughput"]["output_tokens"] == 4 * 4
    assert [r["batch"] for r in result["decode"]] == [1, 4]
    assert result["decode"][0]["experts_touched"] == 2  # top_k at batch 1
    assert all(r["device_ms"] > 0 and r["floor_ms"] > 0 for r in result["decode"])
    assert [r["batch"] for r in result["experts"]] == [1, 4]
    assert result["experts"][0]["experts_touched"] <= 2
    assert "roofline" in capsys.readouterr().out


def test_moe_grouped_matmuls_smoke(tmp_path, monkeypatch, capsys) -> None:
    """benchmarks/moe.py --grouped-matmuls-only: decode batches and a prefill step, the
    Triton kernel (interpreted here) beside ragged_dot, and how each lowered."""
    out = tmp_path / "gmm.json"
    with pytest.raises(SystemExit) as done:
        run_script(
            "benchmarks.moe",
            ["--smoke", "--grouped-matmuls-only", "--output-json", str(out)],
            monkeypatch,
        )
    assert done.value.code == 0
    result = json.loads(out.read_text())
    rows = result["grouped_matmuls"]
    assert [(r["batch"], r["rows"]) for r in rows] == [(1, 32), (4, 32), (32, 64)]
    assert all(r["triton_us"] > 0 and r["xla_us"] > 0 and r["floor_us"] > 0 for r in rows)
    # The CPU expands ragged_dot into a dense dot (what the GPU did before the kernel).
    assert result["lowering"]["ragged_dot"] == "dense expansion over every expert"
    assert "ragged_dot us" in capsys.readouterr().out


def test_grouped_matmul_lowering_reads_instructions_not_metadata() -> None:
    """Every instruction of a lowered ragged_dot carries op_name=".../ragged_dot_general" in
    its metadata; only an instruction's opcode or custom-call target tells the lowering."""
    moe_bench = runpy.run_module("benchmarks.moe", run_name="moe_bench")
    lowering = moe_bench["grouped_matmul_lowering"]
    meta = 'metadata={op_name="jit(f)/ragged_dot_general" source_file="moe.py"}'
    dense = f"%dot.3 = bf16[64,8,768]{{2,1,0}} dot(%a, %b), lhs_contracting_dims={{1}}, {meta}"
    assert lowering(dense) == "dense expansion over every expert"
    native = f"%ragged-dot.1 = bf16[64,768]{{1,0}} ragged-dot(%a, %b, %g), {meta}"
    assert lowering(native) == "ragged-dot instruction (backend's own)"
    triton = (
        f"%custom-call.2 = bf16[64,768]{{1,0}} custom-call(%p, %a, %b), "
        f'custom_call_target="__gpu$xla.gpu.triton", {meta}'
    )
    assert lowering(triton) == "Pallas Triton grouped matmul"


def test_skinny_matmul_benchmark_smoke(tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "skinny.json"
    args = ["--smoke", "--batches", "3", "--formats", "fp8", "--iters", "1"]
    run_script("benchmarks.skinny_matmul", [*args, "--output-json", str(out)], monkeypatch)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["m"], r["format"]) for r in rows] == [
        ("qkv", 3, "fp8"),
        ("down", 3, "fp8"),
    ]
    assert all(r["best_us"] > 0 and r["xla_us"] > 0 for r in rows)
    assert "| 3 | fp8 |" in capsys.readouterr().out  # the model-step table


def test_load_speed_smoke(tmp_path, monkeypatch) -> None:
    out = tmp_path / "load.json"
    args = ["--smoke", "--dir", str(tmp_path / "ckpt"), "--output-json", str(out)]
    run_script("benchmarks.load_speed", args, monkeypatch)
    result = json.loads(out.read_text())
    names = [row["name"] for row in result["rows"]]
    assert names[0].endswith("threads (compiles)") and names[1].startswith("load_weights, ")
    assert "old loader" in names and not result["skipped"]
    old = next(row for row in result["rows"] if row["name"] == "old loader")
    assert old["read"] > 0 and old["device_put"] > 0 and result["bytes"] > 0


def test_load_speed_writes_a_checkpoint_that_loads_and_times_nothing(tmp_path, monkeypatch):
    """``--write-only``: the checkpoint ``run_h200.sh startup`` serves (read by the loader)."""
    out = tmp_path / "load.json"
    ckpt = tmp_path / "ckpt"
    args = ["--smoke", "--write-only", "--dir", str(ckpt), "--output-json", str(out)]
    run_script("benchmarks.load_speed", args, monkeypatch)
    assert not out.exists()
    config = load_model_config(ckpt)
    weights = load_weights(ckpt, config, jnp.bfloat16)
    assert weights.embed.shape == (config.vocab_size, config.hidden_size)


def test_startup_profile_smoke(monkeypatch, capsys) -> None:
    """The sampled start-up profile: each phase timed, and the functions that took the most of
    it, with the engine's warm-up among them."""
    args = [str(fixture_dir("llama")), "--max-model-len", "64", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "16", "--dtype", "float32", "--top", "40"]  # fmt: skip
    run_script("benchmarks.startup_profile", args, monkeypatch)
    out = capsys.readouterr().out
    for line in ("imports and arguments", "backend", "engine (tokenizer, weights, warm-up)"):
        assert line in out
    assert "inclusive (a function and everything it called)" in out
    assert "jaxserve/runner/warmup.py:warm_up" in out


def test_mla_benchmark_smoke(tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "mla.json"
    run_script("benchmarks.mla", ["--smoke", "--out", str(out)], monkeypatch)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["step"], r["batch"], r["context"]) for r in rows] == [
        ("decode", 3, 70),
        ("prefill", 1, 48),
    ]
    assert all(r["kernel_us"] > 0 and r["reference_us"] > 0 and r["floor_us"] > 0 for r in rows)
    assert "| decode | 3 | 70 | 1 |" in capsys.readouterr().out
    # The floors at DeepSeek-V3's shapes: 64 x 4,096 latents of 576 bf16 read at 4.3 TB/s; a
    # 2,048-token prompt's causal FLOPs at 989 TFLOP/s.
    from benchmarks.mla import V3, Cell, floor_us

    assert floor_us(Cell("decode", 64, 4096, 1), V3, 2) == pytest.approx(70.2, abs=0.1)
    flops = 2 * 128 * (2048 * 2049 // 2) * (512 + 64 + 512)
    assert floor_us(Cell("prefill", 1, 2048, 2048), V3, 2) == pytest.approx(flops / 989e6)


def test_spec_decode_benchmark_smoke(tmp_path, monkeypatch, capsys) -> None:
    """Verify steps of k = 0..3 drafted tokens at batch 1 and 4, the n-gram drafter's host
    time, and the batch-1 runs of each drafter against the same without speculation (same
    tokens)."""
    out = tmp_path / "spec.json"
    run_script("benchmarks.spec_decode", ["--smoke", "--output-json", str(out)], monkeypatch)
    report = json.loads(out.read_text())
    assert [(r["batch"], r["k"]) for r in report["verify"]] == [
        (b, k) for b in (1, 4) for k in range(4)
    ]
    assert all(r["device_ms"] > 0 for r in report["verify"])
    assert [r["batch"] for r in report["ngram_host"]] == [1, 8]
    e2e = report["end_to_end"]
    assert set(e2e) == {"off", "ngram", "draft_model", "eagle3"}
    assert all(r["same_tokens"] for name, r in e2e.items() if name != "off")
    assert "speed-up at batch 1" in capsys.readouterr().out


def test_weight_updates_benchmark_smoke(tmp_path, monkeypatch, capsys) -> None:
    """The updates, two level-1 sleeps and a level-2 one with their wakes in two parts, and the
    transfer floors, on the tiny fixture: the same tokens after each."""
    out = tmp_path / "wu.json"
    args = ["--model", str(fixture_dir("llama")), "--max-model-len", "256"]
    args += ["--gpu-memory-utilization", "0.9", "--out", str(out)]
    run_script("benchmarks.weight_updates", args, monkeypatch)
    result = json.loads(out.read_text())
    for level in ("level1", "level1_again", "level2"):
        row = result[level]
        assert row["wake_s"] == row["wake_weights_s"] + row["wake_kv_cache_s"] > 0
    assert all(result[k] for k in result if k.startswith("tokens_after"))
    assert "to_host_pinned_s" in result["transfers"]
    assert "level1_again: sleep" in capsys.readouterr().out


def test_embeddings_benchmark_smoke(tmp_path, monkeypatch) -> None:
    """The docstring's CPU command: both models' texts/s and roofline share, each model's step
    log written."""
    out, logs = tmp_path / "e.json", tmp_path / "logs"
    args = ["--num-texts", "64", "--text-len", "32", "--max-num-batched-tokens", "256"]
    fixtures = fixture_dir("llama").parent.parent  # tests/fixtures (fixture_dir: its models/)
    args += ["--max-model-len", "64", "--dtype", "float32", "--out", str(out)]
    args += ["--qwen3-model", str(fixtures / "embeddings/qwen3_last")]
    args += ["--bge-model", str(fixtures / "encoders/bert_embed"), "--step-log-dir", str(logs)]
    run_script("benchmarks.embeddings", args, monkeypatch)
    results = json.loads(out.read_text())["results"]
    assert [r["texts"] for r in results] == [64, 64]
    assert all(r["texts_per_s"] > 0 and r["roofline_share"] > 0 for r in results)
    assert sorted(p.name for p in logs.iterdir()) == ["bge_steps.jsonl", "qwen3_steps.jsonl"]


def test_lora_kernel_benchmark_smoke(tmp_path, monkeypatch) -> None:
    """Each group's kernel (two launches), dense product and floor; at one token the one
    launch too, over its steps along X; at 20 tokens the kernel alone."""
    out = tmp_path / "lk.json"
    run_script("benchmarks.lora_kernel", ["--smoke", "--output-json", str(out)], monkeypatch)
    rows = json.loads(out.read_text())["rows"]
    assert {(r["group"], r["slots"], r["tokens"]) for r in rows} == {
        (g, m, t) for g in ("qkv", "down") for m in (1, 3) for t in (1, 20)
    }
    assert all(r["kernel_us"] > 0 and r["dense_us"] > 0 and r["split_k_us"] > 0 for r in rows)
    assert all(r["one_launch_us"] > 0 for r in rows if r["tokens"] == 1)
    assert all(r["one_launch_us"] is None for r in rows if r["tokens"] == 20)
    assert all(sorted(r["fused_block_k_us"]) == ["16", "32"] for r in rows if r["tokens"] == 1)


def test_lora_benchmark_smoke(tmp_path, monkeypatch, capsys) -> None:
    """Offline throughput with 0, 1 and 2 adapters, each run after one request on each
    adapter (so the timed run loads none), and batch-1 TPOT of the base and one adapter, each
    also traced."""
    out = tmp_path / "lora.json"
    args = ["--model", str(fixture_dir("llama")), "--num-prompts", "8", "--input-len", "16"]
    args += ["--output-len", "8", "--adapters", "0,1,2", "--rank", "4", "--max-model-len", "64"]
    args += ["--work-dir", str(tmp_path / "work"), "--out", str(out)]
    args += ["--profile-dir", str(tmp_path / "profile")]
    run_script("benchmarks.lora", args, monkeypatch)
    result = json.loads(out.read_text())
    assert sorted(result["throughput"]) == ["0", "1", "2"]
    # the batch-1 runs traced, base and adapter (the trace summary reads them on the device)
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["adapter", "base"]
    assert all(v > 0 for v in result["throughput"].values())
    assert sorted(result["tpot_s"]) == ["0", "1"]
    printed = capsys.readouterr().out
    assert "2 adapters loaded and warm in" in printed and "batch-1 TPOT, one adapter" in printed


def test_lora_load_benchmark_smoke(tmp_path, monkeypatch, capsys) -> None:
    """A server with LoRA on: the neighbours' ITL quiet and while adapters load, each load
    timed, and the server stopped after."""
    out = tmp_path / "lora_load.json"
    work = tmp_path / "work"
    args = ["--smoke", "--out", str(out), "--work-dir", str(work)]
    run_script("benchmarks.lora_load", args, monkeypatch)
    result = json.loads(out.read_text())
    for name in ("quiet", "loading"):
        assert 0 < result[name]["itl_p50_ms"] <= result[name]["itl_p99_ms"]
        assert result[name]["num_itls"] > 4 * 10  # gaps between streamed chunks of text
    assert [row["model"] for row in result["loads"]] == ["load0", "load1"]
    assert result["p99_ratio"] > 0 and "p99 loading / quiet" in capsys.readouterr().out
    assert "Shut down cleanly" in (work / "server.log").read_text()


def llm_with_step_log(tmp_path, monkeypatch, **overrides):
    """The llama fixture's engine writing its step log (JAXSERVE_STEP_LOG) to a file: (llm,
    the file)."""
    import jaxserve

    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv("JAXSERVE_STEP_LOG", str(log))
    settings = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, warmup=False)
    llm = jaxserve.LLM(str(fixture_dir("llama")), dtype="float32", **settings, **overrides)
    return llm, log


def test_the_step_log_says_where_a_runs_time_went(tmp_path, monkeypatch, capsys) -> None:
    """JAXSERVE_STEP_LOG: one line per engine step (what it held, the host's spans), in the
    file by shutdown; the summary groups them by kind."""
    from jaxserve import SamplingParams

    llm, log = llm_with_step_log(tmp_path, monkeypatch)
    prompts = [{"prompt_token_ids": list(range(5, 5 + 20 + i))} for i in range(3)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    llm.shutdown()
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(steps) == llm.engine.num_steps
    first = steps[0]  # 16 tokens of the first prompt: a prompt chunk, no decode
    assert (first["seqs"], first["decode"], first["prompt_tokens"], first["tokens"]) == (
        1,
        0,
        16,
        16,
    )
    assert sum(s["decode"] for s in steps) == 3 * 6 - 3  # each prompt's last step samples one
    assert all(s["total_ms"] >= s["schedule"] + s["dispatch"] - 1e-3 for s in steps)
    run_script("benchmarks.step_log_summary", [str(log)], monkeypatch)
    printed = capsys.readouterr().out
    assert "| prompt only |" in printed and "| decode <= 8 |" in printed


def test_the_step_log_summary_counts_the_host_time_between_steps() -> None:
    """A step's period runs from its start to the next one's: what the host did after its
    spans ended (``between``) counts; a gap of an idle engine (two runs in one log) does not."""
    from benchmarks.step_log_summary import summarize, with_periods

    def step(t: float, total_ms: float) -> dict:
        spans = dict.fromkeys(("propose", "schedule", "dispatch", "process"), 0.0)
        return {"t": t, "total_ms": total_ms, "wait": 1.0, "seqs": 1, "decode": 1,
                "prompt_tokens": 0, "tokens": 1, **spans}  # fmt: skip

    steps = [step(0.0, 10.0), step(0.015, 8.0), step(5.0, 7.0)]
    periods = with_periods(steps)
    assert [round(s["period"], 6) for s in periods] == [15.0, 8.0, 7.0]
    assert [round(s["between"], 6) for s in periods] == [5.0, 0.0, 0.0]
    (row,) = summarize(steps)
    assert row["period_ms"] == pytest.approx(10.0) and row["between_ms"] == pytest.approx(5 / 3)
    assert with_periods([]) == [] and summarize([]) == []


def test_the_step_log_summary_of_a_run_that_took_no_step(tmp_path, monkeypatch, capsys) -> None:
    """A run that failed before its first step (an out-of-memory start) leaves an empty log:
    the summary says so instead of failing."""
    from benchmarks import step_log_summary

    log = tmp_path / "steps.jsonl"
    log.write_text("")
    monkeypatch.setattr(sys, "argv", ["step_log_summary", str(log)])
    step_log_summary.main()
    assert capsys.readouterr().out.strip() == f"{log}: no steps"


def test_the_step_log_times_the_drafter_and_a_read_back_step_apart(tmp_path, monkeypatch):
    """With speculation, a step that drafts logs its drafter's call as ``propose`` (not in
    ``schedule``) and, read back before the next, its device time as ``wait`` (not in
    ``dispatch``); a step without the drafter's call proposes nothing."""
    from jaxserve import SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "pause_when_unpaid": False}  # fmt: skip
    llm, log = llm_with_step_log(tmp_path, monkeypatch, speculative_config=spec)
    calls = []
    propose = llm.engine.proposer.propose

    def slow_propose(*args):  # a drafter's call that takes a measurable time
        time.sleep(0.02)
        calls.append(len(args[0]))
        return propose(*args)

    monkeypatch.setattr(llm.engine.proposer, "propose", slow_propose)
    prompt = [0, 5, 9, 11, 5, 9, 11, 5, 9, 11, 5, 9]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12))
    llm.shutdown()
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    proposing = [s for s in steps if s["propose"] >= 20]
    assert calls and len(proposing) == len(calls)  # every drafter call, in its own span
    assert all(s["schedule"] < 20 for s in proposing)
    assert all(s["propose"] < 1 for s in steps if s not in proposing)
    assert all(s["wait"] > 0 for s in proposing)  # read back before the next step


def test_hlo_kernels_lists_the_kernels_outside_fused_computations() -> None:
    from benchmarks import hlo_kernels

    def program(x, w):
        h = jax.nn.silu(x @ w) * 2.0
        return jax.lax.fori_loop(0, 3, lambda i, a: a * 2 + 1, h).sum(-1)

    x, w = jnp.ones((64, 32)), jnp.ones((32, 48))
    kernels = hlo_kernels.parse(jax.jit(program).lower(x, w).compile().as_text())
    assert any(k.target == "dot" and k.shape.startswith("f32[64,48]") for k in kernels)
    # the loop body's kernels count, the fused computations' instructions do not
    assert any(k.op_name.startswith("body/") for k in kernels)
    assert all(k.kind in ("kLoop", "kInput", "kOutput", "kCustom", "custom-call") for k in kernels)
    rows = hlo_kernels.grouped(kernels)
    assert sum(r["count"] for r in rows) == len(kernels)
    total = [r["output_bytes"] * r["count"] for r in rows]
    assert total == sorted(total, reverse=True)


def test_hlo_kernels_counts_each_element_type_s_bytes() -> None:
    from benchmarks import hlo_kernels

    def kernel(shape: str) -> hlo_kernels.Kernel:
        return hlo_kernels.Kernel("k", "kLoop", "convert", shape, "")

    assert kernel("f8e4m3fn[512,14336]{1,0}").output_bytes == 512 * 14336
    assert kernel("f8e5m2[4]{0}").output_bytes == 4
    assert kernel("(bf16[2,3]{1,0}, f32[2]{0})").output_bytes == 2 * 6 + 4 * 2
    assert kernel("pred[8]{0}").output_bytes == 8


def test_step_kernels_probe_smoke(tmp_path, monkeypatch, capsys) -> None:
    """The fixture's 16-token step compiled by the engine's programs, written and listed."""
    args = ["--smoke", "--out-dir", str(tmp_path)]
    run_script("benchmarks.probes.step_kernels", args, monkeypatch)
    listed = json.loads((tmp_path / "step_llama_generate_16.kernels.json").read_text())
    assert listed["kernels"] > 10 and listed["rows"]
    assert (tmp_path / "step_llama_generate_16.hlo.txt.gz").stat().st_size > 0
    assert "step_llama_generate_16:" in capsys.readouterr().out


def test_dispatch_block_probe_smoke(tmp_path, monkeypatch, capsys) -> None:
    """Each call of a step timed on the host with the device idle and busy, the table last."""
    out = tmp_path / "dispatch_block.json"
    args = ["--busy-ms", "2", "--size", "64", "--repeats", "1", "--out", str(out)]
    run_script("benchmarks.probes.dispatch_block", args, monkeypatch)
    rows = {row["case"]: row for row in json.loads(out.read_text())}
    assert {"put_small", "put_large", "call", "call_numpy", "donate", "donate_busy"} <= set(rows)
    assert all(row["busy_ms"] >= 0 and row["busy_program_ms"] > 0 for row in rows.values())
    assert "case           idle ms   busy ms" in capsys.readouterr().out


def test_launch_reuse_probe_smoke(tmp_path, monkeypatch, capsys) -> None:
    """The model step's host launch in the engine's loop, with a new input buffer, the same
    one, and the previous step held: each case a positive time, the row printed and written."""
    out = tmp_path / "launch_reuse.json"
    run_script("benchmarks.probes.launch_reuse", ["--smoke", "--out", str(out)], monkeypatch)
    row = json.loads(out.read_text())
    assert row["batch"] == 1 and row["device"]
    cases = ("pipelined_ms", "fresh_ms", "same_input_ms", "held_ms")
    assert all(row[case] > 0 for case in cases)
    assert "fresh_ms=" in capsys.readouterr().out


def test_swiglu_pass_probe_lists_each_forms_kernels_and_times_them(
    tmp_path, monkeypatch, capsys
) -> None:
    """64 rows on the CPU: every form compiled, its kernels listed and timed; the pass's cost
    (GEMM + SwiGLU against the GEMM alone) printed last."""
    out = tmp_path / "swiglu.json"
    run_script("benchmarks.probes.swiglu_pass", ["--tokens", "64", "--out", str(out)], monkeypatch)
    rows = json.loads(out.read_text())
    assert set(rows) == {"halves", "interleaved", "two_gemms", "gemm_alone", "mlp"}
    assert all(row["ms"] > 0 and row["kernels"] for row in rows.values())
    assert any("[64,3072]" in kernel for kernel in rows["halves"]["kernels"])
    assert "SwiGLU's pass after the gate/up GEMM:" in capsys.readouterr().out


def test_gelu_pass_probe_times_both_gelus_against_a_copy(tmp_path, monkeypatch, capsys) -> None:
    """A [256, 128] pass on the CPU: each GELU and the copy timed, the two GELUs within a bf16
    ulp of each other."""
    out = tmp_path / "gelu.json"
    args = ["--rows", "256", "--width", "128", "--out", str(out)]
    run_script("benchmarks.probes.gelu_pass", args, monkeypatch)
    result = json.loads(out.read_text())
    assert set(result["forms"]) == {"jax.nn.gelu", "gelu_erf", "copy"}
    assert all(row["us"] > 0 for row in result["forms"].values())
    assert result["max_difference"] <= 2**-6 * 12  # an ulp at the largest |x| (about 12)
    assert "of a copy's speed" in capsys.readouterr().out


def test_fp8_compile_probe_names_the_gemms_and_the_fp8_moves() -> None:
    """The compiled step's GEMM custom calls by target, and the instructions that transpose or
    copy an fp8 array (a weight moved to the layout cuBLASLt's fp8 GEMM wants)."""
    from benchmarks.probes.fp8_compile import gemm_kinds

    hlo = "\n".join(
        [
            "%t = f8e4m3fn[64,32]{0,1} transpose(f8e4m3fn[32,64]{1,0} %w), dimensions={1,0}",
            "%c = f8e4m3fn[16,16]{1,0} copy(f8e4m3fn[16,16]{0,1} %q)",
            '%g = (bf16[8,8]{1,0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8"',
            '%h = (bf16[8,8]{1,0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul"',
            '%m = f32[16]{0} custom-call(%a), custom_call_target="mosaic_gpu_v2"',
            "%y = bf16[16,16]{1,0} transpose(bf16[16,16]{0,1} %z), dimensions={1,0}",
        ]
    )
    kinds, moves = gemm_kinds(hlo)
    assert kinds == {"__cublas$lt$matmul$f8": 1, "__cublas$lt$matmul": 1}
    assert moves == 2


def test_lora_fold_probe_forms_agree(monkeypatch, capsys) -> None:
    """The probe's forms of a step's LoRA terms (dense, B joined block-diagonally, A folded into
    the base GEMM, both products as float32 sums over A stored K-minor) give the dense
    product's output, on one layer at the 8B shapes."""
    forms = "dense,joined,folded,reduced"
    args = ["--slots", "2", "--layers", "1", "--iters", "1", "--forms", forms]
    run_script("benchmarks.probes.lora_fold", args, monkeypatch)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    (row,) = rows
    assert row["joined_max_error"] == 0.0  # the zeros off the diagonal add nothing
    assert row["folded_max_error"] <= 0.125  # bf16: the base GEMM's wider output
    assert row["reduced_max_error"] <= 0.125  # float32 sums in another order, then bf16


def test_kernel_registers_reads_ptxas_report() -> None:
    """benchmarks/probes/kernel_registers.py: the last function's registers and spills from
    ptxas' verbose report (the probe itself needs the CUDA plugin: .venv-deviceless)."""
    from benchmarks.probes import kernel_registers

    report = (
        "ptxas info    : Compiling entry function 'ragged_paged_attention' for 'sm_90a'\n"
        "ptxas info    : Function properties for ragged_paged_attention\n"
        "    40 bytes stack frame, 36 bytes spill stores, 68 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 2 barriers, 1 bytes smem\n"
    )
    assert kernel_registers.parse_ptxas(report) == {
        "registers": 255,
        "spill_stores": 36,
        "spill_loads": 68,
    }
    assert kernel_registers.parse_ptxas("no ptxas here") is None
    row = {"kv": "fp8", "head_dim": 128, "block_kv": 128, "issue_next": "read", "lean": False}
    row["page_size"] = 16
    assert "| fp8 | 128 | 128 | read | no | 16 | 255 | 36 | 68 |" in kernel_registers.table(
        [{**row, **kernel_registers.parse_ptxas(report)}]  # type: ignore[dict-item]
    )


def test_native_cases_probe_names_each_case_and_its_phases(tmp_path, monkeypatch, capsys) -> None:
    """``benchmarks.probes.native_cases`` in interpret mode: a case per process, a JSON line
    per phase, and a case past its time limit reported with the phase it was in."""
    out = tmp_path / "cases.json"
    args = ["--kernel", "mosaic", "--interpret", "--cases", "decode_b3_page16"]
    args += ["--repeats", "2", "--out", str(out)]
    run_script("benchmarks.probes.native_cases", args, monkeypatch)
    (row,) = json.loads(out.read_text())
    assert row["ended"] == "exited" and row["repeats_done"] == 2 and row["errors"] == []
    phases = [p["phase"] for p in row["phases"]]
    assert phases[:6] == ["inputs", "reference", "compile", "run", "compare", "done"]
    assert "| decode_b3_page16 | exited |" in capsys.readouterr().out
    from benchmarks.probes import native_cases  # (after runpy ran it as __main__)

    cut = native_cases.run_case("mosaic", "decode_b3_page16", 1, 0.5, interpret=True)
    assert cut["ended"] == "killed after 0 s" and cut["repeats_done"] == 0


def test_qk_norm_rope_probe_times_xlas_passes_and_the_kernel(tmp_path, monkeypatch) -> None:
    """``--smoke``: 32 tokens, the kernel in interpret mode; both forms timed and equal."""
    out = tmp_path / "qk.json"
    run_script("benchmarks.probes.qk_norm_rope", ["--smoke", "--out", str(out)], monkeypatch)
    forms = json.loads(out.read_text())["forms"]
    assert set(forms) == {"xla", "kernel block_t=16"}
    assert all(row["us"] > 0 and row["max_difference"] == 0 for row in forms.values())
