"""Benchmark (not a test): the built-in collect-stats stage end to end, one shard job's memory, and scaling.

Data: ``make_data`` of bench/fbank_stage.py, a Kaldi data dir of N keys cycling through the 10 demo wavs
(16 kHz, 3.4 s on average; absolute paths in wav.scp, utt2dur copied from data/demo). Snakeshard side: a
copy of Snakefile, workflow/ and config/ whose config has only the ``stats`` stage (CollectStatsRunner and
CollectStatsProvider, fbank frontend, 80 bins, mem_mb 2000). Three parts, chosen with ``--part``:

compare   N utterances (``--utts``), the stage with NO ``sharding:`` key, so the runner's default
          (shard_seconds 3600: ~1,060 keys a shard) applies. Timed: ``snakemake --profile
          config/profiles/local --cores 2`` from a clean state (results/ and .snakemake/ deleted before
          each run): parse, plan, canary, shard jobs, merge. Baseline: one Python process reading each wav
          with soundfile (int16 -> float32), running the same ``compute_fbank(samples, fbank_options(
          {"num_mel_bins": 80}, 16000))``, accumulating count, sum and sum_square of the frames (and of
          feats_lengths) in float64 per key, then across keys, and writing feats_stats.npz,
          feats_lengths_stats.npz and speech_shape. Runs are interleaved (the order alternates); the table
          gives medians of R runs (``--repeats``) and speedup = loop / snakeshard. A third case, two copies
          of the loop at once over the two halves of the keys, is the ceiling for 2 processes on this
          machine (2 vCPUs may share a physical core). Once, the script checks
          that results/stats/big/feats_stats.npz and feats_lengths_stats.npz hold the loop's count exactly
          and its sum and sum_square to <= 1e-12 relative (elementwise), and that speech_shape is identical.
rss       peak RSS of ONE shard job over a single shard (``sharding: {num_shards: 1}``) of each of
          ``--rss-sizes`` utterances (default 1,000 and 20,000). A dry run (``snakemake -n -p``) writes the
          plan (plan.json, split.0/keys) and prints the shard rule's shell command, ``"$SNAKESHARD_PYTHON"
          -m snakeshard run-shard --shard 0 ...``; that exact command then runs (``$SNAKESHARD_PYTHON`` =
          this interpreter) under a fresh helper Python per measurement, which reports
          ``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` (the shard process's peak; KiB on Linux).
scaling   end-to-end wall time of one clean run (as in compare, default sharding) for each of ``--sizes``
          (default 1,000, 10,000, 50,000 utterances), and seconds per 1,000 utterances.

Every ``snakemake`` process on this machine stalls ~10 s at start-up unless a SLURM controller answers (the
SLURM client tools are installed), so the script brings up the local single-node cluster
(../shared/tools/local-slurm/start.sh) before its first snakemake run and stops it (stop.sh) in a
``finally``. A controller that already answers is left alone: it is used and not stopped. With no SLURM
client tools installed nothing is started. The cluster's idle daemons run alongside the measurements.

    python bench/collect_stats.py [--part compare|rss|scaling|all] [--utts 10000] [--repeats 2]
                                  [--rss-sizes 1000 20000] [--sizes 1000 10000 50000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchlib import machine_info, rotated, timed_run
from dryrun_scale import REPO, copy_workflow
from fbank_stage import loop_fbanks, make_data, run_snakeshard

WORK = REPO / "bench" / "work" / "collect_stats"
LOCAL_SLURM = REPO.parent / "shared" / "tools" / "local-slurm"  # /work/shared/tools/local-slurm
DRYRUN = [sys.executable, "-m", "snakemake", "-n", "-p", "--cores", "2"]
MERGED = Path("results") / "stats" / "big"  # relative to a project dir
RELATIVE_TOLERANCE = 1e-12

CONFIG = """\
output_dir: results
datasets:
  big: {{path: {data}, format: kaldi}}
