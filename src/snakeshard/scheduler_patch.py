"""One pending scheduler wake-up at a time in Snakemake 9's job scheduler (applied by the workflow).

Snakemake 9's ``JobScheduler.schedule`` ends every pass, when a job rate limit is set (the CLI always
sets one: ``--max-jobs-per-timespan 100/1s``), by starting a ``threading.Timer`` that wakes the
scheduler for another pass a second later. That pass starts its own timer, so each wake-up that
came from elsewhere (a finished job) starts a chain of passes that never ends: after k finished
jobs, k passes per second, each choosing among the ready jobs. With thousands of short shard jobs
the scheduler's CPU per job grows with the run's length (bench/job_overhead.py, 1,000 one-key shards on
2 cores: 51.8 ms of scheduler CPU per job before this patch, 10.2 ms with it; 1,000 ``echo`` jobs: 9.5).

The wake-up is there so that jobs held back by the rate limit get scheduled once the window has
passed; one pending timer does that as well as many. ``_schedule_reevalutation`` (sic) is replaced
by a version that starts a timer only when none is pending that fires at or before the one asked
for. Nothing else changes. Written against Snakemake 9.27.1; applied only where the method exists
under that name, elsewhere Snakemake runs as shipped.
"""

from __future__ import annotations

import threading
import time

_PATCHED = "_snakeshard_coalesced"


def coalesced_reevaluation(self, delay: float) -> None:
    """Wake the scheduler in ``delay`` seconds, unless a pending wake-up comes at or before then."""
    lock = self.__dict__.setdefault("_snakeshard_wake_lock", threading.Lock())
    with lock:
        due = time.monotonic() + delay
        pending = self.__dict__.get("_snakeshard_wake_at")
        if pending is not None and pending <= due:
            return
        self._snakeshard_wake_at = due

    def wake() -> None:
        with lock:
            if self.__dict__.get("_snakeshard_wake_at") == due:
                self._snakeshard_wake_at = None
        self._open_jobs.release()

    timer = threading.Timer(delay, wake)
    timer.daemon = True  # a wake-up left pending when the run ends must not hold the process open
    timer.start()


def apply() -> bool:
    """Patch Snakemake's scheduler class once; True when the patch is in place."""
    try:
        from snakemake.scheduling.job_scheduler import JobScheduler
    except ImportError:  # another Snakemake layout: leave it as it is
        return False
    original = JobScheduler.__dict__.get("_schedule_reevalutation")
    if original is None:
        return False
    if not getattr(original, _PATCHED, False):
        setattr(coalesced_reevaluation, _PATCHED, True)
        JobScheduler._schedule_reevalutation = coalesced_reevaluation
    return True
