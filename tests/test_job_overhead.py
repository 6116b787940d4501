"""What keeps a shard job's fixed cost down: one pending scheduler wake-up, no pandas import in the driver,
a job that imports no tqdm, progress as log lines. The cost itself is measured in bench/job_overhead.py,
never asserted on time."""

from __future__ import annotations

import io
import json
import shlex
import subprocess
import sys
import threading
import time
import zlib

import pytest

from conftest import run_snakemake
from snakeshard.core.progress import ProgressLog
from snakeshard.workflow import snakemake_patches


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

    applied = {"scheduler_wakeup": True, "input_sizes": True, "params_pandas": True}  # on a checked Snakemake
    assert snakemake_patches.apply() == snakemake_patches.apply() == applied  # idempotent
    assert JobScheduler._schedule_reevalutation is snakemake_patches.coalesced_reevaluation
    assert JobScheduler.update_input_sizes is snakemake_patches.input_sizes_once
    assert PersistenceBase._serialize_param.fget is snakemake_patches.param_serializer


class FakeInput:
    """An input file as the scheduler sees it (Snakemake's _IOFile): async exists() and size(), counted."""

    def __init__(self, name: str, size: int | None, stats: list):
        self.name, self._size, self.stats = name, size, stats

    async def exists(self) -> bool:
        self.stats.append(self.name)
        return self._size is not None

    async def size(self) -> int:
        self.stats.append(self.name)
        return self._size


def test_input_sizes_are_read_once_per_file_and_a_missing_one_again():
    """The patched JobScheduler.update_input_sizes records the same sizes as Snakemake's, but a later pass
    over the same ready jobs stats nothing again, except a file it saw missing (which may exist now)."""
    import asyncio
    from types import SimpleNamespace

    stats: list[str] = []
    canary, keys = FakeInput("canary/done", 0, stats), [FakeInput(f"split.{n}/keys", 6 + n, stats) for n in range(3)]
    late = FakeInput("upstream/merged.json", None, stats)
    jobs = [SimpleNamespace(input=[canary, k]) for k in keys] + [SimpleNamespace(input=[late])]
    scheduler = SimpleNamespace(_input_sizes={})
    asyncio.run(snakemake_patches.input_sizes_once(scheduler, jobs))
    assert scheduler._input_sizes == {canary: 0, keys[0]: 6, keys[1]: 7, keys[2]: 8, late: None}
    assert sorted(stats) == sorted(["canary/done"] * 2 + [f"split.{n}/keys" for n in range(3) for _ in "es"]
                                   + ["upstream/merged.json"])
    stats.clear()
    late._size = 12  # the missing one appears
    asyncio.run(snakemake_patches.input_sizes_once(scheduler, jobs))
    assert stats == ["upstream/merged.json", "upstream/merged.json"]  # only it, exists() then size()
    assert scheduler._input_sizes[late] == 12