stages:
  stats:
    runner: snakeshard.stages.CollectStatsRunner
    provider: snakeshard.stages.CollectStatsProvider
    provider_config: {{num_mel_bins: 80}}
    datasets: [big]
    sample_rate: 16000
{sharding}    resources: {{mem_mb: 2000, runtime: 30, cpus_per_task: 1}}
"""

# Runs one command and prints its peak RSS (KiB): the largest ru_maxrss of the helper's children.
RSS_HELPER = """\
import json, resource, subprocess, sys
subprocess.run(json.loads(sys.argv[1]), check=True, stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


# -- set-up --

@contextlib.contextmanager
def local_slurm():
    """A SLURM controller answering for the duration (so snakemake does not stall ~10 s at start-up)."""
    if shutil.which("scontrol") is None:
        yield "no SLURM client tools: nothing to start"
        return
    if "is UP" in subprocess.run(["scontrol", "ping"], capture_output=True, text=True).stdout:
        yield "a SLURM controller was already up: used, left running"
        return
    subprocess.run(["bash", str(LOCAL_SLURM / "start.sh")], check=True, capture_output=True)
    try:
        yield f"started {LOCAL_SLURM}/start.sh for the runs, stopped afterwards"
    finally:
        subprocess.run(["bash", str(LOCAL_SLURM / "stop.sh")], capture_output=True)


def make_project(where: Path, n: int, sharding: str = "") -> Path:
    """where/project (workflow copy + config) over where/data/big of n keys; returns the project dir."""
    shutil.rmtree(where, ignore_errors=True)
    root = where / "project"
    copy_workflow(root)
    data = where / "data" / "big"
    make_data(data, n)
    (root / "config" / "config.yaml").write_text(CONFIG.format(data=data, sharding=sharding))
    return root


def plan_summary(root: Path) -> tuple[int, float]:
    """(shards, hours of audio) of the stage's plan in project root."""
    plan = json.loads((root / MERGED / "plan.json").read_text())
    return plan["num_shards"], plan["total_seconds"] / 3600


# -- the two sides --

def run_loop(data: Path, out: Path) -> tuple[float, float]:
    """(wall s, CPU s) of the sequential loop writing out/{feats_stats.npz, feats_lengths_stats.npz, speech_shape}."""
    import numpy as np

    from snakeshard.stages.collect_stats import stats_npz_bytes

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0, c0 = time.perf_counter(), time.process_time()
    count, total, square = 0, np.zeros(80), np.zeros(80)
    frames = np.zeros(3, dtype=np.float64)  # feats_lengths: count (utterances), sum, sum_square (frames)
    with open(out / "speech_shape", "w") as shapes:
        for key, samples, feats in loop_fbanks(data):
            feats = feats.astype(np.float64)
            count += len(feats)
            total += feats.sum(0)
            square += (feats * feats).sum(0)
            frames += (1, len(feats), len(feats) ** 2)
            shapes.write(f"{key} {len(samples)}\n")
    (out / "feats_stats.npz").write_bytes(stats_npz_bytes(count, total, square))
    (out / "feats_lengths_stats.npz").write_bytes(stats_npz_bytes(int(frames[0]), frames[1], frames[2]))
    return time.perf_counter() - t0, time.process_time() - c0


def run_two_loops(data: Path, out: Path) -> tuple[float, float]:
    """(wall s, CPU s) of two copies of the loop running at once, each over half the keys (no orchestration at
    all): the most any 2-process runner can get out of this machine for this work."""
    halves = []
    lines = (data / "wav.scp").read_text().splitlines(keepends=True)
    for i, part in enumerate((lines[:len(lines) // 2], lines[len(lines) // 2:])):
        half = out / f"data{i}"
        half.mkdir(parents=True, exist_ok=True)
        (half / "wav.scp").write_text("".join(part))
        halves.append(f'"{sys.executable}" "{__file__}" --loop {half} {out / f"out{i}"}')
    return timed_run(["sh", "-c", " & ".join(halves) + " & wait"], out, "two loops")


def check_equal(merged: Path, loop: Path) -> list[str]:
    """One line per file: count exact, sum and sum_square within RELATIVE_TOLERANCE; speech_shape identical."""
    import numpy as np

    lines = []
    for name in ("feats_stats.npz", "feats_lengths_stats.npz"):
        with np.load(merged / name) as m, np.load(loop / name) as ref:
            rel = max(float(np.max(np.abs(m[k] - ref[k]) / np.abs(ref[k]))) for k in ("sum", "sum_square"))
            ok = int(m["count"]) == int(ref["count"]) and rel <= RELATIVE_TOLERANCE
            lines.append(f"{'OK' if ok else 'FAILED'}: {name}: count {int(m['count'])} vs {int(ref['count'])}, "
                         f"max relative difference of sum/sum_square {rel:.2e} (tolerance {RELATIVE_TOLERANCE:g})")
    same = (merged / "speech_shape").read_text() == (loop / "speech_shape").read_text()
    lines.append(f"{'OK' if same else 'FAILED'}: speech_shape {'identical' if same else 'DIFFERS'}")
    return lines


# -- the parts --

def part_compare(utts: int, repeats: int) -> None:
    where = WORK / "compare"
    root = make_project(where, utts)
    data, loop_out = where / "data" / "big", where / "loop"
    runs = {"loop": [], "snakeshard": [], "two_loops": []}
    run = {"loop": lambda: run_loop(data, loop_out), "snakeshard": lambda: run_snakeshard(root),
           "two_loops": lambda: run_two_loops(data, where / "two_loops")}
    for rep in range(repeats):
        for side in rotated(runs, rep):
            r = run[side]()
            runs[side].append(r)
            print(f"  repeat {rep}: {side} {r[0]:.2f} s wall, {r[1]:.2f} s CPU", flush=True)
        if rep == 0:
            for line in check_equal(root / MERGED, loop_out):
                print(f"- check: {line}")

    shards, hours = plan_summary(root)
    med = {side: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
           for side, rs in runs.items()}
    print(f"\n**compare**: {utts:,} utterances ({hours:.1f} h of audio, {shards} shards: the runner's default "
          f"shard_seconds 3600), median of {repeats} interleaved runs (wall time of each run in brackets); "
          "CPU: the process (loop) or all of snakemake's child processes (snakeshard)\n")
    print("| case | wall s | CPU s | speedup (loop / case, wall) |")
    print("|---|---:|---:|---:|")
    for side, label in (("loop", "sequential Python loop"),
                        ("two_loops", "ceiling: two such loops at once, each over half the keys"),
                        ("snakeshard", "snakemake --profile config/profiles/local --cores 2")):
        each = ", ".join(f"{w:.2f}" for w, _ in runs[side])
        speed = "baseline" if side == "loop" else f"**{med['loop'][0] / med[side][0]:.2f}x**"
        print(f"| {label} | {med[side][0]:.2f} ({each}) | {med[side][1]:.2f} | {speed} |")
    print()


def shard_command(root: Path) -> list[str]:
    """The shard rule's command for shard 0, from a dry run (which also writes plan.json and split.0/keys)."""
    proc = subprocess.run(DRYRUN, cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"dry run failed in {root}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    lines = [line for line in (proc.stdout + proc.stderr).splitlines()
             if line.startswith("Shell command:") and " run-shard --shard 0 " in line]
    if len(lines) != 1:
        sys.exit(f"expected one shard 0 command in the dry run of {root}, found {len(lines)}")
    argv = shlex.split(lines[0].removeprefix("Shell command:"))
    return [sys.executable if a == "$SNAKESHARD_PYTHON" else a for a in argv]


def peak_rss_mb(argv: list[str], cwd: Path) -> tuple[float, float]:
    """(peak RSS in MB, wall s) of argv run to completion under a fresh helper process."""
    env = {**os.environ, "SNAKESHARD_PYTHON": sys.executable}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", RSS_HELPER, json.dumps(argv)], cwd=cwd, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"shard job failed in {cwd}:\n{proc.stderr[-5000:]}")
    return int(proc.stdout.split()[-1]) / 1024, wall


def part_rss(sizes: list[int]) -> None:
    rows = []
    for n in sizes:
        root = make_project(WORK / f"rss-{n}", n, sharding="    sharding: {num_shards: 1}\n")
        argv = shard_command(root)
        keys = (root / MERGED / "split.0" / "keys").read_text().splitlines()
        assert len(keys) == n, (n, len(keys))
        mb, wall = peak_rss_mb(argv, root)
        assert (root / MERGED / "split.0" / "done").exists(), root
        rows.append((n, mb, wall))
        print(f"  {n:,} utterances: peak RSS {mb:.1f} MB, {wall:.1f} s", flush=True)

    print("\n**rss**: peak RSS of one shard job (`python -m snakeshard run-shard`, the shard rule's command) "
          "over a single shard (`sharding: {num_shards: 1}`), fresh helper process per size, "
          "getrusage(RUSAGE_CHILDREN).ru_maxrss\n")
    print("| utterances in the shard | peak RSS MB | growth vs first | wall s |")
    print("|---:|---:|---:|---:|")
    for n, mb, wall in rows:
        growth = "-" if n == rows[0][0] else f"{mb - rows[0][1]:+.1f} MB ({mb / rows[0][1]:.2f}x)"
        print(f"| {n:,} | {mb:.1f} | {growth} | {wall:.1f} |")
    print()


def part_scaling(sizes: list[int]) -> None:
    rows = []
    for n in sizes:
        root = make_project(WORK / f"scaling-{n}", n)
        wall, cpu = run_snakeshard(root)
        shards, hours = plan_summary(root)
        rows.append((n, shards, hours, wall, cpu))
        print(f"  {n:,} utterances: {wall:.2f} s wall, {cpu:.2f} s CPU", flush=True)

    print("\n**scaling**: one clean `snakemake --profile config/profiles/local --cores 2` per size, the runner's "
          "default sharding (shard_seconds 3600)\n")
    print("| utterances | hours of audio | shards | wall s | CPU s | wall s per 1,000 utterances |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, shards, hours, wall, cpu in rows:
        print(f"| {n:,} | {hours:.1f} | {shards} | {wall:.2f} | {cpu:.2f} | {wall / n * 1000:.2f} |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("compare", "rss", "scaling", "all"), default="all")
    ap.add_argument("--utts", type=int, default=10_000, help="compare: utterances")
    ap.add_argument("--repeats", type=int, default=2, help="compare: interleaved runs of each side")
    ap.add_argument("--rss-sizes", type=int, nargs="+", default=[1_000, 20_000], help="rss: shard sizes")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 50_000], help="scaling: utterances")
    ap.add_argument("--loop", nargs=2, metavar=("DATA", "OUT"), help="internal: run one loop (two_loops case)")
    args = ap.parse_args()
    if args.loop:
        run_loop(Path(args.loop[0]), Path(args.loop[1]))
        return

    from importlib.metadata import version

    import numpy
    import snakemake

    versions = {"snakemake": snakemake.__version__, "numpy": numpy.__version__,
                "kaldi-native-fbank": version("kaldi-native-fbank")}
    print(f"- {machine_info(**versions)}")
    t0 = time.perf_counter()
    with local_slurm() as how:
        print(f"- SLURM controller: {how}", flush=True)
        if args.part in ("compare", "all"):
            part_compare(args.utts, args.repeats)
        if args.part in ("rss", "all"):
            part_rss(args.rss_sizes)
        if args.part in ("scaling", "all"):
            part_scaling(args.sizes)
    print(f"- whole script: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
