"""The benchmark scripts run end to end in their tiny CPU modes (the GPU numbers come from
the same scripts on the H200)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

from tests.conftest import fixture_dir

ROOT = Path(__file__).parents[1]


def run_script(path: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [path, *args])
    runpy.run_path(str(ROOT / path), run_name="__main__")


def test_decode_roofline_smoke(tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "roofline.json"
    run_script("benchmarks/decode_roofline.py", ["--smoke", "--output-json", str(out)], monkeypatch)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 32), (4, 32)]
    assert all(r["device_ms"] > 0 and r["wall_ms"] > 0 for r in rows)
    assert "MBU" in capsys.readouterr().out


def test_throughput_script_is_the_cli(tmp_path, monkeypatch) -> None:
    out = tmp_path / "t.json"
    args = ["--model", str(fixture_dir("llama")), "--load-format", "auto", "--num-prompts", "2",
            "--input-len", "8", "--output-len", "3", "--max-num-seqs", "2",
            "--max-num-batched-tokens", "16", "--output-json", str(out)]  # fmt: skip
    with pytest.raises(SystemExit) as done:
        run_script("benchmarks/throughput.py", args, monkeypatch)
    assert done.value.code == 0
    assert json.loads(out.read_text())["output_tokens"] == 2 * 3


def test_structured_outputs_benchmark_smoke(tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "so.json"
    args = ["--smoke", "--output-json", str(out)]
    with pytest.raises(SystemExit) as done:
        run_script("benchmarks/structured_outputs.py", args, monkeypatch)
    assert done.value.code == 0
    result = json.loads(out.read_text())
    assert result["json_schema"]["output_tokens"] == result["unconstrained"]["output_tokens"]
    assert result["constrained_outputs_well_formed"] == result["batch_size"]
    assert result["schema_compile"]["compile_p99_ms"] > 0
    assert "json schema" in capsys.readouterr().out


def test_host_overhead_smoke(monkeypatch, capsys) -> None:
    run_script("benchmarks/host_overhead.py", ["--num-seqs", "16", "--steps", "5"], monkeypatch)
    assert "total" in capsys.readouterr().out


def test_throughput_smoke(tmp_path, monkeypatch) -> None:
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
            "--output-json",
            str(out),
        ],
    )
    assert main() == 0
    result = json.loads(out.read_text())
    assert result["output_tokens"] == 16 and result["output_tokens_per_s"] > 0


def test_compile_time_smoke(tmp_path, monkeypatch) -> None:
    out = tmp_path / "compile.json"
    run_script("benchmarks/compile_time.py", ["--smoke", "--output-json", str(out)], monkeypatch)
    result = json.loads(out.read_text())
    assert [r["bucket"] for r in result["rows"]] == [16, 32]
    assert all(r["compile_kernel_s"] > 0 and r["compile_reference_s"] > 0 for r in result["rows"])


def test_moe_benchmark_smoke(tmp_path, monkeypatch, capsys) -> None:
    """benchmarks/moe.py on the tiny Qwen3-MoE fixture: throughput, decode rows against the
    roofline, and one layer's experts alone."""
    out = tmp_path / "moe.json"
    with pytest.raises(SystemExit) as done:
        run_script("benchmarks/moe.py", ["--smoke", "--output-json", str(out)], monkeypatch)
    assert done.value.code == 0
    result = json.loads(out.read_text())
    assert result["throughput"]["output_tokens"] == 4 * 4
    assert [r["batch"] for r in result["decode"]] == [1, 4]
    assert result["decode"][0]["experts_touched"] == 2  # top_k at batch 1
    assert all(r["device_ms"] > 0 and r["floor_ms"] > 0 for r in result["decode"])
    assert [r["batch"] for r in result["experts"]] == [1, 4]
    assert result["experts"][0]["experts_touched"] <= 2
    assert "roofline" in capsys.readouterr().out
