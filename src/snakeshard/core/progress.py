"""Progress lines in a shard job's log: items done, audio seconds, rate, time left.

A shard job's stderr is its log file, so progress is a line every ``interval`` seconds
(10 s in a file, 1 s on a terminal), never a redrawn bar. This is not tqdm on purpose: importing
tqdm costs a shard job ~25 ms (it reads its installed version through importlib.metadata) and its
first bar creates a multiprocessing lock (~6 ms more), a third of a one-key job's CPU
(bench/job_overhead.py), for a bar that a log file shows as carriage-return noise.
"""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressLog:
    """``update(n, seconds=None)`` after each batch of items; a line when ``interval`` has passed since
    the last one, and a last one at ``close()`` if any was printed (a short job prints none: the job's
    own summary line says it all)."""

    def __init__(self, total: int, desc: str, interval: float | None = None, file=None):
        self.file = file if file is not None else sys.stderr
        if interval is None:
            interval = 1.0 if self.file.isatty() else 10.0
        self.total, self.desc, self.interval = total, desc, interval
        self.done, self.seconds, self.printed = 0, None, False
        self.start = self.last = time.perf_counter()

    def update(self, n: int, seconds: float | None = None) -> None:
        self.done += n
        if seconds is not None:
            self.seconds = seconds
        now = time.perf_counter()
        if now - self.last >= self.interval:
            self.last = now
            self.file.write(self.line(now) + "\n")
            self.file.flush()
            self.printed = True

    def line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        percent = f" ({100 * self.done / self.total:.1f}%)" if self.total else ""
        audio = f", {self.seconds:.1f} s of audio" if self.seconds is not None else ""
        left = f", {_clock((self.total - self.done) / rate)} left" if rate > 0 and self.done < self.total else ""
        return (f"{self.desc}: {self.done}/{self.total} items{percent}{audio}, {rate:.1f} items/s, "
                f"{_clock(elapsed)} elapsed{left}")

    def close(self) -> None:
        if self.printed:
            self.file.write(self.line(time.perf_counter()) + "\n")
            self.file.flush()
