"""Three fixes to Snakemake 9's driver costs, applied by the workflow (``workflow/rules/common.smk``).

Each replaces a private method, is written against Snakemake 9.27.1 and are applied only where the
method exists under that name; elsewhere Snakemake runs as shipped. Nothing else changes.

1. One pending scheduler wake-up at a time. ``JobScheduler.schedule`` ends every pass, when a job
   rate limit is set (the CLI always sets one: ``--max-jobs-per-timespan 100/1s``), by starting a
   ``threading.Timer`` that wakes the scheduler for another pass a second later. That pass starts its
   own timer, so each wake-up that came from elsewhere (a finished job) starts a chain of passes that
   never ends: after k finished jobs, k passes per second, each choosing among the ready jobs. With
   thousands of short shard jobs the scheduler's CPU per job grows with the run's length
   (bench/job_overhead.py, 1,000 one-key shards on 2 cores: 51.8 ms of scheduler CPU per job before
   this patch, 10.2 ms with it; 1,000 ``echo`` jobs: 9.5). The wake-up is there so that jobs held back
   by the rate limit get scheduled once the window has passed; one pending timer does that as well as
   many. ``_schedule_reevalutation`` (sic) is replaced by a version that starts a timer only when none
   is pending that fires at or before the one asked for.

2. No pandas import to record a job's params. When the first job finishes, Snakemake's persistence
   serializes the job's params (for its ``params`` rerun trigger) with a function chosen once: if
   pandas is installed, one that imports pandas to test whether a param is a DataFrame. That import
   costs 0.3-0.6 s of the driver, between the first job's end and the next job's start (the whole
   pipeline waits: bench/scoring.py's timeline). A param can only be a pandas object if pandas is
   already imported, so the replacement tests ``sys.modules`` and imports nothing; the recorded text
   is the same either way.

3. Input sizes stat'ed once per file. Before every scheduling pass, ``JobScheduler.job_selector``
   stats every input of every ready job it considers (``--scheduler-subsample``: up to 100) for
   their sizes, each through two coroutines (exists, size): with thousands of one-key shard jobs,
   ~100 files stat'ed per finished job, about 2 ms of scheduler CPU per job. The inputs of a ready
   job are finished files that do not change while it waits, so the replacement stats only those
   it has no size for yet; the sizes the job selector sees are the same.
"""

from __future__ import annotations

import sys
import threading
import time

_PATCHED = "_snakeshard_patched"


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


async def input_sizes_once(self, jobs) -> None:
    """Record the sizes of the inputs of ``jobs`` that ``self._input_sizes`` lacks (or saw missing)."""
    import asyncio

    async def get_size(path):
        return path, await path.size() if await path.exists() else None

    sizes = self._input_sizes
    paths = {path for job in jobs for path in job.input}
    new = [path for path in paths if sizes.get(path) is None]
    if new:
        sizes.update(await asyncio.gather(*[get_size(path) for path in new]))
    if len(sizes) > 10000:  # as Snakemake bounds it: keep only the paths of these jobs
        for path in [p for p in sizes if p not in paths]:
            del sizes[path]


def serialize_param(self, value):
    """A param's recorded text, as Snakemake's own serializers give it, without importing pandas."""
    pd = sys.modules.get("pandas")
    if pd is not None and isinstance(value, (pd.DataFrame, pd.Series, pd.Index)):
        return self._serialize_param_pandas(value)
    return self._serialize_param_builtin(value)


def param_serializer(self):
    """What Snakemake's ``PersistenceBase._serialize_param`` property gives: a one-argument serializer."""
    return lambda value: serialize_param(self, value)


def _replace(cls, name: str, new) -> bool:
    """``cls.name = new`` (a function or a property) once; False when ``cls`` has no such attribute."""
    original = cls.__dict__.get(name)
    if original is None:
        return False
    if not getattr(getattr(original, "fget", original), _PATCHED, False):  # a property is marked on its getter
        setattr(getattr(new, "fget", new), _PATCHED, True)
        setattr(cls, name, new)
    return True


def apply() -> dict[str, bool]:
    """Patch Snakemake's classes (idempotent); which patches are in place."""
    applied = {"scheduler": False, "params": False, "input_sizes": False}
    try:
        from snakemake.persistence import PersistenceBase
        from snakemake.scheduling.job_scheduler import JobScheduler
    except ImportError:  # another Snakemake layout: leave it as it is
        return applied
    applied["scheduler"] = _replace(JobScheduler, "_schedule_reevalutation", coalesced_reevaluation)
    applied["input_sizes"] = _replace(JobScheduler, "update_input_sizes", input_sizes_once)
    if all(hasattr(PersistenceBase, m) for m in ("_serialize_param_pandas", "_serialize_param_builtin")):
        applied["params"] = _replace(PersistenceBase, "_serialize_param", property(param_serializer))
    return applied
