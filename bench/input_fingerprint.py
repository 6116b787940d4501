"""Benchmark (not a test): what the input fingerprint costs at parse time, and what fsync costs a shard.

1. Parse: `snakemake -n` over a Kaldi data dir of N keys (wav.scp, text, utt2spk), each key its own
   audio path (hard links to one small wav, so N distinct directory entries to stat), sharded by
   ``shard_size: 1000``. Three sides, interleaved, warm (plan.json cached, page cache warm):
   - before: the workflow and library of commit BEFORE (shard fingerprint = stage + keys),
     run from a `git worktree` with PYTHONPATH pointing at its src/;
   - after: this tree (records + audio identity, i.e. one stat per audio file per parse);
   - after, `fingerprint: {audio: false}`: this tree with the documented opt-out.
   Cold runs (first parse: reads the data and plans) are reported once per side.
2. fsync: in-process `run_shard` over shards of K keys writing 2 fields, with the real os.fsync vs a
   no-op, interleaved; the difference per shard is what durability costs.

    python bench/input_fingerprint.py [--sizes 10000 100000] [--repeats 5] [--before 59314ae]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dryrun_scale import DRYRUN, REPO, WAV, copy_workflow  # bench/ is on sys.path when run as a script

WORK = REPO / "bench" / "work" / "input_fingerprint"

CONFIG = """\
output_dir: results
datasets:
  bench: {{path: data/bench, format: kaldi}}
stages:
  asr:
    runner: snakeshard.demo.asr.PocketsphinxRunner
    provider: snakeshard.demo.asr.PocketsphinxProvider
    datasets: [bench]
    sharding: {{shard_size: 1000}}
{extra}"""


def make_data(data: Path, n: int) -> None:
    """N keys, each with its own audio path (a hard link), a text and a speaker."""
    (data / "wav").mkdir(parents=True)
    for i in range(n):
        path = data / "wav" / f"u{i:07d}.wav"
        if i % 50_000 == 0:  # a fresh copy now and then: ext4 allows 65,000 links per inode
            first = path
            shutil.copy2(WAV, first)
        else:
            os.link(first, path)
    (data / "wav.scp").write_text("".join(f"u{i:07d} data/bench/wav/u{i:07d}.wav\n" for i in range(n)))
    (data / "text").write_text("".join(f"u{i:07d} some words for utterance {i}\n" for i in range(n)))
    (data / "utt2spk").write_text("".join(f"u{i:07d} spk{i % 100}\n" for i in range(n)))


def make_project(root: Path, source: Path, data: Path, extra: str = "") -> None:
    copy_workflow(root, source)
    (root / "config" / "config.yaml").write_text(CONFIG.format(extra=extra))
    (root / "data").mkdir()
    (root / "data" / "bench").symlink_to(data)


def dryrun(root: Path, env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(DRYRUN, cwd=root, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"snakemake -n failed in {root}:\n{proc.stdout}\n{proc.stderr}")
    return time.perf_counter() - t0


def bench_parse(n: int, repeats: int, before_src: Path) -> dict:
    base = WORK / str(n)
    shutil.rmtree(base, ignore_errors=True)
    make_data(base / "data", n)
    sides = {
        "before": (base / "before", before_src, ""),
        "after": (base / "after", REPO, ""),
        "after, audio: false": (base / "after_noaudio", REPO, "    fingerprint: {audio: false}\n"),
    }
    envs, cold, runs = {}, {}, {}
    for name, (root, source, extra) in sides.items():
        make_project(root, source, base / "data", extra)
        envs[name] = {**os.environ, "PYTHONPATH": str(source / "src")}
        cold[name] = dryrun(root, envs[name])
        runs[name] = []
    for _ in range(repeats):
        for name, (root, _, _) in sides.items():
            runs[name].append(dryrun(root, envs[name]))
    return {"cold": cold, "runs": runs}


def bench_fsync(keys: int, shards: int) -> dict:
    """Seconds per shard of run_shard with real fsync and with fsync as a no-op, interleaved."""
    sys.path.insert(0, str(REPO / "src"))
    from snakeshard import BaseRunner
    from snakeshard.core.shard import run_shard

    class Runner(BaseRunner):
        @staticmethod
        def forward(key):
            return {"text": key.upper(), "score": 0.5}

    real = os.fsync
    names = [f"u{i:07d}" for i in range(keys)]
    root = WORK / "fsync"
    shutil.rmtree(root, ignore_errors=True)
    times = {"fsync": [], "no fsync": []}
    for i in range(shards):
        for mode in times:
            os.fsync = real if mode == "fsync" else (lambda fd: None)
            t0 = time.perf_counter()
            run_shard(Runner, {}, names, root / mode / f"split.{i}", progress=False)
            times[mode].append(time.perf_counter() - t0)
    os.fsync = real
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10000, 100000])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--before", default="59314ae", help="commit before the input fingerprint")
    ap.add_argument("--fsync-shards", type=int, default=40)
    args = ap.parse_args()

    before = WORK / "before_tree"
    if not before.exists():
        WORK.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=REPO, check=True,
                       capture_output=True)
    print(f"`snakemake -n --cores 2 -q`, seconds; warm: median of {args.repeats} interleaved runs (each run in "
          "brackets); cold: first parse (reads the data, plans)\n")
    print("| keys | side | warm wall s | vs before | cold wall s |")
    print("|---:|---|---:|---:|---:|")
    for n in args.sizes:
        r = bench_parse(n, args.repeats, before)
        base = statistics.median(r["runs"]["before"])
        for side, runs in r["runs"].items():
            med = statistics.median(runs)
            each = ", ".join(f"{t:.2f}" for t in runs)
            print(f"| {n:,} | {side} | {med:.2f} ({each}) | {med / base:.2f}x | {r['cold'][side]:.2f} |")
    print()
    for keys in (1, 1000):
        t = bench_fsync(keys, args.fsync_shards)
        on, off = statistics.median(t["fsync"]), statistics.median(t["no fsync"])
        print(f"run_shard, {keys} key(s), 2 fields, median of {args.fsync_shards} shards: with fsync "
              f"{on * 1000:.1f} ms, without {off * 1000:.1f} ms: fsync costs {(on - off) * 1000:.1f} ms per shard")


if __name__ == "__main__":
    main()
