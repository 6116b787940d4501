"""`shards_per_job: K`: one job (one process, one SLURM job) runs K consecutive shards; each shard keeps its
own done, a failed shard does not stop the others, and a rerun redoes only the shards without a current done."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import read_config, run_cli, run_snakemake, write_config
from snakeshard.core.merge import rerun_command

TOY = Path("results/upper/toy")


def set_upper(workdir: Path, **changes) -> None:
    config = read_config(workdir)
    config["stages"]["upper"].update(changes)
    write_config(workdir, config)


def dones(workdir: Path) -> dict[str, bytes]:
    return {p.parent.name: p.read_bytes() for p in sorted((workdir / TOY).glob("split.*/done"))}


def test_grouped_jobs_merge_the_same_bytes_as_one_job_per_shard(toy_workdir):
    """10 shards of the toy stage, 4 per job: the dry run lists 3 shard jobs (0-3, 4-7, 8-9); the run writes
    every shard's done and each job's; the merged text is byte-identical to a run of one job per shard.
    Switching an existing run from 1 to 4 per job reruns no shard."""
    set_upper(toy_workdir, sharding={"num_shards": 10})
    assert run_snakemake(toy_workdir).returncode == 0
    one_per_shard, shards_done = (toy_workdir / TOY / "text").read_bytes(), dones(toy_workdir)

    # Switching to 4 per job recomputes nothing: the new jobs find every shard current.
    set_upper(toy_workdir, sharding={"num_shards": 10}, shards_per_job=4)
    assert run_snakemake(toy_workdir).returncode == 0
    assert "shards 0-3: 4 already done with these inputs, 0 to run" in (toy_workdir / TOY / "logs/shards.0-3.log").read_text()
    assert dones(toy_workdir) == shards_done and (toy_workdir / TOY / "text").read_bytes() == one_per_shard

    shutil.rmtree(toy_workdir / "results")
    set_upper(toy_workdir, sharding={"num_shards": 10}, shards_per_job=4)
    dry = run_snakemake(toy_workdir, "-n")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert re.search(r"^shard_upper\s+3$", dry.stdout, re.M), dry.stdout  # Snakemake's job stats table
    run = run_snakemake(toy_workdir)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in (toy_workdir / TOY / "jobs").iterdir()) == [
        "shards.0-3.done", "shards.4-7.done", "shards.8-9.done"]
    assert len(dones(toy_workdir)) == 10
    assert (toy_workdir / TOY / "text").read_bytes() == one_per_shard
    log = (toy_workdir / TOY / "logs/shards.4-7.log").read_text()
    assert "shards 4-7: 0 already done with these inputs, 4 to run" in log
    assert all(f"shard {n}: 4 items in" in log for n in range(4, 8))


def test_a_failed_shard_leaves_the_others_done_and_the_rerun_runs_only_it(toy_workdir):
    """utt013 (shard 3 of 10, in the job of shards 0-3) raises: the run fails naming the key and the shard;
    shards 0-2 of that job and every other job are done; the job's own done is absent. Once the key is fixed
    (an option outside the fingerprint), the rerun runs that job, which runs shard 3 only: the other shards'
    done files are byte-identical to before, and the merged text has utt013."""
    set_upper(toy_workdir, sharding={"num_shards": 10}, shards_per_job=4,
              provider_config={"fail_on_keys": ["utt013"]}, fingerprint_ignore=["fail_on_keys"])
    first = run_snakemake(toy_workdir)
    out = first.stdout + first.stderr
    assert first.returncode != 0
    assert "shards 0-3: 1 of 4 failed (the others are done and are not rerun): shard 3" in out, out[-3000:]
    assert "item 'utt013' failed: RuntimeError: asked to fail on utt013" in out
    before = dones(toy_workdir)
    assert sorted(before) == sorted(f"split.{n}" for n in range(10) if n != 3)
    assert not (toy_workdir / TOY / "jobs/shards.0-3.done").exists()
    assert (toy_workdir / TOY / "jobs/shards.4-7.done").exists()
    assert not (toy_workdir / TOY / "merged.json").exists()
    status = run_cli(toy_workdir, "status").stdout  # the job's log holds 4 shards: the failed one is told apart
    assert re.search(r"split\.3 +failed", status) and len(re.findall(r"split\.\d+ +done", status)) == 9, status
    assert "item 'utt013' failed" in status and str(TOY / "logs/shards.0-3.log") in status

    set_upper(toy_workdir, provider_config={})
    second = run_snakemake(toy_workdir)
    assert second.returncode == 0, second.stderr[-3000:]
    log = (toy_workdir / TOY / "logs/shards.0-3.log").read_text()
    assert "shards 0-3: 3 already done with these inputs, 1 to run" in log
    after = dones(toy_workdir)
    assert {name: after[name] for name in before} == before  # shards 0-2 and 4-9 were not run again
    assert json.loads(after["split.3"])["items"] == 4
    assert "utt013 UTT013" in (toy_workdir / TOY / "text").read_text().splitlines()


def test_a_changed_shard_reruns_alone_inside_its_job(toy_workdir):
    """A key's wav.scp line changes (its record is in the fingerprint): Snakemake reruns the job holding that
    shard, and the job runs that shard only."""
    set_upper(toy_workdir, sharding={"num_shards": 10}, shards_per_job=4)
    assert run_snakemake(toy_workdir).returncode == 0
    before = dones(toy_workdir)
    scp = toy_workdir / "data/toy/wav.scp"
    scp.write_text(scp.read_text().replace("utt021 data/demo/wav/cards-001.wav", "utt021 ./data/demo/wav/cards-001.wav"))
    run = run_snakemake(toy_workdir)
    assert run.returncode == 0, run.stderr[-3000:]
    after = dones(toy_workdir)
    assert [name for name in after if after[name] != before[name]] == ["split.5"]
    assert "shards 4-7: 3 already done with these inputs, 1 to run" in (toy_workdir / TOY / "logs/shards.4-7.log").read_text()


def test_the_advice_to_rerun_one_shard_of_a_job_works(toy_workdir, monkeypatch):
    """What the merge's errors tell a user to run to recompute one shard (``rerun_command``): for a shard in
    a job of several, remove its done and force its job; run as told, it recomputes that shard only."""
    set_upper(toy_workdir, sharding={"num_shards": 10}, shards_per_job=4)
    assert run_snakemake(toy_workdir).returncode == 0
    before = dones(toy_workdir)
    monkeypatch.chdir(toy_workdir)  # the merge names paths as the workflow does: relative to the working dir
    done = TOY / "split.5/done"
    advice = rerun_command(done)
    assert advice == f"rm -f {done} && snakemake --profile <your profile> --forcerun {TOY}/jobs/shards.4-7.done"
    run = subprocess.run(advice.replace("<your profile>", "config/profiles/local --cores 2"), shell=True,
                         cwd=toy_workdir, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert run.returncode == 0, run.stderr[-3000:]
    after = dones(toy_workdir)
    assert [name for name in after if after[name] != before[name]] == ["split.5"]
    assert (toy_workdir / TOY / "jobs/shards.4-7.done").exists()


def test_auto_groups_one_key_shards_and_merges_the_same_bytes(toy_workdir):
    """40 one-key shards of the toy stage (shard_size: 1). With shards_per_job: 1, 40 jobs; left out (auto, the
    default), 8 jobs of 5 shards (32 items fill a job, but a set keeps 8 jobs), and switching to it reruns no
    shard; from nothing, auto's run merges the same bytes as one job per shard."""
    set_upper(toy_workdir, sharding={"shard_size": 1}, shards_per_job=1)
    dry = run_snakemake(toy_workdir, "-n")
    assert re.search(r"^shard_upper\s+40$", dry.stdout, re.M), dry.stdout
    assert run_snakemake(toy_workdir).returncode == 0
    one_per_shard, shards_done = (toy_workdir / TOY / "text").read_bytes(), dones(toy_workdir)

    config = read_config(toy_workdir)
    del config["stages"]["upper"]["shards_per_job"]
    write_config(toy_workdir, config)
    assert run_snakemake(toy_workdir).returncode == 0
    assert dones(toy_workdir) == shards_done and (toy_workdir / TOY / "text").read_bytes() == one_per_shard
    assert "shards 0-4: 5 already done with these inputs, 0 to run" in (toy_workdir / TOY / "logs/shards.0-4.log").read_text()

    shutil.rmtree(toy_workdir / "results")
    # the grouping shows in snakeshard plan too (a user trial: only snakemake -n's job count told it)
    plan = run_cli(toy_workdir, "plan").stdout.splitlines()
    assert plan[-1] == ("  jobs        8  of 5 consecutive shards each (shards_per_job: auto), run one after the other "
                        "in one process"), plan[-3:]
    dry = run_snakemake(toy_workdir, "-n")
    assert re.search(r"^shard_upper\s+8$", dry.stdout, re.M), dry.stdout
    assert run_snakemake(toy_workdir).returncode == 0
    assert sorted(p.name for p in (toy_workdir / TOY / "jobs").iterdir()) == [
        f"shards.{n}-{n + 4}.done" for n in (0, 10, 15, 20, 25, 30, 35, 5)]
    assert len(dones(toy_workdir)) == 40 and (toy_workdir / TOY / "text").read_bytes() == one_per_shard


