"""The workflow on a live single-node SLURM cluster (../shared/tools/local-slurm), through the pinned plugin.

Every snakemake call runs under `timeout -k` with the fast status-check flags. Skipped when no
controller answers (`.ci/run` starts the cluster before the tests and stops it from a trap).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from conftest import keep_only_stage, read_config, run_cli, slurm_cluster_up, slurm_env, write_config
from test_first_contact import MISSING_ENV

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(not slurm_cluster_up(), reason="no SLURM controller answers (start ../shared/tools/local-slurm)"),
]

FAST_STATUS = ["--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "1"]
SUBMITTED = re.compile(r"Job \d+ has been submitted with SLURM jobid (\d+) \(log: (\S+)\)")
TOY = Path("results/upper/toy")


def slurm_command(*args: str, limit: int) -> list[str]:
    return ["timeout", "-k", "10", str(limit), sys.executable, "-m", "snakemake", "--profile", "config/profiles/slurm",
            *FAST_STATUS, *args]


def run_slurm(workdir: Path, *args: str, limit: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(slurm_command(*args, limit=limit), cwd=workdir, capture_output=True, text=True,
                          env=slurm_env())


def submitted(output: str) -> dict[str, str]:
    """SLURM job id -> its SLURM log, for every job the run submitted."""
    return dict(SUBMITTED.findall(output))


def sacct(job_ids) -> list[tuple[str, str, str]]:
    """(job id, state, requested memory) per job, from the accounting database."""
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join(job_ids), "--format=JobID,State,ReqMem"],
                         capture_output=True, text=True, check=True).stdout
    return [tuple(line.split("|")) for line in out.splitlines() if line]


def set_stage(workdir: Path, stage: str, **changes) -> None:
    config = read_config(workdir)
    config["stages"][stage].update(changes)
    write_config(workdir, config)


def cluster_jobs() -> list[str]:
    """Every job on the cluster: id, state, elapsed time, comment (the rule and shard that submitted it)."""
    out = subprocess.run(["squeue", "-h", "-O", "JobID:12,State:14,TimeUsed:12,Comment:80"], capture_output=True,
                         text=True).stdout
    return [" ".join(line.split()) for line in out.splitlines() if line.strip()]


@pytest.fixture(autouse=True)
def an_empty_queue_after_each_test(request):
    """A job a test leaves on the one-node cluster holds its CPUs, and a later test's 2-CPU job then pends until
    its `timeout` (CI once: the digits recipe's training never started, 900 s, with an earlier job still on the
    node). After each test: wait for its jobs to leave, cancel what stays, and name the test that left them in a
    warning (the summary shows it), so that the next test runs on a free node whatever the cause."""
    yield
    deadline = time.time() + 60
    while (left := cluster_jobs()) and time.time() < deadline:
        time.sleep(1)
    if left:
        subprocess.run(["scancel", *(job.split()[0] for job in left)], check=False)
        warnings.warn(f"{request.node.name} left {len(left)} job(s) on the cluster, cancelled after it: "
                      + "; ".join(left))


def test_demo_through_slurm_is_byte_identical_to_local(workdir, clean_demo_text):
    """The demo pipeline submitted as SLURM jobs: the canary (on in the SLURM profile), then 2 shard jobs;
    the merged text equals the local run's bytes."""
    write_config(workdir, keep_only_stage(read_config(workdir), "asr"))
    run = run_slurm(workdir)
    assert run.returncode == 0, run.stderr[-3000:]
    logs = list(submitted(run.stdout + run.stderr).values())  # plan and merge stay local
    assert len(logs) == 3 and "/rule_canary_asr/" in logs[0] and all("/rule_shard_asr/" in log for log in logs[1:])
    assert (workdir / "results/asr/demo/text").read_bytes() == clean_demo_text


