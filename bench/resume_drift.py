"""Reproduces the resume drift issues 26/27 had on AVX-512 CPUs (not a benchmark, a probe; its cause and the change
that ended it: bench/RESULTS.md section 28).

In a digits project (`snakeshard init --recipe digits DIR --data ...`, run once to the end), retrains the training
stage uninterrupted as the reference, then for each N: kill -9 of snakemake and its jobs once N steps are
logged, the same command again (it resumes from the latest checkpoint), and a byte comparison of the training
metrics.json and steps.jsonl with the reference, naming the first step whose line differs.

    python bench/resume_drift.py DIR 100 200 230 377 500 [--load] [--env NAME=VALUE ...]

``--env``: set in every run's environment, the reference's too (leads to try where it drifts, not tried yet: pin
the math libraries' code paths, ``--env MKL_CBWR=COMPATIBLE --env ONEDNN_MAX_CPU_ISA=AVX2``, or their thread
counts, ``--env MKL_DYNAMIC=FALSE``). ``--load``: two busy-looping processes run beside each resumed run.

Measured on an Intel Xeon with AVX-512 (2 vCPUs, 2026-11-24), 13 kills: 5 drifted, always from the second update
after the resume (resumed at step 150: steps 150 and 151 exact, 152 drifted; at 225: 227 drifted). Which kills
drift changes from try to try (200 drifted in one probe, not in the next): `python bench/resume_drift.py DIR 200
377` gave SAME, SAME, then `... 100 230 160 300` gave SAME, DRIFT (killed at 238), SAME, SAME.

On an AMD EPYC (AVX2, no AVX-512; 2 vCPUs, 2026-11-25), `python bench/resume_drift.py DIR 80 160 230 377 500 700`
then the same with ``--load``: 12 kills, all SAME (resumed at steps 75, 150, 225, 375, 450, 675: the recipe trains
~30 steps/s here, so every_seconds 60 never fires and each resume is from an epoch's end, 75 steps each).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

TRAINED = Path("results/train/feats_train")


def snakemake(*args: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", "--profile", "profiles/local", *args]


def steps_logged() -> int:
    try:
        return sum(1 for line in (TRAINED / "steps.jsonl").read_text().splitlines() if '"lr"' in line)
    except FileNotFoundError:
        return 0


def resume_step() -> int | None:
    """The step of the checkpoint a rerun resumes from (None when there is none)."""
    from snakeshard.train.checkpoint import CheckpointManager

    found = CheckpointManager(TRAINED / "checkpoints").load_latest()  # what the training loop picks
    return None if found is None else found[0]["progress"]["step"]


def retrain(kill_at: int | None, load: bool) -> tuple[int, int | None] | None:
    """Train from scratch; with ``kill_at``, kill -9 everything at that step, then run again. (The step killed
    at, the step of the checkpoint the rerun resumed from)."""
    shutil.rmtree("results/train", ignore_errors=True)
    target = str(TRAINED / "done")
    killed = None  # (the step killed at, the step resumed from)
    if kill_at is not None:
        driver = subprocess.Popen(snakemake(target), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        while steps_logged() < kill_at and driver.poll() is None:
            time.sleep(0.05)
        step = steps_logged()
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
        subprocess.run(snakemake("--unlock"), capture_output=True, check=True)
        killed = (step, resume_step())
    hogs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(2 if load else 0)]
    try:
        subprocess.run(snakemake(target), capture_output=True, check=True)
    finally:
        for hog in hogs:
            hog.kill()
    return killed


def first_difference(a: bytes, b: bytes) -> str:
    for line_a, line_b in zip(a.decode().splitlines(), b.decode().splitlines()):
        if line_a != line_b:
            return f"first differing line: {line_a[:80]} | {line_b[:80]}"
    return "same lines, different lengths" if a != b else "same"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("project")
    ap.add_argument("steps", type=int, nargs="+")
    ap.add_argument("--load", action="store_true")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    args = ap.parse_args()
    os.chdir(args.project)
    os.environ.update(item.split("=", 1) for item in args.env)  # snakemake and its jobs inherit them
    retrain(None, load=False)
    want = {name: (TRAINED / name).read_bytes() for name in ("metrics.json", "steps.jsonl")}
    for n in args.steps:
        killed = retrain(n, args.load)
        got = {name: (TRAINED / name).read_bytes() for name in want}
        same = got == want
        print(f"kill at step {killed[0]}, resumed at {killed[1]}: {'SAME' if same else 'DRIFT'}"
              + ("" if same else f"; steps.jsonl {first_difference(want['steps.jsonl'], got['steps.jsonl'])}"))


if __name__ == "__main__":
    main()
