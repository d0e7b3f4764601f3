"""Where a run's time goes, step by step: an opt-in log of each engine step (``JAXSERVE_STEP_LOG``).

With ``JAXSERVE_STEP_LOG=FILE`` set, the engine appends one JSON line per step to FILE (written
in batches, at shutdown and when the process exits): what the step held (sequences, decode
sequences, prompt tokens, tokens in all) and five host-side spans in milliseconds, measured on
the engine's thread:

- ``propose``: the drafter's call when speculation runs (its host work; with drafts brought to
  the host, also its device work and their read-back, which otherwise fall in the verify
  step's ``wait``: ``DeviceDrafts``; zero without speculation);
- ``schedule``: choosing the step (the scheduler);
- ``dispatch``: building its inputs and handing them to the device (``runner.dispatch``);
- ``wait``: blocked on the device for a step's results (``runner.collect``: the previous step's
  under asynchronous scheduling, else this one's), the part of a step's device time the host's
  own work did not cover: near zero means the device waited for the host, not the other way
  round;
- ``process``: turning results into tokens, outputs and finished requests.

``benchmarks/step_log_summary.py`` groups the lines by kind (decode-only steps by batch size,
steps with prompt tokens) into the table of a run's time. Off, the engine pays one ``None``
check per span.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path
from typing import Any

STEP_LOG_ENV = "JAXSERVE_STEP_LOG"
FLUSH_EVERY = 1000  # lines kept in memory between writes
SPANS = ("propose", "schedule", "dispatch", "wait", "process")


class StepLog:
    """One step's spans as it runs (``start``, ``span``), one JSON line per step (``end``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self._lines: list[str] = []
        self._spans: dict[str, float] = {}
        self._mark = 0.0
        self._start = 0.0
        # A script that never shuts its engine down (``jaxserve bench throughput``) still gets
        # its last lines: written when the interpreter exits.
        atexit.register(self.flush)

    @classmethod
    def from_env(cls) -> StepLog | None:
        path = os.environ.get(STEP_LOG_ENV, "").strip()
        return cls(path) if path else None

    def start(self) -> None:
        self._spans = dict.fromkeys(SPANS, 0.0)
        self._start = self._mark = time.perf_counter()

    def span(self, name: str) -> None:
        """The time since the last mark, added to span ``name``."""
        now = time.perf_counter()
        self._spans[name] += 1e3 * (now - self._mark)
        self._mark = now

    def end(self, sched: Any) -> None:
        """The step's line: ``sched`` (a ``SchedulerOutput``) says what it held."""
        decode = prompt = 0
        for item in sched.scheduled:
            known = item.num_new_tokens - len(item.draft_token_ids)
            if known == 1 and not item.is_new:
                decode += 1
            else:
                prompt += known
        line = {
            "t": round(self._start, 6),
            "seqs": len(sched.scheduled),
            "decode": decode,
            "prompt_tokens": prompt,
            "tokens": sched.num_batched_tokens,
            "total_ms": round(1e3 * (time.perf_counter() - self._start), 3),
            **{name: round(ms, 3) for name, ms in self._spans.items()},
        }
        self._lines.append(json.dumps(line))
        if len(self._lines) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self._lines:
            with self.path.open("a") as f:
                f.write("\n".join(self._lines) + "\n")
            self._lines = []