def test_failing_shard_reports_job_id_and_logs_and_rerun_submits_one_job(toy_workdir):
    """A shard that raises on one key: its SLURM job id and both logs are reported; the rerun submits exactly one job."""
    set_stage(toy_workdir, "upper", provider_config={"fail_on_keys": ["utt013"]}, fingerprint_ignore=["fail_on_keys"])
    first = run_slurm(toy_workdir)
    out = first.stdout + first.stderr
    assert first.returncode != 0
    jobs = submitted(out)
    assert len(jobs) == 5  # the canary (first 2 keys pass) and 4 shards
    failed = re.search(r"SLURM-job '(\d+)' failed, SLURM status is: 'FAILED'", out)
    assert failed, out[-3000:]
    assert "toy_1/" in jobs[failed.group(1)]  # the failed job is shard 1's, and its SLURM log is named
    assert jobs[failed.group(1)] in out and str(TOY / "logs/split.1.log") in out
    assert "item 'utt013' failed" in (toy_workdir / TOY / "logs/split.1.log").read_text()
    assert sorted(p.parent.name for p in (toy_workdir / TOY).glob("split.*/done")) == ["split.0", "split.2", "split.3"]

    set_stage(toy_workdir, "upper", provider_config={})
    second = run_slurm(toy_workdir)
    assert second.returncode == 0, second.stderr[-3000:]
    assert len(submitted(second.stdout + second.stderr)) == 1
    assert (toy_workdir / TOY / "text").read_text().splitlines()[13] == "utt013 UTT013"


def test_shards_sharing_a_slurm_job_fail_and_rerun_one_by_one(toy_workdir):
    """shards_per_job 2 over the toy stage's 4 shards: 2 SLURM shard jobs and the canary. utt013 (shard 1,
    in the job of shards 0-1) raises: the run fails, the job's log names the key and shard; shard 0 of the
    same job is done. The rerun submits that one job, which runs shard 1 only (shard 0's done is untouched)."""
    set_stage(toy_workdir, "upper", shards_per_job=2, provider_config={"fail_on_keys": ["utt013"]},
              fingerprint_ignore=["fail_on_keys"])
    first = run_slurm(toy_workdir)
    out = first.stdout + first.stderr
    assert first.returncode != 0
    jobs = submitted(out)
    assert len(jobs) == 3, out[-3000:]  # the canary and 2 jobs of 2 shards
    assert str(TOY / "logs/shards.0-1.log") in out
    log = (toy_workdir / TOY / "logs/shards.0-1.log").read_text()
    assert "shard 1 (log: results/upper/toy/logs/shards.0-1.log): item 'utt013' failed" in log
    assert "shards 0-1: 1 of 2 failed (the others are done and are not rerun): shard 1" in log
    assert sorted(p.parent.name for p in (toy_workdir / TOY).glob("split.*/done")) == ["split.0", "split.2", "split.3"]
    shard0 = (toy_workdir / TOY / "split.0/done").read_bytes()

    set_stage(toy_workdir, "upper", provider_config={})
    second = run_slurm(toy_workdir)
    assert second.returncode == 0, second.stderr[-3000:]
    assert len(submitted(second.stdout + second.stderr)) == 1
    assert "shards 0-1: 1 already done with these inputs, 1 to run" in (toy_workdir / TOY / "logs/shards.0-1.log").read_text()
    assert (toy_workdir / TOY / "split.0/done").read_bytes() == shard0
    assert (toy_workdir / TOY / "text").read_text().splitlines()[13] == "utt013 UTT013"