# Run in a fresh interpreter: whether pandas gets imported is the point.
PARAMS_CHECK = """
import json, sys
from snakemake.persistence import PersistenceBase, UNREPRESENTABLE
from snakeshard.workflow import snakemake_patches
snakemake_patches.apply()
# With the slurm extra installed, Snakemake's plugin registry has imported pandas already (the plugin
# imports it): then there is nothing left to check, and "pandas_before" says so.
pandas_before = "pandas" in sys.modules
class Persistence(PersistenceBase):  # only the serializers are used: no __init__, no abstract methods
    pass
Persistence.__abstractmethods__ = frozenset()
p = object.__new__(Persistence)
values = ["results/score/big", 3, None, ["a", 1], {"k": 2.5}]
texts = [p._serialize_param(v) for v in values]
out = {"texts": texts, "object": p._serialize_param(object()) is UNREPRESENTABLE, "pandas": "pandas" in sys.modules,
       "pandas_before": pandas_before}
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
    assert out.get("frame", True) is True  # checked where pandas is installed (the slurm extra pulls it)
    if out["pandas_before"]:  # the slurm extra's plugin imported it at start: the patch cannot save it
        pytest.skip("pandas was imported before any param was recorded (the slurm extra is installed)")
    assert out["pandas"] is False


def test_a_shard_job_imports_neither_tqdm_nor_multiprocessing(tmp_path):
    """The modules a shard job runs (cli, shard, user_code's import_object, data, devices, fingerprint,
    progress) do not import tqdm (~25 ms) or multiprocessing (its lock, ~6 ms); a pool job imports the
    latter when it starts its pool, not before. A scoring, merge or report job, which computes nothing with
    numpy, does not import it (~60 ms) through the runners package."""
    code = ("import sys, snakeshard.cli, snakeshard.workflow.job, snakeshard.core.shard, snakeshard.core.user_code, snakeshard.workflow.parse, snakeshard.core.data, "
            "snakeshard.core.devices, snakeshard.core.fingerprint, snakeshard.core.progress, snakeshard.core.merge; "
            "from snakeshard.stages import ScoringRunner, ScoringProvider; "
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


# -- what a shard job imports before its first item (bench/job_overhead.py measures the cost) --

# Stdlib modules a shard job used to import and no longer needs -> what they were for, what they cost
# the job (CPU, bench machine) and what replaced them.
NOT_IN_A_JOB = {
    "argparse": "the whole CLI parser (~5 ms with gettext, locale, shutil): job.parse_job_args parses the rule's options",
    "inspect": "forward's signature (~10 ms): hooks.forward_parameters reads a plain function's code",
    "dataclasses": "Item and Audio (~12 ms with inspect): plain classes with slots",
    "typing": "annotations only (~3 ms)",
    "tempfile": "atomic writes' temp name (~4 ms): atomic._create_temp_beside",
    "shutil": "removing a failed attempt's dirs (~2 ms): imported only then",
    "traceback": "printing a failure (~3 ms): imported only then",
    "ast": "the parse-time check of import paths (~5 ms with importlib.util): user_code imports directly",
    "pathlib": "shard paths (~5 ms on top of json's re): strings and os.path in the job's modules; "
               "hooks a runner overrides still get a Path (shard._hook_dir)",
}


def test_a_shard_job_imports_none_of_the_costly_stdlib_modules(toy_workdir):
    """A real shard job, run with the command line Snakemake gives it, finishes its shard without importing
    any module of NOT_IN_A_JOB (each cost every job milliseconds before its first item)."""
    dry = run_snakemake(toy_workdir, "-n", "-p")
    assert dry.returncode == 0, dry.stderr
    command = next(line for line in dry.stdout.splitlines() if "run-shard --shard 1 " in line)
    args = shlex.split(command.split("-m snakeshard ", 1)[1])
    modules = toy_workdir / "modules.json"
    # `python -m snakeshard ARGS`, recording at exit which modules the job had imported
    # (less what the interpreter imported before: an editable install's finder imports pathlib at start-up)
    record = ("import atexit, sys, runpy; before = set(sys.modules); "
              f"atexit.register(lambda: open({str(modules)!r}, 'w').write('\\n'.join(sorted(set(sys.modules) - before)))); "
              "sys.argv = ['snakeshard', *sys.argv[1:]]; runpy.run_module('snakeshard', run_name='__main__')")
    job = subprocess.run([sys.executable, "-c", record, *args], cwd=toy_workdir, capture_output=True, text=True)
    assert job.returncode == 0, job.stderr + (toy_workdir / "results/upper/toy/logs/split.1.log").read_text()
    assert (toy_workdir / "results/upper/toy/split.1/done").is_file()
    imported = set(modules.read_text().split("\n"))
    assert "snakeshard.core.shard" in imported and "toy" in imported  # it did run the shard loop and the runner
    assert sorted(imported & NOT_IN_A_JOB.keys()) == []


def test_hooks_a_runner_overrides_get_the_shard_dir_as_a_path(tmp_path):
    """The shard loop works on str paths (pathlib stays out of a job), but a runner's own open_writers and
    finalize_state receive a pathlib.Path, as they always did; the default hooks write the same files."""
    from pathlib import Path

    from snakeshard import BaseRunner, EnvironmentProvider
    from snakeshard.io.writers import FieldWriters

    class Provider(EnvironmentProvider):
        def build_env_local(self):
            return {}

    seen = []

    class OwnHooks(BaseRunner):
        @staticmethod
        def forward(key):
            return {"text": key.upper()}

        @staticmethod
        def open_writers(shard_dir, **env):
            seen.append(shard_dir)
            return FieldWriters(shard_dir)

        @staticmethod
        def finalize_state(state, shard_dir, **env):
            seen.append(shard_dir)
            (shard_dir / "count.txt").write_text("2\n")
            return ["count.txt"]

    class Defaults(BaseRunner):
        forward = staticmethod(OwnHooks.forward)

    done = OwnHooks(Provider(), output_dir=str(tmp_path / "own"))(["a", "b"])
    assert [isinstance(d, Path) for d in seen] == [True, True] and seen[0] == tmp_path / "own"
    assert done["state_files"] == {"count.txt": {"bytes": 2, "crc32": zlib.crc32(b"2\n")}}
    Defaults(Provider(), output_dir=str(tmp_path / "default"))(["a", "b"])
    for root in ("own", "default"):
        assert (tmp_path / root / "text").read_text() == "a A\nb B\n"
        assert json.loads((tmp_path / root / "done").read_text())["fields"]["text"]["bytes"] == 8


def test_the_job_parser_gives_what_argparse_gives_and_leaves_the_rest_to_it():
    """job.parse_job_args parses the rules' run-shard and run-shards lines as argparse does; anything else (a
    missing or unknown option, both of two exclusive ones, a bad shard number, --help) it leaves to argparse,
    which words the error."""
    from snakeshard.cli import build_parser
    from snakeshard.workflow.job import parse_job_args as _job_args

    rule_lines = [
        "run-shard --shard 3 --spec r/s/t/spec.json --shard-dir r/s/t/split.3 --shard-inputs a:b:c:d --log l/split.3.log",
        "run-shard --shard canary --spec r/s/_canary/spec.json --shard-dir r/s/_canary --fingerprint f0 --log l/c.log",
        "run-shard --spec x.json --shard 0 --shard-dir d --fingerprint f",  # any order, no --log
        "run-shards --shards 0-9 --spec s.json --set-dir r/s/t --shard-inputs a,b --done r/s/t/jobs/shards.0-9.done "
        "--log l/j.log",
    ]
    for line in rule_lines:
        argv = line.split()
        fast, full = vars(_job_args(argv)), vars(build_parser().parse_args(argv))
        assert fast == full, line
    for line in [
        "run-shard --shard 3 --spec s.json --shard-inputs a",  # --shard-dir missing
        "run-shard --shard 3 --spec s.json --shard-dir d --shard-inputs a --fingerprint f",  # both
        "run-shard --shard 3 --spec s.json --shard-dir d",  # neither
        "run-shard --shard three --spec s.json --shard-dir d --fingerprint f",  # not a number
        "run-shard --shard 3 --spec s.json --shard-dir d --fingerprint f --shard 4",  # given twice
        "run-shard --shard 3 --spec s.json --shard-dir d --fingerprint f --verbose x",  # unknown
        "run-shard --help",
        "run-shards --shards 9-0 --spec s --set-dir d --shard-inputs a --done x",  # LAST < FIRST
        "run-shards --shards=0-9 --spec s --set-dir d --shard-inputs a --done x",  # = form
        "merge --spec s --set-dir d --inputs i",  # not a job command
        "",
    ]:
        assert _job_args(line.split()) is None, line


def test_digests_are_sha256_as_hashlib_gives_them():
    """fingerprint.digest_bytes is the first 20 hex digits of hashlib.sha256 (plans and shard fingerprints
    recorded by earlier versions, which hashed small inputs with CPython's own SHA-256, must not change)."""
    import hashlib

    from snakeshard.core.fingerprint import digest, digest_bytes

    for data in [b"", b"k0001\n", bytes(range(256)) * 1000, b"x" * (1 << 20), b"y" * ((1 << 20) + 1)]:
        assert digest_bytes(data) == hashlib.sha256(data).hexdigest()[:20]
    assert digest("clé") == hashlib.sha256("clé".encode()).hexdigest()[:20]
    assert digest("k0001\n") == "53f1ed691b44d6ce2c96"  # a fixed value: the same digests as before
