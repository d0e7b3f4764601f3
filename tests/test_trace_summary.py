"""benchmarks/trace_summary.py on a synthetic trace: kernels by name and by program, and the
host's threads by event."""

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
        # the host: the launch of the step, and a wait inside it
        {"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "/host:CPU"}},
        {"name": "thread_name", "ph": "M", "pid": 2, "tid": 1, "args": {"name": "python"}},
        {"name": "PjitFunction(step)", "ph": "X", "pid": 2, "tid": 1, "ts": 0, "dur": 100},
        {"name": "Wait for usage holds", "ph": "X", "pid": 2, "tid": 1, "ts": 5, "dur": 40},
        {"name": "PjitFunction(step)", "ph": "X", "pid": 2, "tid": 1, "ts": 200, "dur": 60},
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


def test_host_threads_are_summarised_by_event_apart_from_the_device(tmp_path):
    """``--host``: the host's events by name (inclusive time per step), not the kernels; and
    the device's summary counts no host event."""
    trace = write_trace(tmp_path / "t")
    out = summary(trace, "--host", "--steps", "2")
    assert "/host:CPU / python: 3 events" in out
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    launch = lines.index("80.0 us/step      1.0 x     80.00 us avg  PjitFunction(step)")
    wait = lines.index("20.0 us/step      0.5 x     40.00 us avg  Wait for usage holds")
    assert launch < wait  # the larger total first
    assert "fusion" not in out and "Stream" not in out
    assert "PjitFunction" not in summary(trace)
