"""Benchmark statistics on hand-computed synthetic timings, and the capacity note's reading."""

import math

import numpy as np
import pytest

from jaxserve.bench import report
from jaxserve.bench.stats import (
    Distribution,
    RequestOutput,
    compute_metrics,
    format_table,
    max_concurrency,
    meets_slos,
    parse_goodput,
    percentile,
)


def test_percentile_matches_hand_values_and_numpy_linear() -> None:
    values = [50.0, 10.0, 40.0, 20.0, 30.0]
    assert percentile(values, 50) == 30.0
    assert percentile(values, 95) == pytest.approx(48.0)  # rank 3.8: 40 + 0.8 * 10
    assert percentile(values, 99) == pytest.approx(49.6)
    assert percentile(values, 0) == 10.0 and percentile(values, 100) == 50.0
    assert percentile([7.0], 95) == 7.0
    rng = np.random.default_rng(0)
    for size in (2, 3, 10, 101):
        sample = rng.exponential(size=size).tolist()
        for q in (1, 25, 50, 90, 95, 99, 99.9):
            assert percentile(sample, q) == pytest.approx(np.percentile(sample, q), rel=1e-12)
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError, match="q=101"):
        percentile(values, 101)


def test_distribution_is_in_ms_and_zero_when_empty() -> None:
    d = Distribution.of_seconds([0.1, 0.3, 0.2])
    assert (d.count, d.mean, d.median) == (3, pytest.approx(200.0), pytest.approx(200.0))
    assert d.std == pytest.approx(np.std([100.0, 300.0, 200.0]))
    assert dict(d.percentiles) == {95: pytest.approx(290.0), 99: pytest.approx(298.0)}
    empty = Distribution.of_seconds([])
    assert empty.count == 0 and empty.mean == 0.0 and dict(empty.percentiles)[99] == 0.0


def _synthetic_outputs() -> list[RequestOutput]:
    return [
        RequestOutput(True, "", 10, 5, 0.1, [0.02, 0.03, 0.02, 0.03], 0.2, 0.0),
        RequestOutput(True, "", 20, 3, 0.3, [0.05, 0.25], 0.6, 0.5),
        RequestOutput(True, "", 5, 1, 0.2, [], 0.2, 1.5),
        RequestOutput(False, "HTTP 500: boom", 0, 0, 0.0, [], 0.01, 0.2),
    ]


def test_metrics_from_synthetic_timestamps() -> None:
    outputs = _synthetic_outputs()
    assert outputs[0].tpot == pytest.approx(0.025)  # (0.2 - 0.1) / (5 - 1)
    assert outputs[1].tpot == pytest.approx(0.15)
    assert outputs[2].tpot is None and outputs[3].tpot is None
    m = compute_metrics(outputs, duration=2.0, goodput_slos=None)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (35, 9)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(22.0)
    assert m.request_goodput is None
    # Chunks at 0.1, 0.12, 0.15, 0.17, 0.2 and 0.8, 0.85 fall in second 0; 1.1 and 1.7 in 1.
    assert m.max_output_tokens_per_s == pytest.approx(7.0)
    assert m.max_concurrent_requests == 1  # the failure starts exactly when the first ends

    ttft, tpot, itl, e2el = (m.latencies[k] for k in ("ttft", "tpot", "itl", "e2el"))
    assert (ttft.mean, ttft.median, ttft.count) == (pytest.approx(200.0), pytest.approx(200.0), 3)
    assert (tpot.mean, tpot.median, tpot.count) == (pytest.approx(87.5), pytest.approx(87.5), 2)
    assert dict(tpot.percentiles) == {95: pytest.approx(143.75), 99: pytest.approx(148.75)}
    assert itl.count == 6 and itl.mean == pytest.approx(400.0 / 6) and itl.median == 30.0
    assert dict(itl.percentiles) == {95: pytest.approx(200.0), 99: pytest.approx(240.0)}
    assert (e2el.mean, e2el.median) == (pytest.approx(1000.0 / 3), pytest.approx(200.0))
    assert dict(e2el.percentiles) == {95: pytest.approx(560.0), 99: pytest.approx(592.0)}

    saved = m.to_dict()
    assert saved["p95_itl_ms"] == pytest.approx(200.0)
    assert saved["median_ttft_ms"] == pytest.approx(200.0) and saved["completed"] == 3
    with pytest.raises(ValueError, match="duration=0"):
        compute_metrics(outputs, duration=0, goodput_slos=None)


