"""The request log: off by default, sizes and timings with ``--enable-log-requests``, text only
with ``--log-prompts``.

Fed by ``Generation`` (one ``RequestRecord`` per finished engine request); nothing about a
request reaches any log unless the operator asked for it.
"""

from __future__ import annotations

import logging
import time

from jaxserve.server.generation import RequestRecord

_LOG = logging.getLogger("jaxserve.server.requests")


class RequestLogger:
    def __init__(self, log_prompts: bool) -> None:
        self.log_prompts = log_prompts

    def log(self, record: RequestRecord) -> str:
        """Log one finished engine request; returns the line (for tests)."""
        metrics = record.engine_metrics
        arrival = metrics.arrival_time if metrics is not None else record.start_time
        first_token = (metrics and metrics.first_token_time) or record.first_token_time
        scheduled = metrics.first_scheduled_time if metrics is not None else None
        finished = (metrics and metrics.finished_time) or time.time()
        reasons = ",".join(record.finish_reasons[i] for i in sorted(record.finish_reasons))
        line = (
            f"request {record.request.request_id}: "
            f"prompt_tokens={len(record.request.prompt_token_ids)} "
            f"generation_tokens={record.num_generation_tokens} "
            f"cached_tokens={record.num_cached_tokens} "
            f"queue_s={_seconds(scheduled, arrival)} ttft_s={_seconds(first_token, arrival)} "
            f"e2e_s={_seconds(finished, arrival)} finish_reason={reasons}"
        )
        if self.log_prompts:
            outputs = [
                "".join((record.output_texts or {}).get(i, []))
                for i in sorted(record.finish_reasons)
            ]
            line += f" prompt={record.request.prompt!r} outputs={outputs!r}"
        _LOG.info(line)
        return line


def _seconds(end: float | None, start: float) -> str:
    return "-" if end is None else f"{max(0.0, end - start):.3f}"
