"""Benchmark (not a test): per-shard-job overhead through SLURM vs the local executor.

The same trivial workflow (a toy runner, N shards of 10 keys each) runs once with
`--profile config/profiles/local --cores 2` and once through `--profile config/profiles/slurm`
on the live single-node cluster (../shared/tools/local-slurm, 2 CPUs). Reports wall time per
shard for both, and per SLURM job: the job's elapsed time (sacct) against the shard's own work
(start..end in its `done`). Needs the cluster up.
With ``--shards-per-job K`` (K > 1) a third run goes through SLURM with ``shards_per_job: K``: N / K
SLURM jobs of K shards each; its SLURM cluster time (sum of sacct elapsed) per shard is the figure
to compare with one job per shard.

    python bench/slurm_overhead.py [--shards 8] [--shards-per-job 16]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from benchlib import TOY_STAGE_MODULE, fresh_project

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "work" / "slurm"
FAST_STATUS = ["--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "1"]


def make_workdir(path: Path, shards: int, shards_per_job: int = 1) -> Path:
    fresh_project(path)
    (path / "data/toy").mkdir(parents=True)
    wav = path / "data/toy/a.wav"
    shutil.copy2(ROOT / "data/demo/wav/cards-001.wav", wav)
    (path / "data/toy/wav.scp").write_text("".join(f"utt{i:04d} data/toy/a.wav\n" for i in range(shards * 10)))
    (path / "toy_bench.py").write_text(TOY_STAGE_MODULE)
    config = {"datasets": {"toy": {"path": "data/toy"}},
              "stages": {"upper": {"runner": "toy_bench.Runner", "provider": "toy_bench.Provider",
                                   "datasets": ["toy"], "sharding": {"shard_size": 10},
                                   "resources": {"mem_mb": 500, "runtime": 5}}}}
    if shards_per_job > 1:
        config["stages"]["upper"]["shards_per_job"] = shards_per_job
    (path / "config/config.yaml").write_text(yaml.safe_dump(config))
    return path


def timed(cmd: list[str], cwd: Path) -> tuple[float, str]:
    t0 = time.perf_counter()
    run = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if run.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{run.stderr[-3000:]}")
    return elapsed, run.stdout + run.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--shards-per-job", type=int, default=1)
    args = ap.parse_args()
    snakemake = ["timeout", "-k", "10", "900", sys.executable, "-m", "snakemake"]

    local_dir = make_workdir(WORK / "local", args.shards)
    local_wall, _ = timed([*snakemake, "--profile", "config/profiles/local", "--cores", "2"], local_dir)

    rows = [("local executor, whole run wall s", f"{local_wall:.1f}"),
            ("local wall s per shard", f"{local_wall / args.shards:.2f}")]
    groupings = [1] + ([args.shards_per_job] if args.shards_per_job > 1 else [])
    for k in groupings:
        slurm_dir = make_workdir(WORK / f"slurm{k}", args.shards, k)
        slurm_wall, out = timed([*snakemake, "--profile", "config/profiles/slurm", *FAST_STATUS], slurm_dir)
        job_ids = re.findall(r"submitted with SLURM jobid (\d+)", out)
        jobs = -(-args.shards // k) + 1  # the shard jobs and the canary
        assert len(job_ids) == jobs, out[-2000:]
        acct = subprocess.run(["sacct", "-X", "-n", "-P", "-j", ",".join(job_ids), "--format=JobID,ElapsedRaw,State"],
                              capture_output=True, text=True, check=True).stdout.split()
        elapsed = [int(line.split("|")[1]) for line in acct]
        work = []
        for done in sorted((slurm_dir / "results/upper/toy").glob("split.*/done")):
            record = json.loads(done.read_text())
            work.append(record["end"] - record["start"])
        what = "one SLURM job per shard" if k == 1 else f"shards_per_job {k}"
        rows += [(f"SLURM, {what}: SLURM jobs (canary included)", f"{len(job_ids)}"),
                 (f"SLURM, {what}: whole run wall s", f"{slurm_wall:.1f}"),
                 (f"SLURM, {what}: wall s per shard", f"{slurm_wall / args.shards:.2f}"),
                 (f"SLURM, {what}: job elapsed s (sacct), median", f"{statistics.median(elapsed):.1f}"),
                 (f"SLURM, {what}: cluster time s per shard (sum of job elapsed / shards)",
                  f"{sum(elapsed) / args.shards:.2f}"),
                 (f"SLURM, {what}: shard's own work s (done: end - start), median", f"{statistics.median(work):.3f}")]

    print(f"{args.shards} shards of 10 trivial items; cluster: 1 node, 2 CPUs; local: --cores 2\n")
    print("| measure | value |")
    print("|---|---:|")
    for name, value in rows:
        print(f"| {name} | {value} |")

if __name__ == "__main__":
    main()
