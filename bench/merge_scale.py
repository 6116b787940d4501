"""Benchmark (not a test): merging 1,000,000 scp lines from 100 shards (validated) vs `cat` of the same fragments.

Setup (timed and printed, not part of the comparison): S shard dirs of K keys each, produced by
the real shard path, ``run_shard_dir`` with a runner returning ``{"feats": np.zeros(1, float32)}``,
so each ``split.N/`` holds what the default writers leave: ``keys``, ``feats.ark``, ``feats.scp``
(absolute ark paths) and a ``done`` whose ``fields`` record the scp's lines, bytes and CRC-32.
Compared, over the same fragments, with the page cache warm (each case runs once before timing):
  - ``merge_fragments(shard_dirs, out)``: reads every done, checks each scp's size and CRC-32, that
    its ark exists and that 3 ark records per shard read (kaldiio), then writes feats.scp (temp file,
    fsync, rename, fsync of the dir) and fields.json;
  - ``cat split.0/feats.scp ... split.{S-1}/feats.scp > out`` (subprocess, shell), in shard order;
  - the same ``cat`` followed by an fsync of its output (the merge fsyncs what it writes).
Runs are interleaved (the order rotates each round); the table gives medians of R runs and the
ratios to both cat baselines; every run's time is printed too. The script checks that the merged
feats.scp is byte for byte the cat output.

    python bench/merge_scale.py [--shards 100] [--keys-per-shard 10000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from benchlib import machine_info, rotated
from snakeshard import BaseRunner
from snakeshard.core.fingerprint import keys_text
from snakeshard.core.merge import merge_fragments
from snakeshard.core.shard import run_shard_dir

WORK = Path(__file__).resolve().parent / "work" / "merge_scale"
ZERO = np.zeros(1, dtype=np.float32)


class ZeroRunner(BaseRunner):
    @staticmethod
    def forward(key, *, zero):
        return {"feats": zero}


def build_shards(root: Path, shards: int, per_shard: int) -> list[Path]:
    dirs = []
    for s in range(shards):
        shard_dir = root / f"split.{s}"
        shard_dir.mkdir(parents=True)
        keys = [f"utt{s * per_shard + i:09d}" for i in range(per_shard)]
        (shard_dir / "keys").write_text(keys_text(keys), encoding="utf-8")
        run_shard_dir(ZeroRunner, {"zero": ZERO}, shard_dir, shard_id=s, fingerprint="x", progress=False)
        dirs.append(shard_dir)
    return dirs


def run_merge(shard_dirs: list[Path], out: Path) -> None:
    merge_fragments(shard_dirs, out)


def run_cat(shard_dirs: list[Path], out: Path, fsync: bool = False) -> None:
    cmd = "cat " + " ".join(shlex.quote(str(d / "feats.scp")) for d in shard_dirs)
    with open(out / "feats.scp", "wb") as f:
        subprocess.run(cmd, shell=True, stdout=f, check=True)
        if fsync:
            os.fsync(f.fileno())


CASES = {  # name -> (function, kwargs, output dir name)
    "cat > out": (run_cat, {}, "cat"),
    "cat > out, then fsync(out)": (run_cat, {"fsync": True}, "cat_fsync"),
    "merge_fragments (validated)": (run_merge, {}, "merge"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=100)
    ap.add_argument("--keys-per-shard", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    print(f"- {machine_info()}")
    shutil.rmtree(WORK, ignore_errors=True)
    t0 = time.perf_counter()
    shard_dirs = build_shards(WORK / "shards", args.shards, args.keys_per_shard)
    lines = args.shards * args.keys_per_shard
    size = sum((d / "feats.scp").stat().st_size for d in shard_dirs)
    print(f"- setup: {args.shards} shards x {args.keys_per_shard:,} keys through run_shard_dir in "
          f"{time.perf_counter() - t0:.1f} s; {lines:,} scp lines, {size / 1e6:.1f} MB of scp fragments")

    outs = {}
    for name, (_, _, sub) in CASES.items():
        outs[name] = WORK / "out" / sub
        outs[name].mkdir(parents=True)
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for rep in range(args.repeats + 1):  # round 0 warms the page cache and is not counted
        for name in rotated(CASES, rep):
            fn, kwargs, _ = CASES[name]
            t0 = time.perf_counter()
            fn(shard_dirs, outs[name], **kwargs)
            elapsed = time.perf_counter() - t0
            if rep:
                times[name].append(elapsed)
    merged = (outs["merge_fragments (validated)"] / "feats.scp").read_bytes()
    same = merged == (outs["cat > out"] / "feats.scp").read_bytes()
    count = merged.count(b"\n")
    print(f"- check: merged feats.scp {'is byte for byte' if same else 'DIFFERS from'} the cat output "
          f"({count:,} lines)")

    print(f"\n{lines:,} scp lines from {args.shards} shards, median of {args.repeats} interleaved runs "
          "(every run in brackets)\n")
    print("| case | median ms | runs ms | ratio to cat | ratio to cat + fsync |")
    print("|---|---:|---:|---:|---:|")
    cat, cat_fsync = (statistics.median(times[n]) for n in ("cat > out", "cat > out, then fsync(out)"))
    for name in CASES:
        med = statistics.median(times[name])
        each = ", ".join(f"{t * 1e3:.1f}" for t in times[name])
        print(f"| {name} | {med * 1e3:.1f} | {each} | {med / cat:.2f}x | {med / cat_fsync:.2f}x |")


if __name__ == "__main__":
    main()
