"""One-question probes: scripts that answered one question once (does fusing the projections
pay at batch 1? where does a bucket's compile time go?), kept so the answer can be checked
again. Not part of a recurring scenario; the report that quotes each one names it."""
