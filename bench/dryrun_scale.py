"""Benchmark (not a test): `snakemake -n` with N shards, snakeshard workflow vs a raw Snakefile.

Snakeshard side: a copy of Snakefile, workflow/ and config/ with a Kaldi data dir of N
keys (all pointing at one wav) and one stage sharded with ``shard_size: 1`` -> N shard
jobs + merge. The first run plans (writes N split.N/keys files) and is reported as
"cold"; warm runs reuse plan.json. Raw side: N trivial jobs, each with an input file,
a log and a lambda param, plus a merge rule over all N outputs. Warm runs of both
sides are interleaved; the table gives medians and the ratio snakeshard / raw.

    python bench/dryrun_scale.py [--sizes 1000 10000] [--repeats 3] [--shards-per-job K]

``--shards-per-job 1``: one job per shard, as before ``shards_per_job: auto`` became the default (which groups
these one-key shards 32 to a job, so the plan holds 32x fewer jobs).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

from benchlib import timed_run

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "bench" / "work" / "dryrun"
WAV = REPO / "data" / "demo" / "wav" / "cards-001.wav"
DRYRUN = [sys.executable, "-m", "snakemake", "-n", "--cores", "2", "-q"]

SNAKESHARD_CONFIG = """\
output_dir: results
datasets:
  bench: {path: data/bench, format: kaldi}
stages:
  asr:
    runner: snakeshard.demo.asr.PocketsphinxRunner
    provider: snakeshard.demo.asr.PocketsphinxProvider
    datasets: [bench]
    sharding: {shard_size: 1}
"""

RAW_SNAKEFILE = """\
N = {n}

rule all:
    input: "out/merged"

rule merge:
    input: expand("out/{i}/done", i=range(N))
    output: "out/merged"
    shell: "touch {output}"

rule job:
    input: "in/{i}/keys"
    output: "out/{i}/done"
    log: "logs/{i}.log"
    params: p=lambda w: "x"
    shell: "echo hi > {output}"
"""


def copy_workflow(root: Path, source: Path = REPO) -> None:
    """A project dir ``root`` with the Snakefile, workflow/ and config/ of ``source`` (a checkout)."""
    root.mkdir(parents=True)
    for name in ("Snakefile", "workflow", "config"):
        src = source / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, root / name)


def make_snakeshard(root: Path, n: int, shards_per_job: str | None = None) -> None:
    copy_workflow(root)
    extra = f"    shards_per_job: {shards_per_job}\n" if shards_per_job else ""
    (root / "config" / "config.yaml").write_text(SNAKESHARD_CONFIG + extra)
    data = root / "data" / "bench"
    (data / "wav").mkdir(parents=True)
    shutil.copy2(WAV, data / "wav" / WAV.name)
    (data / "wav.scp").write_text("".join(f"utt{i:07d} data/bench/wav/{WAV.name}\n" for i in range(n)))


def make_raw(root: Path, n: int) -> None:
    root.mkdir(parents=True)
    (root / "Snakefile").write_text(RAW_SNAKEFILE.replace("{n}", str(n)))
    for i in range(n):
        (root / "in" / str(i)).mkdir(parents=True)
        (root / "in" / str(i) / "keys").write_text(f"utt{i:07d}\n")


def dryrun(root: Path) -> tuple[float, float]:
    """(wall s, CPU s) of one `snakemake -n`; CPU time is less sensitive to other load on the machine."""
    return timed_run(DRYRUN, root, "snakemake -n")


def bench_size(n: int, repeats: int, shards_per_job: str | None = None) -> dict:
    ss, raw = WORK / f"snakeshard_{n}", WORK / f"raw_{n}"
    shutil.rmtree(ss, ignore_errors=True)
    shutil.rmtree(raw, ignore_errors=True)
    make_snakeshard(ss, n, shards_per_job)
    make_raw(raw, n)
    cold = dryrun(ss)  # plans: writes plan.json and N split.N/keys
    assert len(list((ss / "results" / "asr" / "bench").glob("split.*/keys"))) == n
    dryrun(raw)  # warm-up, not counted
    runs = {"snakeshard": [], "raw": []}
    for _ in range(repeats):
        runs["raw"].append(dryrun(raw))
        runs["snakeshard"].append(dryrun(ss))
    med = {(side, i): statistics.median(r[i] for r in rs) for side, rs in runs.items() for i in (0, 1)}
    return {"cold": cold, "med": med, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shards-per-job", help="the stage's shards_per_job (default: the config's default)")
    args = ap.parse_args()

    rows = []
    for n in args.sizes:
        r = bench_size(n, args.repeats, args.shards_per_job)
        (raw_wall, ss_wall), (raw_cpu, ss_cpu) = [(r["med"]["raw", i], r["med"]["snakeshard", i]) for i in (0, 1)]
        each = {side: ", ".join(f"{wall:.2f}" for wall, _ in r["runs"][side]) for side in r["runs"]}
        rows.append(f"| {n:,} | {raw_wall:.2f} ({each['raw']}) | {ss_wall:.2f} ({each['snakeshard']}) "
                    f"| **{ss_wall / raw_wall:.2f}x** | {raw_cpu:.2f} | {ss_cpu:.2f} | {ss_cpu / raw_cpu:.2f}x "
                    f"| {r['cold'][0]:.2f} |")
    print(f"`snakemake -n --cores 2 -q`, seconds; warm: median of {args.repeats} interleaved runs "
          "(wall time of each run in brackets)\n")
    print("| shards | raw wall s | snakeshard wall s | wall ratio | raw CPU s | snakeshard CPU s | CPU ratio "
          "| snakeshard cold wall s (plans) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
