"""A big manifest's planning spread over forked processes (the planner's two passes, core/manifest.py and plan.py).

Planning runs in the Snakemake driver, often on a login node with cores to spare, and costs ~4 µs a key in one
process (a cold ``snakemake -n`` at 10,000,000 keys: 35 s; with two forked workers 19.8 s, bench/RESULTS.md
section 26). Both passes
cut into independent parts (byte ranges of the manifest; runs of consecutive shards), so each part is computed in
a process forked from the driver: it inherits the columns pass 1 kept without a copy or a pickle, and only its
result comes back. Forked, not spawned: a spawned process would import snakeshard again and be sent the columns.
(The driver has no other thread while it parses the Snakefile, so the fork is safe; ``snakeshard.pool`` spawns
because its workers may hold CUDA.)

``SNAKESHARD_PLAN_WORKERS`` sets how many processes plan (``1``: all in the driver, as on a shared login node
that asks for it); unset, a manifest of ``PARALLEL_BYTES`` or more is planned on Linux by one process per core, at
most ``MAX_WORKERS``, and a smaller one in the driver (below that, the forks cost more than they save).
"""

from __future__ import annotations

import os
import sys

from snakeshard.errors import ConfigError, SnakeshardError

WORKERS_ENV = "SNAKESHARD_PLAN_WORKERS"
MAX_WORKERS = 4  # a login node is shared: a few cores for a few seconds
PARALLEL_BYTES = 4 << 20  # ~100,000 keys of 42 bytes: 0.42 -> 0.34 s on 2 cores; 0.4 MB: 0.14 -> 0.17 s (section 26)

_task = None  # the function the forked workers run: set before they fork, so they inherit it (a closure is fine)


def plan_workers(num_bytes: int) -> int:
    """How many processes plan ``num_bytes`` of manifest (see the module's docstring)."""
    given = os.environ.get(WORKERS_ENV, "").strip()
    if given:
        if not given.isdigit() or int(given) < 1:
            raise ConfigError(f"{WORKERS_ENV}={given!r}: give a number of processes, 1 or more")
        return int(given)
    if num_bytes < PARALLEL_BYTES or not sys.platform.startswith("linux"):  # macOS: fork is unsafe under its libs
        return 1
    return min(MAX_WORKERS, len(os.sched_getaffinity(0)))


def map_forked(func, parts: list, workers: int, meanwhile=None):
    """``func(part)`` for each part, in order, each as soon as it and those before it are done (so the caller can
    take in one result before the next arrives): in up to ``workers`` forked processes when there are several
    parts, else here. ``meanwhile()`` runs in this process while they work. An exception raised by ``func`` is
    raised here; a worker that dies (the OOM killer) fails the call, naming the way out, rather than hanging."""
    global _task
    if workers <= 1 or len(parts) <= 1:
        if meanwhile is not None:
            meanwhile()
        yield from map(func, parts)
        return
    import multiprocessing  # here: every Snakemake start plans, few of them fork (~15 ms of imports)
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    _task = func
    pool = ProcessPoolExecutor(min(workers, len(parts)), mp_context=multiprocessing.get_context("fork"))
    try:
        futures = [pool.submit(_run_task, part) for part in parts]
        if meanwhile is not None:
            meanwhile()
        for future in futures:
            yield future.result()
    except BrokenProcessPool:
        raise SnakeshardError(
            f"a planning process forked from this one died (killed, or out of memory?); the plan was not written: "
            f"run again, or plan in one process with {WORKERS_ENV}=1") from None
    finally:  # also when the caller stops early (a part with bad data): the parts not started are dropped
        pool.shutdown(wait=True, cancel_futures=True)
        _task = None


def _run_task(part):
    return _task(part)
