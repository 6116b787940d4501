"""Three fixes to Snakemake 9's driver costs, applied by the workflow (``workflow/rules/common.smk``).

Each replaces one private Snakemake method, and only on the Snakemake versions it was checked against
(``PATCHES``); on any other version that patch is left out, the run says so once on stderr, and Snakemake
runs as shipped. Nothing else changes. ``docs/upstream/<patch>.md`` has, for each, the cost, a standalone
reproduction with measured figures and the fix proposed to Snakemake; ``tests/test_snakemake_patches.py``
fails, naming the patch, when the installed Snakemake is not the one it was checked against.

- ``scheduler_wakeup`` (``JobScheduler._schedule_reevalutation``, sic): every scheduling pass with ready
  jobs starts a 1-s timer whose pass starts another, so each finished job adds a chain of passes.
  Replaced by one pending wake-up at a time (1,000 one-key shards: 51.8 -> 10.2 ms of scheduler CPU per job,
  bench/RESULTS.md section 9). Jobs held back by the rate limit (over 100 jobs/s) then wait up to a second
  for that wake-up: such a run is slower than with Snakemake as shipped (the doc's second case).
- ``input_sizes`` (``JobScheduler.update_input_sizes``): every pass stats every input of every ready job
  it considers. Replaced by a version that stats only files it has no size for (section 12).
- ``params_pandas`` (``PersistenceBase._serialize_param``): recording the first finished job's params
  imports pandas, if installed (0.3-0.6 s while no job starts), to test for DataFrames. Replaced by a look-up
  in ``sys.modules``: a param can only be a pandas object if pandas is imported already (section 10).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import NamedTuple

from snakeshard.errors import NOTE_PREFIX

# Snakemake 9.27.1 runs the tests and bench/ with the patches. In every release from 9.17.0 to 9.27.0, the
# replaced methods, those they call (``relies_on``), JobScheduler.__init__ and job_selector are the same text as
# in 9.27.1; the rest of their two modules differs (9.17.0 vs 9.27.1) only where the patches do not reach (error
# logging, touch mode, start-time records, checksum prefixes), and 9.17.0 passed the patch tests and two workflow
# tests. Before 9.17.0 the methods differ (there is no _serialize_param).
CHECKED = ">=9.17.0,<=9.27.1"


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


class Patch(NamedTuple):
    module: str  # where Snakemake defines the class
    cls: str
    attr: str  # the method replaced
    new: object  # what replaces it
    checked: str  # the Snakemake versions it was checked against (a PEP 440 specifier set)
    relies_on: tuple[str, ...] = ()  # methods of the class the replacement calls


PATCHES = {
    "scheduler_wakeup": Patch("snakemake.scheduling.job_scheduler", "JobScheduler", "_schedule_reevalutation",
                              coalesced_reevaluation, CHECKED),
    "input_sizes": Patch("snakemake.scheduling.job_scheduler", "JobScheduler", "update_input_sizes",
                         input_sizes_once, CHECKED),
    "params_pandas": Patch("snakemake.persistence", "PersistenceBase", "_serialize_param",
                           property(param_serializer), CHECKED, ("_serialize_param_pandas", "_serialize_param_builtin")),
}

_noted: set[str] = set()  # patches whose "not applied" line this process has printed


def apply(version: str | None = None, note: bool = True) -> dict[str, bool]:
    """Replace Snakemake's methods where the installed Snakemake (or ``version``) is in each patch's checked
    range (idempotent); which patches are in place. A patch left out says so on stderr, once per process,
    where ``note`` (the workflow passes false in a job's own Snakemake, e.g. on SLURM)."""
    from importlib import import_module
    from importlib.metadata import version as installed_version

    from packaging.specifiers import SpecifierSet

    version = version or installed_version("snakemake")
    applied = {}
    for name, patch in PATCHES.items():
        applied[name] = SpecifierSet(patch.checked).contains(version)
        if applied[name]:
            setattr(getattr(import_module(patch.module), patch.cls), patch.attr, patch.new)
        elif note and name not in _noted:
            _noted.add(name)
            print(f"{NOTE_PREFIX}patch {name} ({patch.cls}.{patch.attr}) not applied: snakemake {version} is "
                  f"outside the versions it was checked against ({patch.checked}); Snakemake runs as shipped "
                  f"(docs/upstream/{name}.md)", file=sys.stderr, flush=True)
    return applied
