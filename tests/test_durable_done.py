"""A ``done`` that survives power loss, and one that did not: a named state with the command that recovers.

A power loss cannot be staged here, so durability is checked by spying on ``os.fsync`` and
``os.replace`` (the order of the calls is what makes ``done`` durable); what a user meets after a
power loss, a zero-byte or cut-short ``done``, is staged for real and run through real snakemake.
"""

from __future__ import annotations

import os
from pathlib import Path

from conftest import run_cli, run_snakemake
from snakeshard import BaseRunner
from snakeshard.core.shard import run_shard
from test_inputs_changed import SET, expected_merged, make_audio_project, merged


class TwoFields(BaseRunner):
    @staticmethod
    def forward(key):
        return {"a": key, "b": len(key)}


def test_fragments_then_done_then_directory_are_fsynced_before_done_appears(tmp_path, monkeypatch):
    """Spy on fsync/replace during one shard: both fragments are fsynced, then done's temp file, then the
    rename, then the shard directory (so the new entry survives too)."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    shard_dir = tmp_path / "split.0"
    run_shard(TwoFields, {}, ["x", "yy"], shard_dir, progress=False)
    synced = [Path(p) for kind, p in events if kind == "fsync"]
    rename = events.index(("replace", str(shard_dir / "done")))
    assert {shard_dir / "a", shard_dir / "b"} <= set(synced[:2])
    assert events[rename - 1][0] == "fsync" and Path(events[rename - 1][1]).name.startswith(".done.")
    assert events[rename + 1] == ("fsync", str(shard_dir))


def test_zero_byte_done_is_a_named_state_and_the_documented_command_recovers(tmp_path):
    """What a power loss before the fix left: split.3/done with 0 bytes. Snakemake counts it as done, so
    status names it (`unreadable`, with the command), the merge refuses naming shard 3 and the command,
    and that command (with the profile) reruns the shard and merges."""
    wd = make_audio_project(tmp_path / "wf")
    assert run_snakemake(wd).returncode == 0
    done = wd / SET / "split.3/done"
    done.write_bytes(b"")
    command = "snakemake --profile <your profile> --forcerun results/energy/six/split.3/done"
    out = run_cli(wd, "status").stdout
    assert ("split.3     unreadable       1 item   results/energy/six/split.3/done is empty (0 bytes): a write cut "
            "short by a crash or power loss. Rerun the shard: " + command) in out
    assert "summary: 5 done, 1 unreadable" in out

    proc = run_snakemake(wd)
    assert proc.returncode != 0
    assert ("snakeshard: error: refusing to merge results/energy/six: shard 3: results/energy/six/split.3/done is "
            "empty (0 bytes)") in proc.stderr and command in proc.stderr

    recover = run_snakemake(wd, "--forcerun", "results/energy/six/split.3/done")
    assert recover.returncode == 0, recover.stderr[-2000:]
    assert done.stat().st_size > 0
    assert merged(wd) == expected_merged(wd)
    assert "merged: yes, current" in run_cli(wd, "status").stdout


def test_cut_short_done_names_the_shard_too(tmp_path):
    """A done holding half a JSON record: same named state, no raw JSONDecodeError anywhere."""
    wd = make_audio_project(tmp_path / "wf")
    assert run_snakemake(wd).returncode == 0
    done = wd / SET / "split.0/done"
    done.write_bytes(done.read_bytes()[:20])
    status = run_cli(wd, "status")
    assert status.returncode == 0 and "split.0     unreadable" in status.stdout
    assert "is not a done record (" in status.stdout
    proc = run_snakemake(wd)
    assert "JSONDecodeError" not in proc.stderr and "shard 0: results/energy/six/split.0/done is not a done record" \
        in proc.stderr


ORPHAN = '''
import sys, time
from snakeshard.core.shard import claimed_shard_dir
with claimed_shard_dir(sys.argv[1]):
    open(sys.argv[1] + "/feats.ark", "w").write("the orphan's")
    print("claimed", flush=True)
    time.sleep(1.5)
    open(sys.argv[1] + "/late.ark", "w").write("written by path after the retry started")
print(time.time(), flush=True)
'''


def test_a_retry_waits_for_an_orphaned_attempt_before_emptying_the_shard_dir(tmp_path, capfd):
    """An attempt still running (its snakemake killed with -9) writes its files by path: a retry that emptied the dir
    under it would end holding the orphan's files. The retry waits on the attempt's flock, naming the orphan's pid,
    then empties the dir (the orphan's late file too) and writes its own results."""
    import subprocess
    import sys
    import time

    from snakeshard.workflow.status import attempt_running

    shard_dir = tmp_path / "split.0"
    orphan = subprocess.Popen([sys.executable, "-c", ORPHAN, str(shard_dir)], stdout=subprocess.PIPE, text=True)
    assert orphan.stdout.readline() == "claimed\n"
    assert attempt_running(shard_dir)  # what `snakeshard status` says "running now" from
    run_shard(TwoFields, {}, ["x", "yy"], shard_dir, progress=False)
    assert not attempt_running(shard_dir)
    started_after = time.time()
    orphan_ended = float(orphan.stdout.readline())
    assert orphan.wait(timeout=30) == 0
    assert f"waiting for an earlier attempt of this shard (pid {orphan.pid};" in capfd.readouterr().err
    assert sorted(p.name for p in shard_dir.iterdir()) == [".attempt", "a", "b", "done"]  # no feats.ark, late.ark
    done_start = __import__("json").loads((shard_dir / "done").read_text())["start"]
    assert orphan_ended <= done_start + 0.01 and done_start <= started_after


def test_an_attempt_over_an_earlier_attempts_files_removes_the_sets_merged_json_first(tmp_path):
    """Merged scp files point into shard arks: a shard rerun (forced, or killed before its done) empties its dir, so
    the set's merged.json, which says the merged output is current, goes first; Snakemake then merges again. A shard
    dir with nothing of an earlier attempt (a new shard) leaves the merge as it is."""
    set_dir = tmp_path / "results/energy/demo"
    run_shard(TwoFields, {}, ["x"], set_dir / "split.0", progress=False)
    (set_dir / "merged.json").write_text("{}")
    run_shard(TwoFields, {}, ["x"], set_dir / "split.1", progress=False)  # new: nothing of an earlier attempt
    assert (set_dir / "merged.json").exists()
    (set_dir / "split.0/done").unlink()  # as Snakemake removes a job's output before running it
    run_shard(TwoFields, {}, ["x"], set_dir / "split.0", progress=False)
    assert not (set_dir / "merged.json").exists()
    assert (set_dir / "split.0/done").exists()