def test_scancel_of_a_running_shard_is_reported_and_rerun_recovers(toy_workdir):
    """scancel of shard 0's running job: the run fails naming that job as CANCELLED; a rerun resubmits it and merges."""
    set_stage(toy_workdir, "upper", provider_config={"item_delay": 1.0}, fingerprint_ignore=["item_delay"])
    driver = subprocess.Popen(slurm_command(limit=300), cwd=toy_workdir, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=slurm_env())
    seen = []
    victim = None
    for line in driver.stdout:  # read the submission lines as they come
        seen.append(line)
        m = SUBMITTED.search(line)
        if m and "toy_0/" in m.group(2):
            victim = m.group(1)
            break
    assert victim, "".join(seen)
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until it runs (a pending job's cancellation proves less)
        state = subprocess.run(["squeue", "-h", "-j", victim, "-o", "%T"], capture_output=True, text=True).stdout
        if state.strip() == "RUNNING":
            break
        time.sleep(0.5)
    # mid-run: the shard job has started (its log's first line; the job's own Snakemake takes seconds to get there
    # on a loaded machine, and a fresh clone's suite cancelled it before) and works through its 10 one-second items
    log_path = toy_workdir / TOY / "logs/split.0.log"
    while time.time() < deadline and not (log_path.is_file() and log_path.read_text().startswith("shard 0: started")):
        time.sleep(0.2)
    time.sleep(1)
    subprocess.run(["scancel", victim], check=True)
    rest, _ = driver.communicate(timeout=300)
    out = "".join(seen) + rest
    assert driver.returncode != 0
    assert f"SLURM-job '{victim}' failed, SLURM status is: 'CANCELLED'" in out, out[-3000:]
    assert not (toy_workdir / TOY / "split.0/done").exists()
    assert not (toy_workdir / TOY / "merged.json").exists()
    # the job's log and status say it was stopped, in which SLURM job (a Kaldi user's trial: an empty log, "pending")
    log = log_path.read_text().splitlines()
    assert log[0].endswith(f", SLURM job {victim}") and log[-1].endswith(
        f" in SLURM job {victim} (scancel, or its time limit: `sacct -j {victim}` says which); rerun to go on"), log
    status = run_cli(toy_workdir, "status").stdout
    assert re.search(rf"split\.0\s+incomplete\s+10 items\s+stopped by SIGTERM at [^;]+ in SLURM job {victim} "
                     rf"\(scancel, or its time limit: `sacct -j {victim}` says which\): the next run runs it again$",
                     status, re.M), status

    rerun = run_slurm(toy_workdir)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert list(submitted(rerun.stdout + rerun.stderr).values())[0].count("toy_0/") == 1
    assert len(submitted(rerun.stdout + rerun.stderr)) == 1
    assert (toy_workdir / TOY / "text").read_text().splitlines() == [f"utt{i:03d} UTT{i:03d}" for i in range(40)]


@pytest.mark.parametrize("per_job", [1, 2])
def test_status_names_the_slurm_job_of_each_queued_and_running_shard(toy_workdir, per_job):
    """While a run's shard jobs wait in SLURM's queue, status says queued or running with the job id and squeue's
    reason (an HPC user's trial: shards in the queue showed as stale, with the cause of an earlier run), and a shard
    whose job left the queue shows its state from disk again. With shards_per_job 2, each shard is found in the job
    of its group (its comment names the group's first and last shard)."""
    # each shard job takes both CPUs of the one-node cluster: one runs, the others wait
    set_stage(toy_workdir, "upper", provider_config={"item_delay": 0.5}, fingerprint_ignore=["item_delay"],
              resources={"cpus_per_task": 2}, canary=0, shards_per_job=per_job)
    waiting = 4 // per_job - 1
    driver = subprocess.Popen(slurm_command(limit=300), cwd=toy_workdir,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=slurm_env())
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # one job running in SLURM, the others queued behind it
            states = sorted(job.split()[1] for job in cluster_jobs() if "rule_shard_upper" in job)
            if states == ["PENDING"] * waiting + ["RUNNING"]:
                break
            time.sleep(0.5)
        assert states == ["PENDING"] * waiting + ["RUNNING"], cluster_jobs()
        jobs = {}  # shard -> job id, from the job's comment: ..._wildcards_toy_<shard> or ..._toy_<first>_<last>
        for job in cluster_jobs():
            shards = job.split()[3].split("_toy_")[1].split("_")
            jobs.update({str(n): job.split()[0] for n in range(int(shards[0]), int(shards[-1]) + 1)})
        status = run_cli(toy_workdir, "status").stdout
        running = re.findall(r"^  split\.(\d)\s+running\s+10 items  in SLURM job (\d+) \(RUNNING\)$", status, re.M)
        queued = re.findall(r"^  split\.(\d)\s+queued\s+10 items  in SLURM job (\d+), pending \((\w+)\)$", status, re.M)
        assert len(running) == per_job and len(queued) == 4 - per_job, status
        assert all(jobs[shard] == job for shard, job, *_ in running + queued), (jobs, status)
        assert {reason for *_, reason in queued} <= {"Resources", "Priority"}, status
    finally:
        subprocess.run(["scancel", *(job.split()[0] for job in cluster_jobs())], check=False)
        driver.terminate()  # rather than wait for its next status checks to see them cancelled
        driver.communicate(timeout=120)
    time.sleep(1)
    while cluster_jobs():
        time.sleep(0.5)
    after = run_cli(toy_workdir, "status").stdout  # the queue is empty: the shards' own states again
    assert not re.search(r"^  split\.\d\s+(queued|running) ", after, re.M), after


def test_out_of_memory_shard_is_retried_with_more_memory(toy_workdir):
    """A shard holding ~600 MB under mem_mb 500 is killed by SLURM, retried with 1000 MB (attempt 2), and succeeds."""
    set_stage(toy_workdir, "upper", sharding={"num_shards": 1}, retries=2, canary=0,
              resources={"mem_mb": 500, "runtime": 5, "qos": "normal"},
              provider_config={"allocate_mb": 600, "item_delay": 0.1}, fingerprint_ignore=["item_delay"])
    run = run_slurm(toy_workdir)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    jobs = submitted(out)
    assert len(jobs) == 2, out[-3000:]
    accounting = sacct(list(jobs))
    assert [(state, mem) for _, state, mem in accounting] == [("FAILED", "500M"), ("COMPLETED", "1000M")]
    qos = subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join(jobs), "--format=QOS"], capture_output=True,
                         text=True, check=True).stdout.split()
    assert qos == ["normal", "normal"]  # resources.qos reaches sbatch
    first_log = Path(jobs[accounting[0][0]]).read_text()
    assert "Exceeded job memory limit" in first_log
    assert len((toy_workdir / TOY / "text").read_text().splitlines()) == 40


