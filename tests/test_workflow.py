"""End-to-end: real `snakemake` runs of the shipped workflow on the shipped speech and on a toy runner."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (keep_only_stage, read_config, run_cli, run_snakemake, shard_process, slurm_extra_available,
                      wait_for, write_config)

SET = Path("results/asr/demo")
TOY = Path("results/upper/toy")


def executed_shards(stdout_and_err: str) -> list[int]:
    """Shard ids of the `rule shard_<stage>` jobs a snakemake run (or dry run) lists."""
    return sorted(int(m) for m in re.findall(r"rule shard_\w+:\n(?:    .*\n)*?    wildcards: .*shard=(\d+)", stdout_and_err))


def demo_keys(workdir: Path) -> list[str]:
    return [line.split()[0] for line in (workdir / "data/demo/wav.scp").read_text().splitlines()]


def test_demo_end_to_end_matches_in_process(workdir, monkeypatch):
    """The demo merges pocketsphinx hypotheses of 10 real utterances from 2 shards, same bytes as in-process."""
    run = run_snakemake(workdir)
    assert run.returncode == 0, run.stderr[-3000:]
    plan = json.loads((workdir / SET / "plan.json").read_text())
    assert plan["num_shards"] == 2 and plan["num_items"] == 10
    merged = (workdir / SET / "text").read_bytes()
    assert len(merged.splitlines()) == 10
    assert b"cards-001 ten of clubs\n" in merged  # a real recognition result, not a placeholder
    assert "WER 22.83% (15 sub, 3 del, 3 ins of 92 words, 10 utterances)" in (
        workdir / "results/score/demo_asr/metrics.txt").read_text()  # the score stage over the asr output

    from snakeshard.demo.asr import PocketsphinxProvider, PocketsphinxRunner

    monkeypatch.chdir(workdir)  # wav.scp paths are relative to the workflow directory
    provider = PocketsphinxProvider({"dataset": {"name": "demo", "path": "data/demo", "format": "kaldi"}})
    PocketsphinxRunner(provider, output_dir=workdir / "inproc")(demo_keys(workdir))
    assert (workdir / "inproc/text").read_bytes() == merged


def test_dry_run_lists_exactly_the_planned_shards(toy_workdir):
    """`snakemake -n` lists one shard job per planned shard, for both the local and the slurm profile."""
    config = read_config(toy_workdir)
    config["stages"]["upper"]["sharding"] = {"shard_size": 7}  # 40 items -> 6 shards
    write_config(toy_workdir, config)
    dry = run_snakemake(toy_workdir, "-n")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert executed_shards(dry.stdout + dry.stderr) == list(range(6))
    plan = json.loads((toy_workdir / TOY / "plan.json").read_text())
    assert [s["items"] for s in plan["shards"]] == [7, 7, 7, 7, 7, 5]
    assert not list((toy_workdir / TOY).glob("split.*/done")), "a dry run must not run shards"

    table = run_cli(toy_workdir, "plan")
    assert table.returncode == 0 and "(6 shards)" in table.stdout and "utt035 .. utt039" in table.stdout

    slurm = run_snakemake(toy_workdir, "-n", profile="slurm")
    if not slurm_extra_available():
        # the README's venv, without the slurm extra (installed beside it when a cluster answers, see conftest):
        # the profile is refused, naming the executor that is missing
        assert slurm.returncode != 0 and "invalid choice: 'slurm'" in slurm.stderr, slurm.stderr[-3000:]
    else:
        assert slurm.returncode == 0, slurm.stderr[-3000:]
        assert executed_shards(slurm.stdout + slurm.stderr) == list(range(6))


def test_failing_shard_keeps_others_and_rerun_runs_only_it(toy_workdir):
    """A provider option raises on one key: the other shards finish, merge does not run; the rerun runs one shard."""
    config = read_config(toy_workdir)
    config["stages"]["upper"]["provider_config"] = {"fail_on_keys": ["utt013"]}
    config["stages"]["upper"]["fingerprint_ignore"] = ["fail_on_keys"]
    write_config(toy_workdir, config)

    first = run_snakemake(toy_workdir)
    assert first.returncode != 0
    log = toy_workdir / TOY / "logs/split.1.log"
    assert "shard 1" in log.read_text() and "'utt013'" in log.read_text() and str(TOY / "logs/split.1.log") in log.read_text()
    assert "asked to fail on utt013" in log.read_text()
    assert str(TOY / "logs/split.1.log") in first.stderr  # snakemake names the failed job's log
    done = {n: (toy_workdir / TOY / f"split.{n}/done").exists() for n in range(4)}
    assert done == {0: True, 1: False, 2: True, 3: True}
    assert not (toy_workdir / TOY / "merged.json").exists() and not (toy_workdir / TOY / "text").exists()

    status = run_cli(toy_workdir, "status")
    assert status.returncode == 0
    assert re.search(r"split\.1\s+failed", status.stdout) and "utt013" in status.stdout
    assert len(re.findall(r"split\.\d+\s+done", status.stdout)) == 3
    # the end of the item's traceback, then the shard's error line (what docs/failures-and-reruns.md shows)
    told = [line for line in status.stdout.splitlines() if line.startswith("      | ")]
    assert len(told) == 4 and told[-1].startswith("      | snakeshard: error: shard 1 "), status.stdout
    assert told[-3:-1] == ['      |     raise RuntimeError(f"asked to fail on {key}")',
                           "      | RuntimeError: asked to fail on utt013"], status.stdout

    untouched = (toy_workdir / TOY / "split.0/done").read_bytes()
    config["stages"]["upper"]["provider_config"] = {}
    write_config(toy_workdir, config)
    second = run_snakemake(toy_workdir)
    assert second.returncode == 0, second.stderr[-3000:]
    assert executed_shards(second.stdout + second.stderr) == [1]
    assert (toy_workdir / TOY / "split.0/done").read_bytes() == untouched
    lines = (toy_workdir / TOY / "text").read_text().splitlines()
    assert lines == [f"utt{i:03d} UTT{i:03d}" for i in range(40)]
    assert "4 done" in run_cli(toy_workdir, "status").stdout


def _slow_demo(workdir: Path) -> None:
    config = keep_only_stage(read_config(workdir), "asr")
    config["stages"]["asr"]["provider_config"] = {"item_delay": 0.4}
    config["stages"]["asr"]["fingerprint_ignore"] = ["item_delay"]
    write_config(workdir, config)


def test_kill9_of_a_shard_then_rerun_is_byte_identical(workdir, clean_demo_text):
    """kill -9 of one shard process mid-run: no done for it, no merge; the rerun gives the clean run's bytes."""
    _slow_demo(workdir)
    driver = subprocess.Popen([sys.executable, "-m", "snakemake", "--profile", "config/profiles/local", "--cores", "2"],
                              cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    victim = wait_for(lambda: shard_process(workdir, 0), 60, "shard 0 to start")
    wait_for(lambda: (workdir / SET / "split.0/.attempt").exists(), 30, "shard 0 to claim its dir")
    time.sleep(1.5)  # mid-run: the model is loaded and some items are done
    victim.send_signal(signal.SIGKILL)
    out, _ = driver.communicate(timeout=120)
    assert driver.returncode != 0, out
    assert not (workdir / SET / "split.0/done").exists()
    assert not (workdir / SET / "merged.json").exists()
    assert (workdir / SET / "split.1/done").exists()  # keep-going: the other shard finished

    rerun = run_snakemake(workdir)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert executed_shards(rerun.stdout + rerun.stderr) == [0]
    assert (workdir / SET / "text").read_bytes() == clean_demo_text


def test_kill9_of_the_driver_then_unlock_and_rerun_incomplete(workdir, clean_demo_text):
    """kill -9 of snakemake itself (shards orphaned, still running): --unlock then a rerun gives the clean bytes."""
    _slow_demo(workdir)
    driver = subprocess.Popen([sys.executable, "-m", "snakemake", "--profile", "config/profiles/local", "--cores", "2"],
                              cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: shard_process(workdir, 0) and shard_process(workdir, 1), 60, "both shards to start")
    time.sleep(1.0)
    driver.send_signal(signal.SIGKILL)
    driver.wait()

    locked = run_snakemake(workdir)  # the dead driver's lock is still there
    assert locked.returncode != 0 and "lock" in (locked.stdout + locked.stderr).lower()
    assert run_snakemake(workdir, "--unlock").returncode == 0
    rerun = run_snakemake(workdir)  # the local profile sets rerun-incomplete
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    wait_for(lambda: not shard_process(workdir, 0) and not shard_process(workdir, 1), 60, "orphaned shards to end")
    assert (workdir / SET / "text").read_bytes() == clean_demo_text
    # an orphaned attempt must not have replaced the rerun's done record afterwards
    for n in (0, 1):
        done = json.loads((workdir / SET / f"split.{n}/done").read_text())
        assert done["items"] == len((workdir / SET / f"split.{n}/keys").read_text().splitlines())


def test_changed_provider_config_reruns_shards_and_merge_refuses_stale(toy_workdir):
    """A changed provider option reruns every shard; a shard whose done has another fingerprint is refused by merge."""
    assert run_snakemake(toy_workdir).returncode == 0
    config = read_config(toy_workdir)
    config["stages"]["upper"]["provider_config"] = {"suffix": "!"}
    write_config(toy_workdir, config)

    dry = run_snakemake(toy_workdir, "-n")
    assert executed_shards(dry.stdout + dry.stderr) == [0, 1, 2, 3]
    assert "updated input files:\n        shard_upper" in dry.stdout  # each shard's .fingerprint, rewritten
    assert run_snakemake(toy_workdir).returncode == 0
    assert (toy_workdir / TOY / "text").read_text().splitlines()[0] == "utt000 UTT000!"

    # Put back shard 2's done from a run with another config: merge must refuse it.
    done_path = toy_workdir / TOY / "split.2/done"
    done = json.loads(done_path.read_text())
    done["fingerprint"] = "0" * 20
    done_path.write_text(json.dumps(done))
    before = (toy_workdir / TOY / "text").read_bytes()
    refused = run_snakemake(toy_workdir, "--forcerun", "merge")
    assert refused.returncode != 0
    merge_log = (toy_workdir / TOY / "logs/merge.log").read_text()
    assert "shard 2 was computed with fingerprint 00000000000000000000" in merge_log
    assert not (toy_workdir / TOY / "merged.json").exists()
    assert (toy_workdir / TOY / "text").read_bytes() == before  # nothing already merged was overwritten
    # status names the failed merge with its log and error line (it said "merged: no")
    merged = [line for line in run_cli(toy_workdir, "status").stdout.splitlines() if line.startswith("  merged: ")]
    assert merged[0].startswith(f"  merged: failed (log {TOY}/logs/merge.log): snakeshard: error: "), merged
    assert "shard 2 was computed with fingerprint 00000000000000000000" in merged[0]
    # shard 2 redone (its done removed: the merge is not current, so Snakemake reruns it) and merged: history
    done_path.unlink()
    assert run_snakemake(toy_workdir).returncode == 0
    assert "  merged: yes, current" in run_cli(toy_workdir, "status").stdout.splitlines()


def test_gpu_stage_without_visible_gpu_fails_at_job_start(toy_workdir):
    """resources.gpu: 1 on a machine whose jobs see no GPU: the stage's canary (on by default; it has the shard jobs'
    resources) fails at start naming the stage and the count, and no shard job starts; with the canary off, each
    shard job fails so."""
    config = read_config(toy_workdir)
    config["stages"]["upper"]["resources"] = {"gpu": 1}
    write_config(toy_workdir, config)
    run = run_snakemake(toy_workdir)
    assert run.returncode != 0
    log = (toy_workdir / "results/upper/logs/canary.log").read_text()
    assert "stages.upper.resources asks for 1 GPU(s), but this job" in log.splitlines()[-1]
    assert "sees 0" in log and "CUDA_VISIBLE_DEVICES=" in log
    assert not (toy_workdir / TOY / "logs").exists()

    config["stages"]["upper"]["canary"] = 0
    write_config(toy_workdir, config)
    assert run_snakemake(toy_workdir).returncode != 0
    log = (toy_workdir / TOY / "logs/split.0.log").read_text()
    assert "snakeshard: error: stages.upper.resources asks for 1 GPU(s), but this job" in log
    assert "sees 0" in log and "CUDA_VISIBLE_DEVICES=" in log
    assert not list((toy_workdir / TOY).glob("split.*/done"))


def test_devices_reach_the_provider_as_the_jobs_own_allocation(toy_workdir):
    """A CPU stage's provider gets devices ['cpu'] (GPU stages get cuda:0..N-1, checked where a GPU exists)."""
    (toy_workdir / "devprobe.py").write_text(
        "from toy import ToyProvider, UpperRunner\n"
        "class DevProvider(ToyProvider):\n"
        "    def build_env_local(self):\n"
        "        return {**super().build_env_local(), 'suffix': ' ' + ','.join(self.config['devices'])}\n"
    )
    config = read_config(toy_workdir)
    config["stages"]["upper"]["provider"] = "devprobe.DevProvider"
    write_config(toy_workdir, config)
    assert run_snakemake(toy_workdir).returncode == 0
    assert (toy_workdir / TOY / "text").read_text().splitlines()[0] == "utt000 UTT000 cpu"


def test_stage_resources_reach_the_slurm_jobs(toy_workdir):
    """Per-stage SLURM resources in config appear on every shard job of the slurm profile's dry run; unset ones do not."""
    # the profile needs the slurm extra, which conftest installs when a cluster answers (and only then: with
    # the plugin and no controller every snakemake call stalls ~9 s)
    if not slurm_extra_available():
        pytest.skip("the slurm extra is not installed")
    config = read_config(toy_workdir)
    config["stages"]["upper"]["resources"] = {"mem_mb": 700, "runtime": 7, "cpus_per_task": 2,
                                              "slurm_partition": "debug", "constraint": "fast", "qos": "normal",
                                              "slurm_extra": "--mail-type=FAIL"}
    write_config(toy_workdir, config)
    dry = run_snakemake(toy_workdir, "-n", profile="slurm")
    assert dry.returncode == 0, dry.stderr[-3000:]
    lines = [line for line in (dry.stdout + dry.stderr).splitlines()
             if line.startswith("    resources:") and "mem_mb=700" in line]
    assert len(lines) == 5, dry.stdout[-3000:]  # 4 shard jobs and the canary (on in the SLURM profile)
    for line in lines:
        for item in ("runtime=7", "cpus_per_task=2", "slurm_partition=debug", "constraint=fast", "qos=normal",
                     "slurm_extra=--mail-type=FAIL"):
            assert item in line, line
        assert "slurm_account" not in line and "gpu" not in line


@pytest.mark.parametrize("extra, message", [
    ("--qos=high", "'--qos=high': set it with stages.upper.resources.qos"),
    ("--mail-type=FAIL -pdebug", "'-pdebug': set it with stages.upper.resources.slurm_partition"),
    ("--job-name x", "'--job-name': snakeshard and the SLURM plugin set it"),
])
def test_an_sbatch_option_with_its_own_key_is_refused_in_slurm_extra_at_the_parse(toy_workdir, extra, message):
    """The SLURM plugin refuses these in slurm_extra only when it submits (a user trial's --qos=high, as the docs
    showed it, failed its first job); the parse names the key to use instead, before any job."""
    config = read_config(toy_workdir)
    config["stages"]["upper"]["resources"] = {"slurm_extra": extra}
    write_config(toy_workdir, config)
    dry = run_snakemake(toy_workdir, "-n")
    assert dry.returncode != 0
    assert f"stages.upper.resources.slurm_extra: {message}" in dry.stderr, dry.stderr[-2000:]