def test_a_config_change_after_leaving_grouped_jobs_reruns_every_shard(toy_workdir):
    """A user trial: 4 shards run 2 per job, then `shards_per_job: 1`, then a provider_config change. Snakemake
    had no record of the dones' params (a job of several shards wrote them), so its params trigger never fired:
    `-n` listed the merge alone, which refused the stale shards at every run. Each shard's fingerprint file
    (split.N/.fingerprint, an input of its rule) is newer than its done when the fingerprint changed: all 4 rerun.
    The same with Snakemake's records removed (.snakemake/metadata); a change made and undone before a run reruns
    nothing."""
    set_upper(toy_workdir, shards_per_job=2)
    assert run_snakemake(toy_workdir).returncode == 0
    assert sorted(p.name for p in (toy_workdir / TOY / "jobs").iterdir()) == ["shards.0-1.done", "shards.2-3.done"]
    set_upper(toy_workdir, shards_per_job=1)
    assert run_snakemake(toy_workdir).returncode == 0  # the merge alone: its inputs are the shards' dones now
    # the merge removed the grouped jobs' done files and logs, which nothing makes or reads now (the same trial)
    assert not (toy_workdir / TOY / "jobs").exists() and not list((toy_workdir / TOY / "logs").glob("shards.*"))
    assert "removed 4 done and log file(s) of jobs the current grouping does not make (shards_per_job 1): " \
           "jobs/shards.0-1.done, jobs/shards.2-3.done, logs/shards.0-1.log, logs/shards.2-3.log" in \
           (toy_workdir / TOY / "logs/merge.log").read_text()
    set_upper(toy_workdir, shards_per_job=1, provider_config={"suffix": "!"})
    dry = run_snakemake(toy_workdir, "-n")
    assert re.search(r"^shard_upper\s+4$", dry.stdout, re.M), dry.stdout
    run = run_snakemake(toy_workdir)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (toy_workdir / TOY / "text").read_text().splitlines()[0] == "utt000 UTT000!"
    assert "merged: yes, current" in run_cli(toy_workdir, "status").stdout

    shutil.rmtree(toy_workdir / ".snakemake/metadata")  # as --cleanup-metadata or a removed .snakemake leaves it
    set_upper(toy_workdir, shards_per_job=1, provider_config={"suffix": "?"})
    assert re.search(r"^shard_upper\s+4$", run_snakemake(toy_workdir, "-n").stdout, re.M)
    set_upper(toy_workdir, shards_per_job=1, provider_config={"suffix": "!"})  # undone before any run
    assert "Nothing to be done" in run_snakemake(toy_workdir, "-n").stdout
