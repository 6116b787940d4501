"""Benchmark (not a test): the fixed cost of one shard job, against raw Snakemake `echo` jobs.

Two workflows of N jobs each, run with `--cores 2`:
  * snakeshard: the repository's workflow over a toy dataset of N keys, `shard_size: 1`, a toy
    runner whose forward upper-cases the key (so all cost is per job), local profile;
  * snakeshard_k<K> (only when named in --only, e.g. snakeshard_k10): the same N one-key shards with
    `shards_per_job: K`, so N/K jobs; snakeshard_auto: the default, `shards_per_job` left out (auto);
  * raw: a Snakefile of N rule instances `echo {i} > {output}` (plus `all`), with the local profile's
    scheduling options (greedy, subsample 100, keep-going);
  * raw_patched: the same with snakeshard's Snakemake patches applied (snakeshard/workflow/snakemake_patches.py),
    which snakeshard's workflow applies: the baseline without Snakemake's timer chains;
  * raw_python: raw_patched whose jobs run `python -c pass` (this interpreter): the floor for any
    job that is a Python process.
Each run is one `python -m snakemake` in a wrapper that records, at exit, the Snakemake process's
own CPU (the scheduler: RUSAGE_SELF) and its waited-for children's CPU (the jobs: RUSAGE_CHILDREN).
Cases are interleaved over R rounds; the table reports medians and ratios to raw of the same round.

    python bench/job_overhead.py [--jobs 1000 200] [--repeats 3] [--only snakeshard,raw,raw_patched,raw_python]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from benchlib import TOY_STAGE_MODULE, fresh_project, machine_info, rotated

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "work" / "job_overhead"
RAW = '''
N = int(config["n"])


rule all:
    input:
        expand("raw/{i}.txt", i=range(N)),


rule one:
    output:
        "raw/{i}.txt",
    shell:
        config.get("command", "echo {wildcards.i} > {output}")
'''
# Runs Snakemake's CLI in this process and, at exit, writes this process's CPU and its children's.
WRAPPER = '''
import atexit, json, resource, sys

OUT = sys.argv.pop(1)


def _report():
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(OUT, "w") as f:
        json.dump({"self": own.ru_utime + own.ru_stime, "children": kids.ru_utime + kids.ru_stime}, f)


atexit.register(_report)
sys.argv[0] = "snakemake"
from snakemake.cli import main
main()
'''


def snakeshard_dir(path: Path, n: int, shards_per_job: int | str = 1) -> Path:
    fresh_project(path)
    (path / "data/toy").mkdir(parents=True)
    (path / "data/toy/items.jsonl").write_text("".join(json.dumps({"key": f"k{i:06d}"}) + "\n" for i in range(n)))
    (path / "toy_bench.py").write_text(TOY_STAGE_MODULE)
    config = {"datasets": {"toy": {"path": "data/toy/items.jsonl", "format": "jsonl"}},
              "stages": {"echo": {"runner": "toy_bench.Runner", "provider": "toy_bench.Provider",
                                  "datasets": ["toy"], "sharding": {"shard_size": 1}}}}
    if shards_per_job != "auto":  # auto: the default, left out of the config
        config["stages"]["echo"]["shards_per_job"] = shards_per_job
    (path / "config/config.yaml").write_text(yaml.safe_dump(config))
    return path


def raw_dir(path: Path, n: int, patched: bool, python: bool) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    patch = "from snakeshard.workflow import snakemake_patches\n\nsnakemake_patches.apply()\n" if patched else ""
    (path / "Snakefile").write_text(patch + RAW)
    config = {"n": n}
    if python:
        config["command"] = f"{sys.executable} -c pass && echo {{wildcards.i}} > {{output}}"
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    return path


def run_case(case: str, n: int) -> dict:
    """One cold run of ``case`` over ``n`` jobs: wall s, scheduler CPU s, jobs' CPU s."""
    path = WORK / f"{case}-{n}"
    if case.startswith("snakeshard"):  # snakeshard (one job per shard), snakeshard_k<K> (K), snakeshard_auto
        snakeshard_dir(path, n, "auto" if case == "snakeshard_auto" else int(case.partition("_k")[2] or 1))
        args = ["--profile", "config/profiles/local", "--cores", "2"]
    else:
        raw_dir(path, n, patched=case != "raw", python=case == "raw_python")
        # the scheduling options of snakeshard's local profile, so the comparison is of jobs, not schedulers
        args = ["--cores", "2", "--configfile", "config.yaml", "--scheduler", "greedy", "--scheduler-subsample", "100",
                "--keep-going"]
    usage = path / "usage.json"
    t0 = time.perf_counter()
    # Bytecode is written and reused, as with a regular (non-editable) install, which pip compiles.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    proc = subprocess.run([sys.executable, "-c", WRAPPER, str(usage), *args], cwd=path, capture_output=True,
                          text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{case} over {n} jobs failed in {path}:\n{proc.stderr[-4000:]}")
    cpu = json.loads(usage.read_text())
    return {"wall": wall, "scheduler": cpu["self"], "jobs": cpu["children"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, nargs="+", default=[1000, 200])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="snakeshard,raw,raw_patched,raw_python")
    args = ap.parse_args()
    cases = args.only.split(",")
    import snakemake
    print(machine_info(snakemake=snakemake.__version__))
    for n in args.jobs:
        runs = {case: [] for case in cases}
        for rep in range(args.repeats):
            for case in rotated(cases, rep):
                runs[case].append(run_case(case, n))
                print(f"  n={n} {case} round {rep}: {runs[case][-1]}", file=sys.stderr)
        print(f"\n{n} jobs, --cores 2, median of {args.repeats} (per job: ms)\n")
        bases = [b for b in ("raw", "raw_patched") if b in cases]
        print("| case | wall s | wall ms/job | scheduler CPU ms/job | job CPU ms/job |"
              + "".join(f" wall / {b} | scheduler CPU / {b} |" for b in bases))
        print("|---|---:|---:|---:|---:|" + "---:|---:|" * len(bases))
        med = {case: {m: statistics.median(r[m] for r in runs[case]) for m in ("wall", "scheduler", "jobs")}
               for case in cases}
        for case in cases:
            m = med[case]
            ratios = "".join(f" {m['wall'] / med[b]['wall']:.2f} | {m['scheduler'] / med[b]['scheduler']:.2f} |"
                             for b in bases)
            print(f"| {case} | {m['wall']:.1f} | {1000 * m['wall'] / n:.1f} | {1000 * m['scheduler'] / n:.1f} | "
                  f"{1000 * m['jobs'] / n:.1f} |{ratios}")

if __name__ == "__main__":
    main()