def test_goodput_counts_successes_within_every_slo() -> None:
    outputs = _synthetic_outputs()
    # TTFT 100/300/200 ms; TPOT 25/150/- ms; mean ITL 25/150/- ms; E2EL 200/600/200 ms.
    assert compute_metrics(outputs, 2.0, {"ttft": 250.0}).request_goodput == pytest.approx(1.0)
    assert compute_metrics(outputs, 2.0, {"itl": 60.0}).request_goodput == pytest.approx(1.0)
    assert compute_metrics(outputs, 2.0, {"tpot": 200.0}).request_goodput == pytest.approx(1.5)
    both = {"ttft": 150.0, "e2el": 250.0}
    assert compute_metrics(outputs, 2.0, both).request_goodput == pytest.approx(0.5)
    assert not meets_slos(outputs[3], {"ttft": 1e9})  # a failure is never good
    assert parse_goodput("ttft:500, itl:50") == {"ttft": 500.0, "itl": 50.0}
    assert parse_goodput("") == {}
    for bad in ("ttft", "speed:3", "ttft:fast", "ttft:-1"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_max_concurrency_frees_a_slot_before_taking_one_at_the_same_time() -> None:
    intervals = [(0.0, 1.0), (0.5, 0.5), (0.9, 1.1), (1.0, 2.0)]  # (start, latency)
    outputs = [RequestOutput(start_time=s, latency=d) for s, d in intervals]
    assert max_concurrency(outputs) == 3  # at 0.9; at 1.0 two end before one starts
    assert max_concurrency([]) == 0


def test_table_has_the_vllm_layout() -> None:
    m = compute_metrics(_synthetic_outputs(), 2.0, {"ttft": 250.0})
    lines = format_table(m, 4.0, max_concurrency_limit=8).splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == "Successful requests:                     3         "
    assert lines[2] == "Failed requests:                         1         "
    assert lines[3] == "Maximum request concurrency:             8         "
    assert lines[4] == "Request rate configured (RPS):           4.00      "
    assert "Request goodput (req/s):                 1.00      " in lines
    assert "---------------Time to First Token----------------" in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "---------------Inter-token Latency----------------" in lines
    assert "----------------End-to-end Latency----------------" in lines
    assert "P95 ITL (ms):                            200.00    " in lines
    assert "Median TTFT (ms):                        200.00    " in lines
    assert lines[-1] == "=" * 50 and all(len(line) <= 51 for line in lines)
    burst = format_table(compute_metrics(_synthetic_outputs(), 2.0, None), math.inf, None)
    assert "Request rate configured" not in burst and "goodput" not in burst
    assert "Maximum request concurrency" not in burst


def _row(rate: str, p95_ttft: float, thr: float, *, itl=20.0, failed=0, waiting=None) -> dict:
    return {
        "request_rate": rate,
        "num_prompts": 100,
        "completed": 100 - failed,
        "failed": failed,
        "request_throughput": thr,
        "output_throughput": thr * 128,
        "median_ttft_ms": p95_ttft / 2,
        "p95_ttft_ms": p95_ttft,
        "p95_itl_ms": itl,
        "p95_e2el_ms": p95_ttft + 128 * itl,
        "max_concurrent_requests": int(thr * 3),
        "server_queue": None
        if waiting is None
        else {"metric_prefix": "jaxserve", "num_samples": 9, "waiting_max": waiting},
    }


def _sweep(rows: list[dict]) -> dict:
    config = {"target_ttft_p95_ms": 2000.0, "target_itl_p95_ms": 100.0}
    return {"date": "d", "model": "m", "config": config, "rates": rows}


def test_capacity_reads_the_target_break_and_the_knee() -> None:
    sweep = _sweep(
        [
            _row("inf", 9000.0, 6.0),
            _row("2", 300.0, 1.9, waiting=0.0),
            _row("8", 6000.0, 5.0, waiting=40.0),
            _row("4", 500.0, 3.8, waiting=2.5),
        ]
    )
    a = report.analyze(sweep)
    assert [p.rate for p in a.points] == [2.0, 4.0, 8.0, math.inf]
    assert a.highest_within.rate == 4.0 and a.first_breaking.rate == 8.0
    assert a.first_breaking.verdict == "TTFT 6,000 > 2,000 ms"
    before, at, why = a.knee
    assert (before.rate, at.rate) == (4.0, 8.0) and "500 to 6,000 ms" in why
    assert a.saturation.request_throughput == 6.0
    assert (a.trigger_rate, a.trigger_queue) == (4.0, 3)
    assert a.trigger_metric == "`jaxserve:num_requests_waiting`"
    text = report.summary(sweep)
    assert "Highest rate within target: 4 req/s" in text
    assert "The target breaks at 8 req/s" in text
    assert "exceeds **4 req/s**, or `jaxserve:num_requests_waiting` stays above **3**" in text
    loose = report.analyze(sweep, target_ttft_p95_ms=10_000.0)
    assert loose.highest_within.rate == 8.0 and loose.first_breaking is None
    assert loose.trigger_rate == 4.0  # the knee comes before the target breaks


def test_capacity_knee_from_flat_throughput_and_failures() -> None:
    flat = _sweep(
        [_row("1", 200.0, 1.0), _row("2", 250.0, 2.0), _row("4", 300.0, 3.9), _row("8", 350.0, 4.3)]
    )
    a = report.analyze(flat)
    assert a.highest_within.rate == 8.0
    assert (a.knee[0].rate, a.knee[1].rate) == (4.0, 8.0) and "throughput grows only" in a.knee[2]
    assert a.trigger_rate == 4.0 and a.trigger_queue == 11  # peak in flight at 4 req/s
    assert a.trigger_metric.startswith("`jaxserve:num_requests_running` +")

    burst = report.summary(_sweep([_row("2", 100.0, 2.0), _row("inf", 2500.0, 9.0)]))
    assert "Every finite rate tested is within target" in burst
    assert "the burst breaks the target (TTFT 2,500 > 2,000 ms)." in burst
    calm = report.summary(_sweep([_row("2", 100.0, 2.0), _row("inf", 900.0, 9.0)]))
    assert "p95 TTFT 900 ms.\n" in calm

    broken = report.analyze(_sweep([_row("2", 100.0, 2.0, failed=1), _row("4", 100.0, 4.0)]))
    assert broken.highest_within is None and broken.first_breaking.verdict == "1 failed"
    assert broken.trigger_rate is None and broken.knee is None
    slow_stream = report.analyze(_sweep([_row("2", 100.0, 2.0, itl=150.0)]))
    assert slow_stream.first_breaking.verdict == "ITL 150.0 > 100.0 ms"


def test_markdown_note_has_setup_table_and_findings(tmp_path) -> None:
    sweep = _sweep([_row("2", 300.0, 1.9, waiting=1.0), _row("4", 2500.0, 3.1)])
    sweep["config"].update(
        base_url="http://gpu:8000",
        endpoint="/v1/completions",
        dataset="random",
        random_input_len=256,
        random_output_len=128,
        random_range_ratio=0.0,
        ignore_eos=True,
        temperature=0.0,
        seed=0,
        num_prompts=100,
        burstiness=1.0,
        max_concurrency=None,
    )
    note = report.write_report(tmp_path, sweep)
    text = note.read_text()
    assert text.startswith("# Capacity note: m\n")
    assert "- Server: http://gpu:8000/v1/completions" in text
    assert "random prompts, input 256 tokens, output 128 tokens; EOS ignored" in text
    assert "p95 TTFT <= 2,000 ms and p95 ITL <= 100 ms" in text
    assert "| 2 | 100/100 | 1.90 | 243 | 150 | 300 | 20.0 | 2,860 | 1 | yes |" in text
    assert "| 4 | 100/100 | 3.10 | 397 | 1,250 | 2,500 | 20.0 | 5,060 | n/a | TTFT" in text
    assert "exceeds **2 req/s**" in text
    assert all((tmp_path / name).stat().st_size > 1000 for name in report.PLOT_NAMES)
