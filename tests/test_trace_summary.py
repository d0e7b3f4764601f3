"""benchmarks/trace_summary.py on a synthetic device trace: kernels by name, and by program."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_trace(path: Path) -> Path:
    kernel = {"ph": "X", "pid": 1, "tid": 7}
    events = [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 7, "args": {"name": "Stream #14"}},
        {**kernel, "name": "fusion.1", "ts": 0, "dur": 10, "args": {"hlo_module": "jit_step"}},
        {**kernel, "name": "fusion.2", "ts": 10, "dur": 30, "args": {"hlo_module": "jit_step"}},
        {
            **kernel,
            "name": "gemm_fusion_dot.3",
            "ts": 50,
            "dur": 20,
            "args": {"hlo_module": "jit_drafting_chain"},
        },
    ]
    path.mkdir(parents=True)
    with gzip.open(path / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def summary(trace: Path, *flags: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.trace_summary", str(trace), *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_kernels_are_grouped_by_name_with_the_streams_busy_and_idle_time(tmp_path):
    out = summary(write_trace(tmp_path / "t"))
    assert "3 events, span 70 us/step, busy 60 us/step (86%), idle 10 us/step" in out
    assert "40.0 us/step      2.0 x     20.00 us avg  fusion" in out
    assert "jit_step" not in out


def test_by_module_splits_the_kernels_by_the_program_that_launched_them(tmp_path):
    out = summary(write_trace(tmp_path / "t"), "--by-module", "--steps", "2")
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    step = lines.index("jit_step: 20.0 us/step, 1.0 kernels/step")
    chain = lines.index("jit_drafting_chain: 10.0 us/step, 0.5 kernels/step")
    assert step < chain  # the larger program first
    assert lines[step + 1].endswith("fusion") and lines[chain + 1].endswith("gemm_fusion_dot")


def test_a_directory_of_several_traces_is_read_by_its_newest(tmp_path):
    """A profile directory a warm machine kept from an earlier run: the newest trace counts."""
    import os

    old = write_trace(tmp_path / "t" / "old")
    new = write_trace(tmp_path / "t" / "new")
    with gzip.open(new / "perfetto_trace.json.gz", "rt") as f:
        data = json.load(f)
    data["traceEvents"] = data["traceEvents"][:3]  # one kernel: 10 us
    with gzip.open(new / "perfetto_trace.json.gz", "wt") as f:
        json.dump(data, f)
    os.utime(old / "perfetto_trace.json.gz", (1, 1))
    assert "1 events, span 10 us/step" in summary(tmp_path / "t")
