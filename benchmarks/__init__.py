"""The benchmark scripts: each measures one scenario of benchmarks/RESULTS.md on a device and
prints its table (``python -m benchmarks.NAME``; ``benchmarks/run_h200.sh`` runs them stage by
stage on the H200). What they share (the bandwidth floor, the timing loops, the decode step
through the runner) is ``benchmarks.common``; scripts that answered one question once live in
``benchmarks.probes``."""
