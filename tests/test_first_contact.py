"""First-contact defects (each test failed before its fix) and the per-stage canary job.

Real `snakemake` and `snakeshard` processes on the toy workflow of conftest (40 keys, 4 shards).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import (keep_only_stage, make_kaldi_dir, read_config, run_cli, run_snakemake, shard_process, wait_for,
                      write_config)

TOY = Path("results/upper/toy")
CONSOLE_SCRIPT = str(Path(sys.executable).parent / "snakeshard")


def executed(proc, rule: str = r"shard_\w+") -> list[str]:
    """Rule names of the jobs a snakemake run (or dry run) lists, in order."""
    return re.findall(rf"^(?:local)?rule ({rule}):", proc.stdout + proc.stderr, re.M)


def set_stage(wd: Path, **changes) -> None:
    config = read_config(wd)
    config["stages"]["upper"].update(changes)
    write_config(wd, config)


# -- defect 2: files written by rename get the umask's permissions, not mkstemp's 0600 --

@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_atomic_writes_follow_the_umask(tmp_path, umask, mode):
    """atomic_write_text under umask 022/002/077 gives 0644/0664/0600, as a plain open() would."""
    code = ("import os, sys; os.umask(int(sys.argv[1], 8)); from snakeshard.io.atomic import atomic_write_text; "
            "atomic_write_text(sys.argv[2], 'x'); open(sys.argv[3], 'w').close()")
    subprocess.run([sys.executable, "-c", code, oct(umask)[2:], tmp_path / "atomic", tmp_path / "plain"], check=True)
    assert stat.S_IMODE((tmp_path / "atomic").stat().st_mode) == mode
    assert stat.S_IMODE((tmp_path / "plain").stat().st_mode) == mode


def test_every_file_of_a_run_follows_the_umask(toy_workdir):
    """A whole run under umask 002: plan.json, spec.json, keys, done, fragments, merged files, merged.json are 0664."""
    old = os.umask(0o002)
    try:
        run = run_snakemake(toy_workdir)
    finally:
        os.umask(old)
    assert run.returncode == 0, run.stderr[-3000:]
    files = [p for p in (toy_workdir / "results").rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"plan.json", "spec.json", "keys", "done", "text", "merged.json"} <= names
    wrong = {str(p.relative_to(toy_workdir)): oct(stat.S_IMODE(p.stat().st_mode))
             for p in files if stat.S_IMODE(p.stat().st_mode) != 0o664}
    assert not wrong


# -- defect 3: the console script, with the project's own modules, outside the repository --

def test_console_script_imports_the_projects_modules(tmp_path):
    """`snakeshard plan` / `status` (the console script, not python -m) in a project outside the repo."""
    project = tmp_path / "proj"
    assert subprocess.run([CONSOLE_SCRIPT, "init", str(project)], capture_output=True).returncode == 0
    for command in ("plan", "status"):
        proc = subprocess.run([CONSOLE_SCRIPT, command], cwd=project, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert "Traceback" not in proc.stderr
        assert "stage energy, dataset demo" in proc.stdout


# -- defect 4: a missing dataset path names the config key and the directory it is relative to --

def test_missing_dataset_path_names_config_key_and_base_dir(toy_workdir):
    config = read_config(toy_workdir)
    config["datasets"] = {"mydata": {"path": "data/mydata"}}
    config["stages"]["upper"]["datasets"] = ["mydata"]
    write_config(toy_workdir, config)
    expected = (f"datasets.mydata.path: data/mydata does not exist "
                f"(relative paths are taken from the working directory {toy_workdir})")
    dry = run_snakemake(toy_workdir, "-n")
    assert dry.returncode != 0 and expected in dry.stdout + dry.stderr
    plan = run_cli(toy_workdir, "plan")
    assert plan.returncode == 1 and plan.stderr.strip() == "snakeshard: error: " + expected


# -- defect 5: `snakeshard status | head` --

def test_status_into_a_closed_pipe_ends_quietly(workdir):
    """3,000 shards (~150 kB of status, more than a pipe holds): `| head -3` gives 3 lines and no traceback."""
    make_kaldi_dir(workdir / "data/many", [f"u{i:05d}" for i in range(3000)], Path("data/demo/wav/cards-001.wav"))
    config = keep_only_stage(read_config(workdir), "asr")
    config["datasets"] = {"many": {"path": "data/many"}}
    config["stages"]["asr"].update(datasets=["many"], sharding={"shard_size": 1})
    write_config(workdir, config)
    proc = subprocess.run(["bash", "-c", f"{CONSOLE_SCRIPT} status | head -3; echo \"status=${{PIPESTATUS[0]}}\" >&2"],
                          cwd=workdir, capture_output=True, text=True, timeout=300)
    assert proc.stdout.splitlines()[0] == "stage asr, dataset many: 3000 shards"
    assert len(proc.stdout.splitlines()) == 3
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().endswith("status=141")  # as a tool killed by SIGPIPE


# -- defect 7: a done deleted after the merge --

def test_deleted_done_after_merge_status_says_current_and_target_redoes_it(toy_workdir):
    """status says what Snakemake will do with a set whose shard done was deleted, or made again, after the
    merge, and the command it prints runs as pasted (a user trial: it lacked the profile, and Snakemake stopped
    on "cores have to be specified"; after the forced shard, status said "current" while Snakemake merged again)."""
    assert run_snakemake(toy_workdir).returncode == 0
    merged = (toy_workdir / TOY / "text").read_bytes()
    (toy_workdir / TOY / "split.1/done").unlink()

    again = run_snakemake(toy_workdir)
    assert again.returncode == 0 and executed(again) == []  # Snakemake: a removed intermediate
    status = run_cli(toy_workdir, "status").stdout
    command = "snakemake --profile config/profiles/local results/upper/toy/split.1/done"
    assert re.search(rf"split\.1\s+removed\s+10 items\s+done deleted after the merge; `{re.escape(command)}` "
                     r"redoes it", status), status
    assert "merged: yes, current" in status

    forced = subprocess.run(command, shell=True, cwd=toy_workdir, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert forced.returncode == 0 and executed(forced) == ["shard_upper"], forced.stderr[-2000:]
    assert "wildcards: dataset=toy, shard=1" in forced.stdout + forced.stderr
    (toy_workdir / TOY / "split.2/done").unlink()
    status = run_cli(toy_workdir, "status").stdout
    # the forced shard emptied its dir, where the merged files may point (scp into arks): merged.json went first
    assert "  merged: no\n" in status and not (toy_workdir / TOY / "merged.json").exists(), status
    assert re.search(r"split\.2\s+incomplete\s+10 items\s+started, no done, and no attempt holds it here: killed, "
                     r"its done deleted", status), status
    remerge = run_snakemake(toy_workdir)
    assert sorted(executed(remerge, r"shard_\w+|merge")) == ["merge", "shard_upper"]  # what status said
    assert (toy_workdir / TOY / "text").read_bytes() == merged
    assert "summary: 4 done" in run_cli(toy_workdir, "status").stdout


def test_a_forced_upstream_shard_makes_status_name_the_downstream_shards_snakemake_runs_again(toy_workdir):
    """Forcing one shard of a stage (the docs' way) reruns the shards of a chained stage that read its keys, though
    no fingerprint changed (Snakemake: an input newer than the output): status says so for those shards and their
    merge, and nothing for the others (a user trial: status said current, and snakemake -n ran 2 shards)."""
    config = read_config(toy_workdir)
    config["datasets"]["up"] = {"from_stage": "upper", "dataset": "toy"}
    config["stages"]["again"] = {**config["stages"]["upper"], "datasets": ["up"], "sharding": {"num_shards": 2}}
    write_config(toy_workdir, config)
    assert run_snakemake(toy_workdir).returncode == 0
    (toy_workdir / TOY / "split.1/done").unlink()
    forced = run_snakemake(toy_workdir, "results/upper/toy/split.1/done")
    assert forced.returncode == 0 and executed(forced) == ["shard_upper"], forced.stderr[-2000:]
    status = run_cli(toy_workdir, "status").stdout
    again = status[status.index("stage again"):status.index("summary")]
    assert re.search(r"split\.0\s+stale\s+20 items\s+results/upper/toy/split\.1/done is newer than its done: "
                     r"snakemake runs it again\n", again), status
    assert re.search(r"split\.1\s+done\s+20 items\n", again), status
    assert ("merged: yes, not current: snakemake makes it again (split.0 runs again: an input from another stage is "
            "newer than its done)") in again, status
    dry = run_snakemake(toy_workdir, "-n")
    assert sorted(executed(dry, r"shard_\w+|merge")) == ["merge", "merge", "shard_again"], dry.stdout
    assert run_snakemake(toy_workdir).returncode == 0
    assert "summary: 6 done" in run_cli(toy_workdir, "status").stdout


def test_a_runner_over_a_chained_dataset_runs_in_process_with_the_dataset_as_the_config_writes_it(toy_workdir,
                                                                                                 monkeypatch):
    """load_dataset takes a chained dataset as the config writes it ({from_stage, dataset}, output_dir 'results'
    by default), so a chained stage's runner runs in-process as any other (a user trial: KeyError 'path', and a
    dataset copied out of an internal spec.json was the only way). Specs that name no data say what to give."""
    from snakeshard import load_dataset
    from snakeshard.errors import DataError

    assert run_snakemake(toy_workdir).returncode == 0
    monkeypatch.chdir(toy_workdir)
    monkeypatch.syspath_prepend(str(toy_workdir))
    monkeypatch.delitem(sys.modules, "toy", raising=False)  # this project's, removed again after the test
    toy = __import__("toy")
    chained = {"from_stage": "upper", "dataset": "toy"}
    assert load_dataset(chained).load_field("utt007", "text") == "UTT007"
    runner = toy.UpperRunner(toy.ToyProvider({"dataset": chained, "suffix": "!"}))
    assert [r["text"] for r in runner(["utt007", "utt012"])] == ["UTT007!", "UTT012!"]
    with pytest.raises(DataError, match=r"results/upper/dev: no spec.json there: stage 'upper' over dataset 'dev' "
                                        r"has not been planned under output_dir 'results'"):
        load_dataset({"from_stage": "upper", "dataset": "dev"})
    with pytest.raises(DataError, match=r"name the dataset of stage 'upper' it reads \('dataset': \.\.\.\)"):
        load_dataset({"from_stage": "upper"})
    with pytest.raises(DataError, match=r"names no data: give \{'path': <Kaldi dir or JSON Lines file>\}, or a "
                                        r"chained dataset \{'from_stage'"):
        load_dataset({"format": "kaldi"})


def test_status_notes_the_output_of_a_stage_or_dataset_the_config_no_longer_has(toy_workdir):
    """A stage or dataset removed from the config (or renamed) leaves its dir, which Snakemake neither reads nor
    removes: status names it (an HPC user's trial: nothing did)."""
    assert run_snakemake(toy_workdir).returncode == 0
    assert "note:" not in run_cli(toy_workdir, "status").stdout
    config = read_config(toy_workdir)
    config["datasets"]["toy2"] = config["datasets"].pop("toy")
    config["stages"]["upper"]["datasets"] = ["toy2"]
    write_config(toy_workdir, config)
    status = run_cli(toy_workdir, "status").stdout
    assert ("note: results/upper/toy/: of no stage or dataset in the config (removed or renamed?); snakemake neither "
            "reads nor removes it: rm -r when no longer needed\n") in status, status
    config["stages"]["shout"] = config["stages"].pop("upper")
    write_config(toy_workdir, config)
    assert "note: results/upper/: of no stage" in run_cli(toy_workdir, "status").stdout


def test_editing_a_module_of_the_project_that_the_runner_imports_reruns_the_stage_naming_it(toy_workdir):
    """A module of the project's, imported by the stage's module (here in a function body, from a package), counts
    in the code fingerprint (a researcher's trial: a model moved into its own module was edited, and nothing
    retrained); its comments do not, nor do installed packages (snakeshard, which toy.py imports, is not listed)."""
    (toy_workdir / "toyext").mkdir()
    (toy_workdir / "toyext/__init__.py").write_text("")
    helper = toy_workdir / "toyext/shout.py"
    helper.write_text("def shout(text):\n    return text.upper()\n")
    module = toy_workdir / "toy.py"
    module.write_text(module.read_text() + "\n\ndef _shout():\n    from toyext.shout import shout\n    return shout\n")
    assert run_snakemake(toy_workdir).returncode == 0
    helper.write_text("# a comment\ndef shout(text):  # upper case\n    return text.upper()\n")
    assert "summary: 4 done" in run_cli(toy_workdir, "status").stdout
    helper.write_text("def shout(text):\n    return text.upper() + '!'\n")
    status = run_cli(toy_workdir, "status").stdout
    assert re.search(r"split\.0 +stale +10 items +changed since it ran: the stage: code\.provider: toyext/shout\.py "
                     r"\(a module of the project that it imports\); code\.runner: toyext/shout\.py \(a module of "
                     r"the project that it imports\)\n", status), status
    dry = run_snakemake(toy_workdir, "-n")
    assert dry.returncode == 0 and re.search(r"^shard_upper +4$", dry.stdout, re.M), dry.stdout


def test_status_names_what_in_the_stage_changed_since_a_shard_ran(toy_workdir):
    """A stale shard's line names the stage's change, as a refused training resume does (a user trial: it said
    "the stage's config, model files or code" whatever changed): a provider_config value with both values, an
    edit of the stage's module by the digest that moved."""
    assert run_snakemake(toy_workdir).returncode == 0
    set_stage(toy_workdir, provider_config={"suffix": "!"})
    status = run_cli(toy_workdir, "status").stdout
    assert re.search(r"split\.0 +stale +10 items +changed since it ran: the stage: provider_config\.suffix: "
                     r"\(unset\) -> '!'\n", status), status
    set_stage(toy_workdir, provider_config={})
    assert "summary: 4 done" in run_cli(toy_workdir, "status").stdout
    module = toy_workdir / "toy.py"
    module.write_text(module.read_text() + "\nEXTRA = 1\n")
    status = run_cli(toy_workdir, "status").stdout
    assert re.search(r"split\.3 +stale +10 items +changed since it ran: the stage: code\.provider \(its source "
                     r"code\); code\.runner \(its source code\)\n", status), status


# -- a dead driver's lock: said so, with the command that clears it --

LOCK_NOTE = ("snakeshard: note: .snakemake/locks holds a lock from an earlier snakemake run, and no snakemake runs in "
             "this directory on this machine (a driver killed with kill -9 leaves its lock). If snakemake stops below "
             "with a LockException and none runs here on another machine either, clear the lock, then run again:")
UNLOCK = "    snakemake --profile config/profiles/local --unlock"


def test_lock_of_a_killed_driver_is_named_with_the_command_that_clears_it(toy_workdir):
    """A run beside a live driver stops on Snakemake's LockException alone; after kill -9 of the driver, the next
    run (plain, and wrapped in `timeout`, its parent) prints that no snakemake runs here and the unlock command,
    before Snakemake's LockException (before: the LockException alone). The printed command clears it."""
    # 0.6 s an item, 4 shards of 10 on 2 cores: ~12 s of work, so the driver is still running when it is killed even
    # when the run beside it starts slowly (with 0.3 s, a loaded machine once saw the driver finish first)
    set_stage(toy_workdir, provider_config={"item_delay": 0.6})
    driver = subprocess.Popen([sys.executable, "-m", "snakemake", "--profile", "config/profiles/local", "--cores", "2"],
                              cwd=toy_workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: shard_process(toy_workdir, 0), 60, "shard 0 to start")
        beside = run_snakemake(toy_workdir)  # the lock is the live driver's
        assert beside.returncode != 0 and "LockException" in beside.stderr
        assert ".snakemake/locks holds" not in beside.stderr
        assert driver.poll() is None, "the driver finished before it could be killed: give the stage more work"
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()

    running = [n for n in range(4) if shard_process(toy_workdir, n)]  # orphans now: they finish their shards
    wait_for(lambda: not any(shard_process(toy_workdir, n) for n in range(4)), 60, "orphaned shards to end")
    status = run_cli(toy_workdir, "status").stdout.splitlines()  # a trial: it said nothing of the lock
    assert status[-1] == ("note: .snakemake/locks holds a lock from an earlier snakemake run, and no snakemake runs "
                          "in this directory on this machine (a driver killed with kill -9 leaves its lock): the next "
                          "run stops with Snakemake's LockException. If none runs here on another machine either: "
                          f"{UNLOCK.strip()}"), status
    for wrapper in ([], ["timeout", "120"]):
        locked = subprocess.run([*wrapper, sys.executable, "-m", "snakemake", "--profile", "config/profiles/local",
                                 "--cores", "2"], cwd=toy_workdir, capture_output=True, text=True, timeout=300)
        assert locked.returncode != 0
        lines = locked.stderr.splitlines()
        assert lines[lines.index(LOCK_NOTE) + 1] == UNLOCK, locked.stderr
        assert locked.stderr.index(UNLOCK) < locked.stderr.index("Error: Directory cannot be locked")

    unlock = subprocess.run([sys.executable, "-m", *shlex.split(UNLOCK)], cwd=toy_workdir, capture_output=True,
                            text=True, timeout=300)
    assert unlock.returncode == 0, unlock.stderr[-2000:]
    assert LOCK_NOTE not in unlock.stderr  # the unlocking run itself says nothing of it
    assert "note: .snakemake/locks" not in run_cli(toy_workdir, "status").stdout

    # docs/failures-and-reruns.md: the shards the orphans finished are kept by clearing Snakemake's marks (it marked
    # them incomplete when their jobs started). Snakemake 9.27 says it failed for a file whose only record is that
    # mark, and removes the mark: when this changes, the docs' paragraph is to be rewritten.
    finished = [n for n in range(4) if (toy_workdir / TOY / f"split.{n}/done").exists()]
    assert set(running) & set(finished), f"no orphan finished a shard (running {running}, done {finished})"
    done_bytes = {n: (toy_workdir / TOY / f"split.{n}/done").read_bytes() for n in finished}
    cleanup = run_snakemake(toy_workdir, "--cleanup-metadata", *(f"{TOY}/split.{n}/done" for n in finished))
    assert cleanup.returncode == 1 and "because the metadata was not present" in cleanup.stderr, cleanup.stderr
    rerun = run_snakemake(toy_workdir)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert LOCK_NOTE not in rerun.stderr
    rerun_shards = sorted(int(n) for n in re.findall(r"wildcards: dataset=toy, shard=(\d+)", rerun.stderr))
    assert rerun_shards == sorted(set(range(4)) - set(finished)), rerun.stderr[-3000:]
    assert all((toy_workdir / TOY / f"split.{n}/done").read_bytes() == kept for n, kept in done_bytes.items())
    assert (toy_workdir / TOY / "text").read_text().splitlines() == [f"utt{i:03d} UTT{i:03d}" for i in range(40)]


def test_ctrl_c_of_a_run_is_named_by_status_and_the_next_run_finishes_it(toy_workdir):
    """Ctrl-C in the terminal (SIGINT to the driver and its jobs, one process group): the interrupted shards are
    `incomplete ... interrupted (SIGINT, Ctrl-C)` in `snakeshard status` (was "running now, or killed", while their
    logs said interrupted: a user trial), no lock is left, and the next run finishes what was not done."""
    set_stage(toy_workdir, provider_config={"item_delay": 0.6})
    # SIGINT as a terminal leaves it: a suite started in the background of a non-interactive shell (as `cmd &`)
    # inherits it ignored, and so would the driver and its jobs, which then finish as if no Ctrl-C came
    driver = subprocess.Popen([sys.executable, "-m", "snakemake", "--profile", "config/profiles/local", "--cores", "2"],
                              cwd=toy_workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(lambda: shard_process(toy_workdir, 0), 60, "shard 0 to start")
        time.sleep(1)  # a few of its items done
        assert driver.poll() is None, "the driver finished before Ctrl-C: give the stage more work"
        os.killpg(driver.pid, signal.SIGINT)
        driver.wait(timeout=120)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert driver.returncode != 0
    status = run_cli(toy_workdir, "status").stdout
    assert re.search(r"split\.0\s+incomplete\s+10 items\s+interrupted \(SIGINT, Ctrl-C\): the next run runs it again",
                     status), status
    assert not list((toy_workdir / ".snakemake/locks").glob("*"))
    rerun = run_snakemake(toy_workdir)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "summary: 4 done" in run_cli(toy_workdir, "status").stdout


def test_a_shard_job_stopped_by_sigterm_says_so_in_its_log_and_status_and_the_next_run_finishes_it(toy_workdir):
    """SIGTERM to one shard job (a kill; on SLURM, scancel or the time limit: test_slurm): its log ends with one line
    saying it was stopped, when, and by what it may have been (a Kaldi user's trial saw an empty log and status said
    pending), exit 143; status calls it incomplete with that line; no done is left, and the next run finishes it."""
    set_stage(toy_workdir, provider_config={"item_delay": 0.6})
    driver = subprocess.Popen([sys.executable, "-m", "snakemake", "--profile", "config/profiles/local", "--cores", "2"],
                              cwd=toy_workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        job = wait_for(lambda: shard_process(toy_workdir, 0), 60, "shard 0 to start")
        time.sleep(1.5)  # a few of its items done
        job.send_signal(signal.SIGTERM)
        out, _ = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode != 0 and "exit status 143" in out, out[-3000:]
    assert not (toy_workdir / TOY / "split.0/done").exists()
    log = (toy_workdir / "results/upper/toy/logs/split.0.log").read_text().splitlines()
    assert re.fullmatch(r"shard 0: started \S+ \S+ \S+ on \S+, pid \d+", log[0]), log[0]
    assert re.fullmatch(r"snakeshard: run-shard: stopped by SIGTERM at \S+ \S+ \S+ \(a kill, or the scheduler that "
                        r"started it\); rerun to go on", log[-1]), log
    assert "Traceback" not in "\n".join(log)
    status = run_cli(toy_workdir, "status").stdout
    assert re.search(r"split\.0\s+incomplete\s+10 items\s+stopped by SIGTERM at [^;]+ \(a kill, or the scheduler that "
                     r"started it\): the next run runs it again$", status, re.M), status
    rerun = run_snakemake(toy_workdir)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "summary: 4 done" in run_cli(toy_workdir, "status").stdout
    assert (toy_workdir / TOY / "text").read_text().splitlines() == [f"utt{i:03d} UTT{i:03d}" for i in range(40)]


def test_status_of_a_shard_whose_slurm_job_was_killed_names_the_job_and_its_slurm_log(tmp_path, monkeypatch):
    """A SLURM job killed without a word (out of memory: SIGKILL) leaves a log of one line, which names its SLURM
    job (test_slurm checks that line on a live cluster); status points at sacct and the plugin's log of that job
    (a user trial found the cause only by opening .snakemake/slurm_logs by hand)."""
    from snakeshard.core.shard import ATTEMPT_FILE
    from snakeshard.workflow.status import shard_state

    monkeypatch.chdir(tmp_path)
    shard_dir = tmp_path / "results/upper/toy/split.1"
    shard_dir.mkdir(parents=True)
    (shard_dir / ATTEMPT_FILE).write_text("")
    log = tmp_path / "results/upper/toy/logs/split.1.log"
    log.parent.mkdir()
    log.write_text("shard 1: started 2026-11-28 00:40:01 +0000 on node7, pid 4242, SLURM job 382\n")
    slurm_log = Path(".snakemake/slurm_logs/rule_shard_upper/toy_1/382.log")
    slurm_log.parent.mkdir(parents=True)
    slurm_log.write_text("slurmstepd: error: Detected 1 oom_kill event\n")
    state, detail = shard_state(shard_dir, log, {"fingerprint": "x"}, 1, ["wav.scp"])
    assert (state, detail) == ("incomplete", "started in SLURM job 382, no done and no error line: still running, "
                               "or killed (out of memory, its time limit): `sacct -j 382 -o State,MaxRSS,Elapsed` "
                               f"says which; its SLURM log: {slurm_log}")
    log.write_text("shard 1: started 2026-11-28 00:40:01 +0000 on vm, pid 4242\n")  # not on SLURM: as before
    assert shard_state(shard_dir, log, {"fingerprint": "x"}, 1, ["wav.scp"])[1].startswith("started, no done, and no "
                                                                                            "attempt holds it here")


def test_the_commands_status_prints_use_the_profile_of_the_last_run(tmp_path, monkeypatch):
    """A SLURM user was told `snakemake --profile profiles/local --unlock` (a user trial): the newest Snakemake
    log's header names the profile the project runs with."""
    from snakeshard.workflow.status import snakemake_command

    monkeypatch.chdir(tmp_path)
    for profile in ("profiles/local", "profiles/slurm"):
        Path(profile).mkdir(parents=True)
        Path(profile, "config.yaml").write_text("")
    assert snakemake_command() == "snakemake --profile profiles/local"  # no run yet
    Path(".snakemake/log").mkdir(parents=True)
    header = "\nSNAKEMAKE\n=========\n  Date: 2026-11-28\n  Command: /venv/bin/snakemake --profile {} -n\n"
    Path(".snakemake/log/2026-11-28T004400.721962.snakemake.log").write_text(header.format("profiles/slurm"))
    Path(".snakemake/log/2026-11-27T235045.002243.snakemake.log").write_text(header.format("profiles/local"))
    assert snakemake_command() == "snakemake --profile profiles/slurm"
    Path(".snakemake/log/2026-11-28T010000.000000.snakemake.log").write_text(header.format("gone/profile"))
    assert snakemake_command() == "snakemake --profile profiles/local"  # a profile that is not here


def test_a_misspelt_fingerprint_ignore_key_is_noted_once_by_the_driver(toy_workdir):
    """A fingerprint_ignore key absent from provider_config next to one close to it (a user trial's `fail_key` for
    `fail_keys`): one note, since the key meant still reruns every shard; an absent key with nothing close: none."""
    set_stage(toy_workdir, provider_config={"fail_on_keys": []}, fingerprint_ignore=["fail_on_key"])
    dry = run_snakemake(toy_workdir, "-n")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert dry.stderr.count("snakeshard: note: stages.upper.fingerprint_ignore: 'fail_on_key' is not in its "
                            "provider_config, which has 'fail_on_keys': a change of 'fail_on_keys' still reruns every "
                            "shard") == 1
    set_stage(toy_workdir, provider_config={}, fingerprint_ignore=["fail_on_keys"])
    dry = run_snakemake(toy_workdir, "-n")
    assert dry.returncode == 0 and "fingerprint_ignore" not in dry.stderr


def test_lock_note_names_the_runs_profile_and_says_nothing_beside_a_live_snakemake(tmp_path, monkeypatch):
    """The note in-process: the profile as the run was given it (quoted for the shell), else $SNAKEMAKE_PROFILE,
    else none; nothing without lock files, for an --unlock run, or while a snakemake process has the directory as
    its working directory (here a stand-in whose command line is `python -c ... -m snakemake`)."""
    from snakeshard.workflow.run_lock import stale_lock_note

    monkeypatch.delenv("SNAKEMAKE_PROFILE", raising=False)
    assert stale_lock_note(str(tmp_path), [], os.getpid()) is None  # no .snakemake/locks
    (tmp_path / ".snakemake/locks").mkdir(parents=True)
    (tmp_path / ".snakemake/locks/0.input.lock").write_text("results/upper/toy/merged.json\n")
    note = stale_lock_note(str(tmp_path), ["--profile=profiles/my slurm", "-n"], os.getpid())
    assert note.splitlines() == [LOCK_NOTE, "    snakemake --profile 'profiles/my slurm' --unlock"]
    assert stale_lock_note(str(tmp_path), [], os.getpid()).splitlines()[1] == "    snakemake --unlock"
    monkeypatch.setenv("SNAKEMAKE_PROFILE", "slurm")
    assert stale_lock_note(str(tmp_path), [], os.getpid()).splitlines()[1] == "    snakemake --profile slurm --unlock"
    assert stale_lock_note(str(tmp_path), ["--profile", "x", "--unlock"], os.getpid()) is None
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "snakemake"], cwd=tmp_path)
    try:  # until it has exec'd, /proc shows the forked pytest's command line (a loaded machine showed it)
        wait_for(lambda: b"snakemake" in Path(f"/proc/{live.pid}/cmdline").read_bytes(), 30, "the process's exec")
        assert stale_lock_note(str(tmp_path), [], os.getpid()) is None
    finally:
        live.kill()
        live.wait()
    assert stale_lock_note(str(tmp_path), [], os.getpid()) is not None


# -- merged scp files work from any directory --

ARK_MODULE = '''
import kaldiio
import numpy as np

from snakeshard import BaseRunner, EnvironmentProvider


class Provider(EnvironmentProvider):
    def build_env_local(self):
        return {}


class ArkRunner(BaseRunner):
    """Writes feats.ark/feats.scp with kaldiio, paths relative to the working directory (as Kaldi does)."""

    @staticmethod
    def forward(key):
        return {"feats": np.full((3, 2), int(key[3:]), dtype=np.float32)}

    @staticmethod
    def open_writers(shard_dir, **env):
        return kaldiio.WriteHelper(f"ark,scp:{shard_dir}/feats.ark,{shard_dir}/feats.scp")

    @staticmethod
    def write_record(writers, result, state, **env):
        writers(result["key"], result["feats"])

    @staticmethod
    def close_writers(writers, state, **env):
        writers.close()
        return ["feats.scp"]
'''


def test_merged_scp_loads_from_another_working_directory(toy_workdir, tmp_path):
    (toy_workdir / "arks.py").write_text(ARK_MODULE)
    set_stage(toy_workdir, runner="arks.ArkRunner", provider="arks.Provider")
    run = run_snakemake(toy_workdir)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (toy_workdir / TOY / "split.0/feats.scp").read_text().startswith(f"utt000 {TOY}/split.0/feats.ark:")
    lines = (toy_workdir / TOY / "feats.scp").read_text().splitlines()
    assert len(lines) == 40 and all(line.split()[1].startswith(f"{toy_workdir}/{TOY}/split.") for line in lines)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = ("import kaldiio, sys; d = kaldiio.load_scp(sys.argv[1]); "
            "print(len(d), float(d['utt007'].sum()), d['utt039'].shape)")
    proc = subprocess.run([sys.executable, "-c", code, str(toy_workdir / TOY / "feats.scp")], cwd=elsewhere,
                          capture_output=True, text=True)
    assert proc.stdout.split("\n")[0] == f"40 {float(np.full((3, 2), 7).sum())} (3, 2)", proc.stderr


# -- the canary --

NO_STATIC = '''
from snakeshard import BaseRunner


class Runner(BaseRunner):
    def forward(self, key):
        return {"text": key}
'''


def test_forward_without_staticmethod_fails_at_parse(toy_workdir):
    (toy_workdir / "nostatic.py").write_text(NO_STATIC)
    set_stage(toy_workdir, runner="nostatic.Runner")
    dry = run_snakemake(toy_workdir, "-n")
    assert dry.returncode != 0
    assert ("stages.upper.runner: nostatic.Runner.forward (" + str(toy_workdir / "nostatic.py") + ":6) must be a "
            "@staticmethod") in dry.stdout + dry.stderr
    assert not (toy_workdir / TOY).exists() or not list((toy_workdir / TOY).glob("split.*/.attempt"))


MISSING_ENV = '''
from snakeshard import BaseRunner, EnvironmentProvider


class Provider(EnvironmentProvider):
    def build_env_local(self):
        return {"model": "m"}


class Runner(BaseRunner):
    @staticmethod
    def forward(key, *, model, tokenizer):
        return {"text": key}


class NoModelProvider(EnvironmentProvider):
    def build_env_local(self):
        raise FileNotFoundError("model.bin is not there")


class ListRunner(BaseRunner):
    @staticmethod
    def forward(key, *, model):
        return {"text": {key, model}}
'''


@pytest.mark.parametrize("runner, message", [
    ("Runner", "Runner.forward needs env key 'tokenizer', but the provider gave only ['model']"),
    ("ListRunner", "field 'text' is a set; the default writers take str/int/float/bool, numpy arrays"),
])
def test_broken_stage_fails_in_its_canary_and_no_shard_job_starts(toy_workdir, runner, message):
    (toy_workdir / "broken.py").write_text(MISSING_ENV)
    set_stage(toy_workdir, runner=f"broken.{runner}", provider="broken.Provider", canary=2)
    assert run_snakemake(toy_workdir, "-n").returncode == 0  # not visible in the source: the canary's job
    run = run_snakemake(toy_workdir)
    assert run.returncode != 0
    assert executed(run, r"\w+") == ["canary_upper"]  # one job ran; no shard job was started
    assert not list((toy_workdir / TOY).glob("split.*/.attempt"))
    log = (toy_workdir / "results/upper/logs/canary.log").read_text()
    assert "snakeshard: error: canary of stage 'upper' failed, so none of its shard jobs was started" in log
    assert message in log
    assert "results/upper/logs/canary.log" in run.stderr  # snakemake points at the one log to read


@pytest.mark.parametrize("args", [(), ("--config", "output_dir=results")], ids=["plain", "other-config"])
def test_canary_is_on_by_default_so_a_wrong_env_name_fails_once_locally(toy_workdir, args):
    """The local profile, no canary in the config: a provider lacking an env name fails the canary alone, not
    each of the 4 shard jobs (before: canary off by default, 4 identical failures). A `--config` on the command
    line (it replaces a profile's `config:` list) leaves it on: the default is the workflow's, not a profile's."""
    (toy_workdir / "broken.py").write_text(MISSING_ENV)
    set_stage(toy_workdir, runner="broken.Runner", provider="broken.Provider")
    run = run_snakemake(toy_workdir, *args)
    assert run.returncode != 0
    assert executed(run, r"\w+") == ["canary_upper"]
    assert "needs env key 'tokenizer'" in (toy_workdir / "results/upper/logs/canary.log").read_text()
    assert not list((toy_workdir / TOY).glob("logs/split.*.log"))


def test_status_shows_a_failed_canary_with_its_error_line_and_log(toy_workdir):
    """`snakeshard status` after a failed canary (local, `--config canary=2`): one line under the stage with the
    log's path and its error line (before: `split.N pending` and `merged: no`, the cause only in the log). Not
    shown for the log of an earlier fingerprint (the stage fixed, not rerun yet) nor once the canary is done."""
    (toy_workdir / "broken.py").write_text(MISSING_ENV)
    set_stage(toy_workdir, runner="broken.Runner", provider="broken.Provider")
    assert "canary:" not in run_cli(toy_workdir, "status").stdout  # not run yet
    run = run_snakemake(toy_workdir, "--config", "canary=2")
    assert run.returncode != 0 and executed(run, r"\w+") == ["canary_upper"]
    status = run_cli(toy_workdir, "status")
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[:2] == [
        "stage upper, dataset toy: 4 shards",
        "  canary: failed (log results/upper/logs/canary.log): snakeshard: error: canary of stage 'upper' failed, so "
        "none of its shard jobs was started; fix the stage, then rerun: broken.Runner.forward needs env key "
        "'tokenizer', but the provider gave only ['model']"], status.stdout
    assert lines[2].split()[:2] == ["split.0", "pending"] and lines[-2:] == ["  merged: no", "summary: 4 pending"]

    (toy_workdir / "broken.py").write_text(MISSING_ENV.replace('{"model": "m"}', '{"model": "m", "tokenizer": "t"}'))
    assert "canary:" not in run_cli(toy_workdir, "status").stdout  # the log is the old fingerprint's canary's
    fixed = run_snakemake(toy_workdir, "--config", "canary=2")
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    status = run_cli(toy_workdir, "status").stdout
    assert "canary:" not in status and "summary: 4 done" in status, status


def test_a_canary_failing_after_the_set_was_merged_is_not_told_once_nothing_is_left_to_run(toy_workdir):
    """Everything done and merged, then the canary forced to run with an option its fingerprint ignores that
    makes it fail, then the option removed: nothing is left to run (`snakemake -n`), so status does not tell of
    the failed canary (it did, asking to "fix the stage, then rerun", and a rerun did nothing)."""
    assert run_snakemake(toy_workdir).returncode == 0
    set_stage(toy_workdir, provider_config={"fail_on_keys": [f"utt{i:03d}" for i in range(40)]},
              fingerprint_ignore=["fail_on_keys"])
    forced = run_snakemake(toy_workdir, "--forcerun", "canary_upper", "--until", "canary_upper")
    assert forced.returncode != 0 and executed(forced, r"\w+") == ["canary_upper"], forced.stderr[-3000:]
    assert "asked to fail on utt000" in (toy_workdir / "results/upper/logs/canary.log").read_text()
    set_stage(toy_workdir, provider_config={})
    dry = run_snakemake(toy_workdir, "-n")
    assert "Nothing to be done" in dry.stdout + dry.stderr, dry.stderr[-3000:]
    status = run_cli(toy_workdir, "status").stdout
    assert "canary:" not in status and "  merged: yes, current" in status.splitlines(), status


def test_provider_failing_to_build_fails_the_canary_naming_the_error(toy_workdir):
    """A provider that raises while building its env: the canary fails with the provider's error, no shard starts."""
    (toy_workdir / "broken.py").write_text(MISSING_ENV)
    set_stage(toy_workdir, runner="broken.ListRunner", provider="broken.NoModelProvider", canary=2)
    run = run_snakemake(toy_workdir)
    assert run.returncode != 0 and executed(run, r"\w+") == ["canary_upper"]
    log = (toy_workdir / "results/upper/logs/canary.log").read_text()
    line = ("snakeshard: error: canary of stage 'upper' failed, so none of its shard jobs was started; fix the "
            "stage, then rerun: shard canary (log: results/upper/logs/canary.log): the provider "
            "broken.NoModelProvider failed to build the env: FileNotFoundError: model.bin is not there")
    assert line in log
    assert line in run.stderr  # echoed to Snakemake's own output too
    assert "Traceback" in log  # the provider's own traceback, above the one-line error


def test_canary_runs_first_and_toggling_it_reruns_nothing(toy_workdir):
    """canary: 2 runs 2 keys before the 4 shards; turning it off or on again reruns no shard;
    a changed stage runs the canary and then every shard again."""
    set_stage(toy_workdir, canary=2)
    run = run_snakemake(toy_workdir, "--cores", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert executed(run, r"(?:canary|shard)_\w+") == ["canary_upper"] + ["shard_upper"] * 4
    done, = (toy_workdir / "results/upper/_canary").glob("*/done")
    assert json.loads(done.read_text())["items"] == 2
    assert (done.parent / "keys").read_text() == "utt000\nutt001\n"

    for canary in (0, 3):
        set_stage(toy_workdir, canary=canary)
        again = run_snakemake(toy_workdir)
        assert again.returncode == 0 and executed(again, r"\w+") == [], again.stdout[-2000:]

    set_stage(toy_workdir, provider_config={"suffix": "!"})
    changed = run_snakemake(toy_workdir, "--cores", "1")
    assert changed.returncode == 0, changed.stderr[-3000:]
    assert executed(changed, r"(?:canary|shard)_\w+") == ["canary_upper"] + ["shard_upper"] * 4
    canaries = [p.name for p in (toy_workdir / "results/upper/_canary").iterdir()]
    assert len(canaries) == 1 and canaries != [done.parent.name]  # the old fingerprint's canary is gone
    assert (toy_workdir / TOY / "text").read_text().splitlines()[0] == "utt000 UTT000!"


def test_canary_off_builds_nothing(toy_workdir):
    """With canary: 0 the canary job writes its done without importing the provider's model."""
    set_stage(toy_workdir, provider_config={"allocate_mb": 1}, canary=0)
    run = run_snakemake(toy_workdir)
    assert run.returncode == 0
    done, = (toy_workdir / "results/upper/_canary").glob("*/done")
    assert json.loads(done.read_text())["canary"] == "off"
    assert executed(run, "canary_upper") == ["canary_upper"]


# -- snakeshard init --

def test_init_with_own_data_and_refusals(tmp_path):
    """--data: a Kaldi dir outside the project is stored absolute and planned; a second init, missing data
    and a file that is not a dataset are refused, naming what to fix."""
    data = make_kaldi_dir(tmp_path / "corpora/my-set", ["a1", "a2", "a3"],
                          Path(__file__).resolve().parents[1] / "data/demo/wav/cards-001.wav")
    project = tmp_path / "proj"
    init = subprocess.run([CONSOLE_SCRIPT, "init", str(project), "--data", str(data)], capture_output=True, text=True)
    assert init.returncode == 0, init.stderr
    config = read_config(project)
    assert config["datasets"] == {"my-set": {"path": str(data), "format": "kaldi"}}
    assert not (project / "data").exists()  # no demo copy when the user brings data
    plan = subprocess.run([CONSOLE_SCRIPT, "plan"], cwd=project, capture_output=True, text=True)
    assert config["stages"]["energy"]["sharding"] == {"shard_size": 1000}  # needs no durations; stable on append
    assert plan.returncode == 0 and "(1 shard)" in plan.stdout and "a1 .. a3" in plan.stdout, plan.stderr

    again = subprocess.run([CONSOLE_SCRIPT, "init", str(project)], capture_output=True, text=True)
    assert again.returncode == 1
    assert f"snakeshard: error: {project} already has Snakefile, config/config.yaml, my_stage.py" in again.stderr
    missing = subprocess.run([CONSOLE_SCRIPT, "init", str(tmp_path / "p2"), "--data", "nope"], cwd=tmp_path,
                             capture_output=True, text=True)
    assert missing.returncode == 1 and f"--data nope: does not exist (relative to {tmp_path})" in missing.stderr
    (tmp_path / "notes.txt").write_text("x")
    wrong = subprocess.run([CONSOLE_SCRIPT, "init", str(tmp_path / "p3"), "--data", str(tmp_path / "notes.txt")],
                           capture_output=True, text=True)
    assert wrong.returncode == 1 and "give a Kaldi data dir (with wav.scp), a .jsonl manifest or a folder" in wrong.stderr
    assert not (tmp_path / "p2").exists() and not (tmp_path / "p3").exists()  # nothing half-written
    assert init.stderr == ""  # absolute audio paths: nothing to note
    assert f"next: cd {project} && snakemake -n && " in init.stdout
    here = tmp_path / "here"  # `init .` (a user trial: it said `next: cd . && ...`)
    here.mkdir()
    dot = subprocess.run([CONSOLE_SCRIPT, "init", "."], cwd=here, capture_output=True, text=True)
    assert dot.returncode == 0 and "next: snakemake -n && snakemake --profile profiles/local" in dot.stdout, dot.stdout


def test_the_snakefiles_rule_example_names_the_projects_dataset_and_a_set_not_planned_is_one_error_line(tmp_path):
    """init --data names the dataset after the data (my-set): the commented rule example at the end of the
    Snakefile reads its merged output, and runs uncommented. A rule of the user's asking for a set the config does
    not plan (the demo's, here) ends with one line naming the sets it plans: no traceback, no KeyError."""
    data = make_kaldi_dir(tmp_path / "corpora/my-set", ["a1", "a2", "a3"],
                          Path(__file__).resolve().parents[1] / "data/demo/wav/cards-001.wav")
    project = tmp_path / "proj"
    assert subprocess.run([CONSOLE_SCRIPT, "init", str(project), "--data", str(data)]).returncode == 0
    snakefile = (project / "Snakefile").read_text()
    example = snakefile[snakefile.index("# rule loudest:"):]
    assert "results/energy/my-set/merged.json" in example and "demo" not in example
    uncommented = "\n".join(line[2:] for line in example.splitlines()) + "\n"
    (project / "Snakefile").write_text(snakefile + "\n" + uncommented)
    snakemake = [sys.executable, "-m", "snakemake", "--profile", "profiles/local", "--cores", "2"]
    run = subprocess.run([*snakemake, "results/loudest.txt"], cwd=project, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(line.split()[0] for line in (project / "results/loudest.txt").read_text().splitlines()) == [
        "a1", "a2", "a3"]

    (project / "Snakefile").write_text(snakefile + "\n" + uncommented.replace("my-set", "demo"))
    dry = subprocess.run([*snakemake, "-n", "results/loudest.txt"], cwd=project, capture_output=True, text=True)
    assert dry.returncode == 1
    assert ("snakeshard: error: results/energy/demo/merged.json is asked for, but no stage 'energy' runs over a "
            "dataset 'demo': the config plans energy/my-set") in dry.stderr, dry.stderr
    assert "Traceback" not in dry.stderr and "KeyError" not in dry.stderr


def test_init_notes_relative_audio_paths_the_project_cannot_see(tmp_path):
    """A wav.scp written for its parent directory (``corpus/wav/a1.wav`` in ``corpus/my-set``): init writes the
    project and says, before any run fails on it, that snakemake reads those paths from the project dir."""
    wav = Path(__file__).resolve().parents[1] / "data/demo/wav/cards-001.wav"
    (tmp_path / "corpus/wav").mkdir(parents=True)
    for key in ("a1", "a2"):
        (tmp_path / "corpus/wav" / f"{key}.wav").write_bytes(wav.read_bytes())
    data = tmp_path / "corpus/my-set"
    data.mkdir()
    (data / "wav.scp").write_text("a1 corpus/wav/a1.wav\na2 corpus/wav/a2.wav\n")
    init = subprocess.run([CONSOLE_SCRIPT, "init", "proj", "--data", "corpus/my-set"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert init.returncode == 0 and (tmp_path / "proj/Snakefile").is_file(), init.stderr
    assert init.stderr == ("note: corpus/my-set/wav.scp lists relative audio paths (corpus/wav/a1.wav, ...), and "
                           "snakemake reads them from proj, where corpus/wav/a1.wav does not exist: make them "
                           "absolute, or relative to proj\n")
    plan = subprocess.run([CONSOLE_SCRIPT, "plan"], cwd=tmp_path / "proj", capture_output=True, text=True)
    assert plan.returncode == 1 and "2 audio file(s) not found: key 'a1': corpus/wav/a1.wav" in plan.stderr
    assert f"relative audio paths are taken from the working directory {tmp_path / 'proj'}" in plan.stderr

    # the same for a JSON Lines manifest's `audio` (a user trial: no note, then the parse's error)
    (tmp_path / "corpus/set.jsonl").write_text('{"key": "a1", "audio": "corpus/wav/a1.wav"}\n')
    init = subprocess.run([CONSOLE_SCRIPT, "init", "jproj", "--data", "corpus/set.jsonl"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert init.returncode == 0 and init.stderr == (
        "note: corpus/set.jsonl lists relative audio paths (corpus/wav/a1.wav, ...), and snakemake reads them from "
        "jproj, where corpus/wav/a1.wav does not exist: make them absolute, or relative to jproj\n")
    (tmp_path / "corpus/abs.jsonl").write_text(f'{{"key": "a1", "audio": "{tmp_path}/corpus/wav/a1.wav"}}\n')
    init = subprocess.run([CONSOLE_SCRIPT, "init", "aproj", "--data", "corpus/abs.jsonl"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert init.returncode == 0 and init.stderr == ""

    # a manifest whose key and audio are under other names (a user trial: no word from init, then "record has no
    # key field 'key'" from the parse, naming neither the record's fields nor the config key)
    (tmp_path / "corpus/ids.jsonl").write_text(f'{{"id": "a1", "wav": "{tmp_path}/corpus/wav/a1.wav"}}\n')
    init = subprocess.run([CONSOLE_SCRIPT, "init", "iproj", "--data", "corpus/ids.jsonl"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert init.returncode == 0 and init.stderr == (
        "note: corpus/ids.jsonl: its first record has no 'key' or 'audio' field (it has 'id', 'wav'): set key_field, "
        "audio_field under datasets.ids in iproj/config/config.yaml to the field(s) holding them\n")
    plan = subprocess.run([CONSOLE_SCRIPT, "plan"], cwd=tmp_path / "iproj", capture_output=True, text=True)
    assert plan.returncode == 1 and (f"datasets.ids: {tmp_path}/corpus/ids.jsonl:1: record has no key field 'key' "
                                     "(its fields: 'id', 'wav'); the dataset's key_field (and audio_field, "
                                     "duration_field) must name the fields that hold them") in plan.stderr, plan.stderr


# -- `snakeshard plan --stage` with a stage the config does not run as shards --

def test_plan_of_an_unknown_stage_is_refused_naming_the_stages(toy_workdir):
    proc = run_cli(toy_workdir, "plan", "--stage", "nosuch")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == ("snakeshard: error: --stage nosuch: no such stage in config/config.yaml "
                                   "(its stages: upper)")
    proc = run_cli(toy_workdir, "plan", "--stage", "upper")
    assert proc.returncode == 0 and "stage upper, dataset toy:" in proc.stdout
    # the toy's sharding (num_shards) reads no audio header, and its wav.scp has no durations: said, not just "-"
    assert proc.stdout.splitlines()[-2:] == [
        " total       40          -  (4 shards)",
        "seconds -: not read (the dataset gives no durations, and this stage's sharding needs none)"], proc.stdout


def test_a_yaml_mistake_in_the_config_is_named_by_file_line_and_column(tmp_path):
    """A flow mapping left open in an init project's config: `snakemake -n` ends with one `snakeshard: error:` line
    naming file, line and column, from the check the project's Snakefile makes before its `configfile:` (Snakemake's
    own message names no line); `snakeshard status` says the same."""
    project = tmp_path / "proj"
    assert subprocess.run([CONSOLE_SCRIPT, "init", str(project)], capture_output=True).returncode == 0
    config = project / "config/config.yaml"
    lines = config.read_text().splitlines()
    at = next(n for n, line in enumerate(lines) if "provider_config: {floor_db: -80}" in line)
    lines[at] = lines[at].replace("{floor_db: -80}", "{floor_db: -80")
    config.write_text("\n".join(lines) + "\n")
    column = lines[at + 1].index(lines[at + 1].strip()) + 1  # the next key, where PyYAML sees the mapping unclosed
    want = (f"snakeshard: error: config/config.yaml:{at + 2}:{column}: not valid YAML: expected ',' or '}}', but got "
            f"'<scalar>' (while parsing a flow mapping that starts at line {at + 1})")
    dry = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/local", "-n"], cwd=project,
                         capture_output=True, text=True)
    assert dry.returncode == 1
    assert want in dry.stderr.splitlines(), dry.stderr
    assert "Traceback" not in dry.stderr and "WorkflowError" not in dry.stderr
    status = subprocess.run([CONSOLE_SCRIPT, "status"], cwd=project, capture_output=True, text=True)
    assert status.returncode == 1 and want in status.stderr.splitlines(), status.stderr


def test_status_notes_a_top_level_key_that_looks_misspelt_and_leaves_a_projects_own_keys_alone(toy_workdir):
    """status and plan read the config file themselves and leave out top-level keys that are not snakeshard's (a
    project's Snakefile may keep its own there): one close to a key of snakeshard's is noted, as maybe misspelt;
    a project's own key goes without a word (the digits recipe's `fsdd:` was noted at every call: a user trial)."""
    config = read_config(toy_workdir)
    config.update(outptu_dir="elsewhere", corpus_url="file:///corpora/x")
    write_config(toy_workdir, config)
    for command in ("status", "plan"):
        proc = run_cli(toy_workdir, command)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.splitlines() == [
            "note: config/config.yaml: 'outptu_dir' left out: not snakeshard's (did you mean 'output_dir'? a misspelt "
            "key is refused when snakemake parses the config)"], proc.stderr


def test_status_and_plan_read_several_config_files_as_snakemake_configfile_does(toy_workdir):
    """`--config` given twice: the later file overrides the keys it sets, nested ones one by one, as `snakemake
    --configfile` does (a user trial: status of the digits recipe's held-out-speaker run could not be shown:
    `'stages' is a required property`)."""
    (toy_workdir / "config/other.yaml").write_text(
        "output_dir: other\nstages:\n  upper:\n    sharding: {num_shards: 2}\n")
    both = ["--config", "config/config.yaml", "--config", "config/other.yaml"]
    plan = run_cli(toy_workdir, "plan", *both)
    assert plan.returncode == 0, plan.stderr
    assert re.search(r"^ +total +40 +- +\(2 shards\)$", plan.stdout, re.M), plan.stdout
    status = run_cli(toy_workdir, "status", *both)
    assert status.returncode == 0, status.stderr
    assert "stage upper, dataset toy: 2 shards" in status.stdout and "split.2" not in status.stdout, status.stdout
    assert (toy_workdir / "other/upper/toy/split.1/keys").is_file()  # the set lives under the later output_dir
    alone = run_cli(toy_workdir, "status", "--config", "config/other.yaml")  # the override alone is no config
    assert alone.returncode == 1 and "'datasets' is a required property" in alone.stderr, alone.stderr


def test_ctrl_c_during_the_parse_ends_with_one_line_and_exit_130(capsys):
    """Ctrl-C while the Snakefile is parsed (the plan of a big manifest, the digits recipe's data prep): one line
    and exit status 130, not ~30 lines of traceback through snakeshard's code (a user trial)."""
    from snakeshard.workflow.parse import exit_on_user_error

    with pytest.raises(SystemExit) as stop:
        with exit_on_user_error():
            raise KeyboardInterrupt
    assert stop.value.code == 130
    assert capsys.readouterr().err == ("snakeshard: interrupted (Ctrl-C) while snakemake read the workflow; nothing "
                                       "was run: run it again\n")


WHOLE_SHARD_MODULE = '''
from snakeshard import BaseRunner, EnvironmentProvider, load_dataset


class WholeProvider(EnvironmentProvider):
    def build_env_local(self):
        return {"dataset": load_dataset(self.config["dataset"])}


class WholeRunner(BaseRunner):
    """A forward that reads every key its job's dataset holds (a per-speaker mean does)."""
    @staticmethod
    def forward(key, *, dataset):
        return {"text": " ".join(dataset.load_field(k, "text") for k in dataset)}
'''


def test_a_chained_canary_holds_only_its_own_keys_as_a_shard_job_holds_its_shards(toy_workdir):
    """A chained stage's canary listed all of split.0's keys while its upstream (the upstream canary) held only the
    canary's: a forward reading every key of its dataset failed there alone (`no key 'utt002'`: a Kaldi user's
    trial) and worked in the shard jobs. Its dataset now holds its keys only."""
    (toy_workdir / "whole.py").write_text(WHOLE_SHARD_MODULE)
    config = read_config(toy_workdir)
    config["datasets"]["up"] = {"from_stage": "upper", "dataset": "toy"}
    config["stages"]["whole"] = {"runner": "whole.WholeRunner", "provider": "whole.WholeProvider", "datasets": ["up"],
                                 "sharding": {"num_shards": 4}}
    write_config(toy_workdir, config)
    run = run_snakemake(toy_workdir)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = (toy_workdir / "results/whole/up/text").read_text().splitlines()
    # each key: the upper-cased keys of its shard (10 a shard), in order
    assert lines[0] == "utt000 " + " ".join(f"UTT{i:03d}" for i in range(10))
    assert lines[39] == "utt039 " + " ".join(f"UTT{i:03d}" for i in range(30, 40))
    # a shard job's log starts with when, where and which process (run.pl's '# Started at', a trial missed it)
    log = (toy_workdir / "results/whole/up/logs/split.1.log").read_text().splitlines()
    host = re.escape(os.uname().nodename)
    assert re.fullmatch(rf"shard 1: started \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{{4}} on {host}, pid \d+", log[0]), log
    assert re.fullmatch(r"shard 1: 10 items in \d+\.\d\d s", log[-1]), log