def test_broken_stage_submits_one_canary_job_not_one_per_shard(toy_workdir):
    """A provider without the env name forward asks for: 1 SLURM job (the canary) fails, 0 of the 4 shards are submitted."""
    (toy_workdir / "broken.py").write_text(MISSING_ENV)
    set_stage(toy_workdir, "upper", runner="broken.Runner", provider="broken.Provider")
    run = run_slurm(toy_workdir)
    out = run.stdout + run.stderr
    assert run.returncode != 0
    jobs = submitted(out)
    assert len(jobs) == 1 and "/rule_canary_upper/" in next(iter(jobs.values())), out[-3000:]
    log = (toy_workdir / "results/upper/logs/canary.log").read_text()
    assert "canary of stage 'upper' failed, so none of its shard jobs was started" in log
    assert "needs env key 'tokenizer'" in log
    assert not list((toy_workdir / TOY).glob("split.*/.attempt"))
    status = run_cli(toy_workdir, "status").stdout
    assert status.splitlines()[1].startswith("  canary: failed (log results/upper/logs/canary.log): snakeshard: error: "
                                             "canary of stage 'upper' failed"), status
    assert "needs env key 'tokenizer'" in status.splitlines()[1]


def test_driver_killed_then_its_jobs_cancelled_by_run_id_and_one_rerun_submits_each_missing_shard_once(toy_workdir):
    """docs/slurm.md's recovery after the driver dies on SLURM: the dead run's ID from Snakemake's log, `scancel
    --name` of its jobs still pending or running, --unlock, one rerun. The rerun submits exactly the shards
    without a done, none of them twice, and no job of the dead run is left to run beside it."""
    import psutil

    set_stage(toy_workdir, "upper", provider_config={"item_delay": 1.0}, fingerprint_ignore=["item_delay"])
    driver = subprocess.Popen(slurm_command(limit=300), cwd=toy_workdir, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=slurm_env())
    seen = []
    for line in driver.stdout:  # until the four shard jobs are submitted
        seen.append(line)
        if sum(bool(SUBMITTED.search(x)) and "rule_shard_upper" in x for x in seen) == 4:
            break
    time.sleep(2)
    for proc in psutil.Process(driver.pid).children(recursive=True):  # snakemake itself, under `timeout`
        if "snakemake" in " ".join(proc.cmdline()):
            proc.kill()
    driver.kill()
    driver.wait()
    logs = sorted((toy_workdir / ".snakemake/log").glob("*.snakemake.log"))
    run_id = re.search(r"SLURM run ID: (\S+)", logs[-1].read_text()).group(1)
    queued = subprocess.run(["squeue", "-h", "--name", run_id, "-O", "JobID:12,Comment:60,State:12"],
                            capture_output=True, text=True).stdout
    assert queued.strip(), "the dead run's jobs should still be on the cluster"
    # what docs/slurm.md shows to tell a run's jobs apart: each one's rule and shard, in its comment
    assert re.search(r"rule_shard_upper_wildcards_toy_\d\s", queued), queued
    subprocess.run(["scancel", "--name", run_id], check=True)
    deadline = time.time() + 60
    while subprocess.run(["squeue", "-h", "--name", run_id], capture_output=True, text=True).stdout.strip():
        assert time.time() < deadline, "the dead run's jobs did not leave the queue"
        time.sleep(0.5)
    missing = [n for n in range(4) if not (toy_workdir / TOY / f"split.{n}/done").exists()]
    assert missing, "every shard finished before the kill: the test proves nothing"
    assert run_slurm(toy_workdir, "--unlock").returncode == 0
    rerun = run_slurm(toy_workdir)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    resubmitted = sorted(int(log.split("toy_")[1].split("/")[0])
                         for log in submitted(rerun.stdout + rerun.stderr).values() if "rule_shard_upper" in log)
    assert resubmitted == missing
    assert (toy_workdir / TOY / "text").read_text().splitlines() == [f"utt{i:03d} UTT{i:03d}" for i in range(40)]


