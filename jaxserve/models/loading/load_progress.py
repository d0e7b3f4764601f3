"""How far loading a checkpoint has got, in the log: a line at every tenth of the bytes (for a
large checkpoint) and one at the end with the bytes, seconds and rate; and a load's stop
(``LoadCancelled``). ``checkpoint_loader.load_weights`` counts each piece its reading threads
read."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

_LOG = logging.getLogger("jaxserve.models.loading.checkpoint_loader")  # the loader's lines
GiB = 1024**3


def format_bytes(num_bytes: int) -> str:
    """``8.4 MiB``, ``14.96 GiB``."""
    if num_bytes >= GiB:
        return f"{num_bytes / GiB:.2f} GiB"
    return f"{num_bytes / 1024**2:.1f} MiB"


def format_rate(bytes_per_s: float) -> str:
    """``1.37 GB/s``; below 1 GB/s in MB/s (a small model's "0.00 GB/s" said nothing)."""
    if bytes_per_s >= 1e9:
        return f"{bytes_per_s / 1e9:.2f} GB/s"
    return f"{bytes_per_s / 1e6:.{1 if bytes_per_s < 1e7 else 0}f} MB/s"


class LoadProgress:
    """Counts the bytes read from a checkpoint's shards and logs how far loading has got."""

    def __init__(self, shards: list[Path], log_every_tenth_above_bytes: int) -> None:
        self.shards = shards  # in the order of their names (model-00001-of-00004, ...)
        self.total_bytes = sum(shard.stat().st_size for shard in shards if shard.is_file())
        self.log_every_tenth = self.total_bytes >= log_every_tenth_above_bytes
        self.num_bytes = 0
        self.tenths_logged = 0
        self.start = time.perf_counter()
        self._lock = threading.Lock()  # reading threads add at once

    def add(self, shard: Path, num_bytes: int) -> None:
        with self._lock:
            self.num_bytes += num_bytes
            if not self.log_every_tenth or not self.total_bytes:
                return
            tenths = min(10, self.num_bytes * 10 // self.total_bytes)
            if tenths <= self.tenths_logged:
                return

            self.tenths_logged = tenths
            _LOG.info(
                "Loading weights: %d%% (%s of %s), shard %d of %d, at %.1f s",
                tenths * 10,
                format_bytes(self.num_bytes),
                format_bytes(self.total_bytes),
                self.shards.index(shard) + 1,
                len(self.shards),
                time.perf_counter() - self.start,
            )

    def finish(self) -> None:
        num_shards = len(self.shards)
        seconds = time.perf_counter() - self.start
        _LOG.info(
            "Loaded weights: %s from %d shard%s in %.1f s (%s)",
            format_bytes(self.num_bytes),
            num_shards,
            "" if num_shards == 1 else "s",
            seconds,
            format_rate(self.num_bytes / max(seconds, 1e-9)),
        )


class LoadCancelled(Exception):
    """The weights stopped loading because the start-up failed or was interrupted."""


def raise_if_stopped(stop: threading.Event) -> None:
    if stop.is_set():
        raise LoadCancelled("the start-up stopped while the weights loaded")
