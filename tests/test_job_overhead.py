"""What keeps a shard job's fixed cost down: one pending scheduler wake-up, no pandas import in the driver,
a job that imports no tqdm, progress as log lines. The cost itself is measured in bench/job_overhead.py,
never asserted on time."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time

from snakeshard import snakemake_patches
from snakeshard.progress import ProgressLog


class FakeScheduler:
    """What the patched method touches on Snakemake's JobScheduler: the semaphore its loop waits on."""

    def __init__(self):
        self._open_jobs = threading.Semaphore(0)

    def wake_ups(self, within: float) -> int:
        n, end = 0, time.monotonic() + within
        while self._open_jobs.acquire(timeout=max(end - time.monotonic(), 0.001)):
            n += 1
        return n


def test_many_requests_for_a_wake_up_give_one():
    """Snakemake asks for a wake-up at the end of every pass; 50 asks while one is pending wake the loop
    once (unpatched: 50 times, and each of those passes asks again)."""
    s = FakeScheduler()
    for _ in range(50):
        snakemake_patches.coalesced_reevaluation(s, 0.2)
    assert s.wake_ups(within=0.8) == 1
    snakemake_patches.coalesced_reevaluation(s, 0.05)  # after it fired, a new ask is served again
    assert s.wake_ups(within=0.5) == 1


def test_an_earlier_wake_up_is_not_swallowed_by_a_later_pending_one():
    """A pending 10 s wake-up (Snakemake's queue-input wait) does not delay one asked for in 0.05 s."""
    s = FakeScheduler()
    snakemake_patches.coalesced_reevaluation(s, 10)
    t0 = time.monotonic()
    snakemake_patches.coalesced_reevaluation(s, 0.05)
    assert s._open_jobs.acquire(timeout=2)
    assert time.monotonic() - t0 < 2


def test_the_patches_replace_snakemakes_methods_once():
    from snakemake.persistence import PersistenceBase
    from snakemake.scheduling.job_scheduler import JobScheduler

    assert snakemake_patches.apply() == snakemake_patches.apply() == {"scheduler": True, "params": True}  # idempotent
    assert JobScheduler._schedule_reevalutation is snakemake_patches.coalesced_reevaluation
    assert PersistenceBase._serialize_param.fget is snakemake_patches.param_serializer


# Run in a fresh interpreter: whether pandas gets imported is the point.
PARAMS_CHECK = """
import json, sys
from snakemake.persistence import PersistenceBase, UNREPRESENTABLE
from snakeshard import snakemake_patches
snakemake_patches.apply()
class Persistence(PersistenceBase):  # only the serializers are used: no __init__, no abstract methods
    pass
Persistence.__abstractmethods__ = frozenset()
p = object.__new__(Persistence)
values = ["results/score/big", 3, None, ["a", 1], {"k": 2.5}]
texts = [p._serialize_param(v) for v in values]
out = {"texts": texts, "object": p._serialize_param(object()) is UNREPRESENTABLE, "pandas": "pandas" in sys.modules}
try:
    import pandas as pd
except ImportError:
    pass
else:
    frame = pd.DataFrame({"a": [1, 2]})
    out["frame"] = p._serialize_param(frame) == p._serialize_param_pandas(frame) == repr(
        pd.util.hash_pandas_object(frame).tolist())
print(json.dumps(out))
"""


def test_recording_params_imports_no_pandas_and_records_the_same_text():
    """Snakemake 9.27.1 imports pandas (0.3-0.6 s) when the first job ends, to test whether a param is a
    DataFrame; patched, plain params are recorded as Snakemake records them (repr) with no pandas import, an
    object it cannot represent stays unrepresentable, and a DataFrame (pandas then is imported) is hashed as
    Snakemake hashes it."""
    out = json.loads(subprocess.run([sys.executable, "-c", PARAMS_CHECK], capture_output=True, text=True,
                                    check=True).stdout)
    assert out["texts"] == ["'results/score/big'", "3", "None", "['a', 1]", "{'k': 2.5}"]
    assert out["object"] is True
    assert out["pandas"] is False
    assert out.get("frame", True) is True  # checked where pandas is installed (the slurm extra pulls it)


def test_a_shard_job_imports_neither_tqdm_nor_multiprocessing(tmp_path):
    """The modules a shard job runs (cli, shard, workflow's import_object, data, devices, fingerprint,
    progress) do not import tqdm (~25 ms) or multiprocessing (its lock, ~6 ms); a pool job imports the
    latter when it starts its pool, not before. A scoring, merge or report job, which computes nothing with
    numpy, does not import it (~60 ms) through the runners package."""
    code = ("import sys, snakeshard.cli, snakeshard.shard, snakeshard.workflow, snakeshard.data, "
            "snakeshard.devices, snakeshard.fingerprint, snakeshard.progress, snakeshard.merge; "
            "from snakeshard.runners import ScoringRunner, ScoringProvider; "
            "print(sorted(m for m in ('tqdm', 'multiprocessing', 'socket', 'uuid', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.replace("'", '"')) == []


def test_progress_is_a_line_per_interval_with_items_audio_rate_and_time_left():
    log = io.StringIO()
    p = ProgressLog(total=200, desc="shard 3", interval=0.0, file=log)
    p.update(50, seconds=12.5)
    p.update(150, seconds=40.0)
    p.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 3  # two updates, one closing line
    assert lines[0].startswith("shard 3: 50/200 items (25.0%), 12.5 s of audio, ")
    assert "items/s" in lines[0] and lines[0].endswith(" left")
    assert lines[-1].startswith("shard 3: 200/200 items (100.0%), 40.0 s of audio, ")
    assert "left" not in lines[-1]


def test_a_short_job_prints_no_progress_line():
    """Under the interval nothing is printed, at close neither: the job's summary line says it."""
    log = io.StringIO()
    p = ProgressLog(total=5, desc="shard 0", interval=60.0, file=log)
    p.update(5)
    p.close()
    assert log.getvalue() == ""
