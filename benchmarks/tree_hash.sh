#!/usr/bin/env bash
# A hash of the package's and the benchmarks' files as they are on disk, to tell which tree a
# device run used when its .git is older than its files (run_h200.sh prints it).
cd "$(dirname "$0")/.." && find jaxserve pallas_kernels benchmarks -name '*.py' -o -name '*.sh' \
  | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-12
