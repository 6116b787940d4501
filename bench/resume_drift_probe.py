"""Probe (not a benchmark, not a test): how often one resume of the digits recipe's training drifts, fast.

bench/resume_drift.py kills a whole snakemake run and reruns it (~20 s a try); this probe keeps a copy of the
training directory as a killed run left it (``latest.pt`` at some step), restores it before each try, runs the
training job's own command (`python -m snakeshard train`, no Snakemake) until it has logged step UNTIL, kills
it, and compares every logged step with a reference `steps.jsonl` of an uninterrupted run (~3 s a try).

In a digits project (`snakeshard init --recipe digits DIR --data ...`, run once to the end):

    cp results/train/feats_train/steps.jsonl /tmp/ref.jsonl               # the uninterrupted run's steps
    python bench/resume_drift_probe.py snapshot 235 /tmp/snap              # kill a run once 235 steps are logged
    python bench/resume_drift_probe.py probe /tmp/snap /tmp/ref.jsonl 300 20 [NAME=VALUE ...]

``NAME=VALUE``: set in each try's environment (e.g. OMP_WAIT_POLICY=PASSIVE). Prints, per try, the first step
that differs (or none) and, at the end, how many tries drifted and how many distinct results they gave.
Findings: bench/RESULTS.md section 27.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

TRAINED = "results/train/feats_train"


def logged_steps() -> dict[int, str]:
    """Step -> its line in steps.jsonl (epoch lines and a line cut short by the kill left out)."""
    steps = {}
    try:
        lines = open(f"{TRAINED}/steps.jsonl").read().splitlines()
    except FileNotFoundError:
        return steps
    for line in lines:
        if '"lr"' in line:
            try:
                steps[json.loads(line)["step"]] = line
            except ValueError:
                pass
    return steps


def snapshot(kill_at: int, dest: str) -> None:
    """Train from scratch under snakemake, kill -9 everything once ``kill_at`` steps are logged, keep the dir."""
    shutil.rmtree("results/train", ignore_errors=True)
    snakemake = [sys.executable, "-m", "snakemake", "--profile", "profiles/local"]
    driver = subprocess.Popen([*snakemake, f"{TRAINED}/done"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    while len(logged_steps()) < kill_at:
        time.sleep(0.05)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    subprocess.run([*snakemake, "--unlock"], capture_output=True, check=True)
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(TRAINED, dest)


def train_command() -> list[str]:
    """The training job's command, as the workflow gives it (its fingerprint read from a dry run)."""
    dry = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/local", "-n", "-p", "--forcerun",
                          "train_train", f"{TRAINED}/done"], capture_output=True, text=True, check=True).stdout
    fingerprint = next(line for line in dry.splitlines() if "snakeshard train" in line).split("--fingerprint ")[1]
    return [sys.executable, "-m", "snakeshard", "train", "--spec", f"{TRAINED}/train.json",
            "--fingerprint", fingerprint.split()[0], "--log", f"{TRAINED}/logs/train.log"]


def probe(snap: str, reference: str, until: int, tries: int, env_items: list[str]) -> None:
    want = {json.loads(line)["step"]: line.rstrip("\n") for line in open(reference) if '"lr"' in line}
    env = dict(os.environ, SNAKESHARD_PYTHON=sys.executable)
    env.update(item.split("=", 1) for item in env_items)
    command = train_command()
    results, drifted = collections.Counter(), 0
    for n in range(tries):
        shutil.rmtree(TRAINED, ignore_errors=True)
        shutil.copytree(snap, TRAINED)
        job = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while job.poll() is None and max(logged_steps(), default=0) < until:
            time.sleep(0.02)
        job.kill()
        job.wait()
        got = logged_steps()
        missing = [step for step in range(1, until + 1) if step not in got]
        if missing:
            sys.exit(f"try {n}: steps {missing[:5]}... not logged (exit status {job.returncode}; see the train log)")
        first = next((step for step in range(1, until + 1) if got[step] != want[step]), None)
        drifted += first is not None
        results[hashlib.sha256("".join(got[s] for s in range(1, until + 1)).encode()).hexdigest()[:8]] += 1
        print(f"try {n}: first differing step {first}", flush=True)
    print(f"{drifted} of {tries} tries drifted; distinct results: {dict(results)}")


def main() -> None:
    if sys.argv[1:2] == ["snapshot"]:
        snapshot(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1:2] == ["probe"]:
        probe(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6:])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