def _training_job_id(workdir: Path) -> str | None:
    """The SLURM job id of the training stage's running job (its comment names the rule)."""
    out = subprocess.run(["squeue", "--me", "-h", "-O", "JobID:12,Comment:60,State:12"], capture_output=True,
                         text=True).stdout
    running = [line.split()[0] for line in out.splitlines() if "rule_train_train" in line and "RUNNING" in line]
    return running[0] if running else None


def test_training_stopped_by_scancel_signal_term_and_by_its_time_limit_resumes_to_the_local_result(
        tmp_path, tmp_path_factory):
    """`scancel --signal=TERM` on the training job: it checkpoints and exits 75, Snakemake's retry resumes it. Then a
    runtime shorter than the training with SIGTERM asked for ahead of the limit (checkpoint.signal_seconds): each
    attempt checkpoints before SLURM's limit, the next one (longer runtime) resumes. Both end with the weights and
    steps of an uninterrupted local run."""
    from test_train_stage import (TRAIN_TARGET, TRAINED, assert_same_training, make_project, outputs, reference,
                                  set_training, steps_done)

    want = reference(tmp_path_factory, threads=1)
    wd = make_project(tmp_path / "p", step_delay=0.25)
    set_training(wd, retries=2)
    driver = subprocess.Popen(slurm_command(TRAIN_TARGET, limit=400), cwd=wd, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=slurm_env())
    try:
        deadline = time.time() + 300
        while steps_done(wd) < 8 and driver.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        job = _training_job_id(wd)
        assert job is not None and driver.poll() is None, "the training job ended before it could be signalled"
        status = next(line for line in run_cli(wd, "status").stdout.splitlines() if "(training)" in line)
        assert re.search(rf": running  in SLURM job {job} \(RUNNING\); \d+ steps logged", status), status
        subprocess.run(["scancel", "--signal=TERM", job], check=True)
        out, _ = driver.communicate(timeout=400)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, out[-3000:]
    assert "resumed from" in (wd / TRAINED / "logs/train.log").read_text()
    assert_same_training(outputs(wd), want)

    # A 1-minute limit (attempt N gets N minutes), SIGTERM asked for 50 s before it, ~72 s of steps. SLURM checks
    # its signal times in a periodic sweep, so the early SIGTERM may come anywhere in the first minute or not at
    # all; then the limit's own SIGTERM (KillWait ahead of SIGKILL) stops the first attempt. Either way it cannot
    # finish: the steps alone outlast its limit (in CI, 24 s of steps once finished before any signal came).
    wd = make_project(tmp_path / "q", step_delay=1.5)
    set_training(wd, retries=3, resources={"runtime": 1}, checkpoint={"interval": 2, "signal_seconds": 50})
    run = run_slurm(wd, TRAIN_TARGET, limit=500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    attempts = [log for log in submitted(run.stdout + run.stderr).values() if "rule_train_train" in log]
    assert len(attempts) >= 2, "no training attempt was stopped before its time limit"
    assert "resumed from" in (wd / TRAINED / "logs/train.log").read_text()
    assert_same_training(outputs(wd), want)


def test_the_digits_recipe_on_slurm_gives_the_local_metrics_json(tmp_path, tmp_path_factory):
    """The digits recipe (tests/test_recipe_digits.py) with its SLURM profile: every job a SLURM job, the final
    metrics.json, metrics.txt and training metrics byte-identical to the local run's. Both train 2 epochs, not 20:
    where each job runs is asked here, and 18 more epochs were ~4 of this module's ~17 minutes."""
    from test_recipe_digits import FSDD, final_bytes, init, local_two_epoch_reference, two_epochs

    if not any(FSDD.glob("*.wav")):
        pytest.skip(f"no FSDD recordings at {FSDD}: set SNAKESHARD_FSDD to a copy of its recordings/")
    want = local_two_epoch_reference(tmp_path_factory)
    wd = init(tmp_path / "digits")
    run = subprocess.run(["timeout", "-k", "10", "900", sys.executable, "-m", "snakemake", "--profile",
                          "profiles/slurm", *FAST_STATUS, "--configfile", str(two_epochs(wd))], cwd=wd,
                         capture_output=True, text=True, env=slurm_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # 5 canaries (fbank's over test for infer's), 6 fbank + 4 stats + 2 inference + 1 scoring shards, the training:
    # each its own SLURM job (merges and the report run locally)
    assert len(submitted(run.stdout + run.stderr)) == 19
    assert final_bytes(wd) == want
