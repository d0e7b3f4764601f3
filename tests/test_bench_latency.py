"""``jaxserve bench latency`` on the tiny llama fixture: the table, the JSON and the flags."""

from __future__ import annotations

import json

import pytest

from jaxserve.cli import main
from tests.conftest import fixture_dir

OUTPUT_LEN = 4
SMALL = ["--model", str(fixture_dir("llama")), "--load-format", "auto", "--input-len", "8",
         "--output-len", str(OUTPUT_LEN), "--max-num-seqs", "2",
         "--max-num-batched-tokens", "16"]  # fmt: skip


def test_latency_sweep_prints_the_table_and_writes_every_number(tmp_path, capsys) -> None:
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", *SMALL, "--batch-sizes", "1,2", "--num-iters-warmup", "1",
            "--num-iters", "3", "--output-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Avg latency:" in printed and "99% percentile latency:" in printed
    assert "Offline latency: 8 in / 4 out, 3 iterations after 1 warm-up" in printed
    rows = [line.split() for line in printed.splitlines()[-2:]]
    assert [row[0] for row in rows] == ["1", "2"] and all(len(row) == 7 for row in rows)

    report = json.loads(out.read_text())
    assert report["batch_sizes"] == [1, 2] and report["output_len"] == OUTPUT_LEN
    for batch_size, r in zip([1, 2], report["results"], strict=True):
        assert r["batch_size"] == batch_size
        assert list(r["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
        assert len(r["latencies"]) == len(r["ttfts"]) == len(r["tpots"]) == 3
        for key in ("avg_latency", "avg_ttft", "avg_tpot", "output_tokens_per_s"):
            assert r[key] > 0, key
        assert all(v > 0 for v in [*r["latencies"], *r["ttfts"], *r["tpots"]])
        assert r["avg_ttft"] < r["avg_latency"]
        for latency, ttft, tpot in zip(r["latencies"], r["ttfts"], r["tpots"], strict=True):
            assert ttft + tpot * (OUTPUT_LEN - 1) == pytest.approx(latency)
        assert r["avg_ttft"] + r["avg_tpot"] * (OUTPUT_LEN - 1) == pytest.approx(r["avg_latency"])
        assert r["output_tokens_per_s"] == pytest.approx(batch_size * OUTPUT_LEN / r["avg_latency"])
        assert r["percentiles"]["10"] <= r["percentiles"]["50"] <= r["percentiles"]["99"]


def test_bench_help_lists_latency(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    assert "latency" in capsys.readouterr().out


def test_latency_help_shows_vllm_flags_and_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "latency", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--input-len", "--output-len", "--batch-size", "--batch-sizes",
                 "--num-iters-warmup", "--num-iters", "--output-json", "--max-model-len",
                 "--load-format"):  # fmt: skip
        assert flag in text
    assert "(default: 32)" in text and "(default: 128)" in text and "(default: 30)" in text


def test_a_bad_batch_size_list_names_the_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "latency", "--batch-sizes", "1,0"])
    assert "argument --batch-sizes: '1,0' is not a comma-separated list" in capsys.readouterr().err


def test_a_batch_larger_than_max_num_seqs_is_refused_before_loading(capsys) -> None:
    assert main(["bench", "latency", "--batch-sizes", "1,64", "--max-num-seqs", "8"]) == 2
    err = capsys.readouterr().err
    assert "batch size 64 exceeds --max-num-seqs 8" in err


def test_a_batch_longer_than_max_model_len_names_both_lengths(capsys) -> None:
    argv = ["bench", "latency", "--input-len", "1000", "--output-len", "256",
            "--max-model-len", "1K"]  # fmt: skip
    assert main(argv) == 2
    assert "--input-len 1000 + --output-len 256 = 1256 exceeds --max-model-len 1024" in (
        capsys.readouterr().err
    )
