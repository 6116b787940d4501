"""Benchmark (not a test): the typed ark writer through the shard path vs the same kaldiio writes in a bare loop.

N small float32 arrays (shape (10, 8), deterministic, built in memory before any timing) keyed
by ``<dir>/keys``. Shard side: ``run_shard_dir(Runner, {"arrays": ...}, dir, shard_id=0,
fingerprint="x", progress=True)`` with stderr sent to a log file as in a job, where
``forward(key, *, arrays) -> {"feats": arrays[key]}``: the default writers (FieldWriters ->
ArkField) write ``feats.ark`` + ``feats.scp`` with ``kaldiio.save_ark``, after a NaN/inf check of
each array; at close they fsync the ark and the scp and the shard writes ``done`` (fsync'd, by
rename) with the scp's size and CRC-32. Baseline: a loop that reads ``keys``, opens feats.ark and
feats.scp and, per key, calls ``kaldiio.save_ark(ark, {key: array})`` and writes the scp line
itself (same bytes); a second baseline adds an fsync of both files at close. One warm-up round is
not counted; the order of the cases rotates each round; the table reports the median of R runs
and the ratio to the bare loop measured in the same run. The script checks that every case wrote
the same ark bytes and scp lines.

    python bench/typed_writer.py [--items 100000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import time
from pathlib import Path

import kaldiio
import numpy as np

from benchlib import case_dirs, machine_info, rotated
from snakeshard import BaseRunner
from snakeshard.core.shard import run_shard_dir

WORK = Path(__file__).resolve().parent / "work" / "typed_writer"
SHAPE = (10, 8)


class ArrayRunner(BaseRunner):
    @staticmethod
    def forward(key, *, arrays):
        return {"feats": arrays[key]}


def bare_loop(shard_dir: Path, arrays: dict, fsync: bool = False) -> None:
    """The same kaldiio writes by hand: feats.ark, and feats.scp lines ``key /abs/feats.ark:offset``."""
    keys = (shard_dir / "keys").read_bytes().decode("utf-8").split("\n")[:-1]
    ark_path = (shard_dir / "feats.ark").absolute()
    with open(ark_path, "wb") as ark, open(shard_dir / "feats.scp", "w", encoding="utf-8") as scp:
        for key in keys:
            start = ark.tell()
            kaldiio.save_ark(ark, {key: arrays[key]})
            scp.write(f"{key} {ark_path}:{start + len(key.encode()) + 1}\n")
        if fsync:
            ark.flush()
            os.fsync(ark.fileno())
            scp.flush()
            os.fsync(scp.fileno())


def shard_path(shard_dir: Path, arrays: dict) -> None:
    """What `snakeshard run-shard` does once the env is built."""
    run_shard_dir(ArrayRunner, {"arrays": arrays}, shard_dir, shard_id=0, fingerprint="x", progress=True)


CASES = {  # name -> (function, kwargs); ratios are to "bare loop"
    "bare loop": (bare_loop, {}),
    "bare loop, fsync at close": (bare_loop, {"fsync": True}),
    "run_shard (typed writers), progress=True": (shard_path, {}),
}


def scp_offsets(shard_dir: Path) -> list[str]:
    """The scp lines without the directory part of the ark path (each case writes into its own dir)."""
    return [f"{k} {Path(v).name}" for k, v in (line.split(" ", 1) for line in
                                                (shard_dir / "feats.scp").read_text().splitlines())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    print(f"- {machine_info(numpy=np.__version__)}")
    shutil.rmtree(WORK, ignore_errors=True)
    keys = [f"spk{i // 100:04d}-utt{i:07d}" for i in range(args.items)]
    data = np.random.default_rng(0).standard_normal((args.items, *SHAPE)).astype(np.float32)
    arrays = dict(zip(keys, data))  # C-contiguous (10, 8) views of one block
    dirs = case_dirs(WORK, CASES, keys)

    times: dict[str, list[float]] = {name: [] for name in CASES}
    with open(WORK / "job.log", "w") as log, contextlib.redirect_stderr(log):  # like `> {log} 2>&1`
        for rep in range(args.repeats + 1):  # round 0 warms up and is not counted
            for name in rotated(CASES, rep):
                fn, kwargs = CASES[name]
                t0 = time.perf_counter()
                fn(dirs[name], arrays, **kwargs)
                elapsed = time.perf_counter() - t0
                if rep:
                    times[name].append(elapsed)
    base = dirs["bare loop"]
    for name in CASES:  # every case wrote the same records
        assert (dirs[name] / "feats.ark").read_bytes() == (base / "feats.ark").read_bytes(), name
        assert scp_offsets(dirs[name]) == scp_offsets(base), name
    probe = kaldiio.load_scp(str(dirs[list(CASES)[-1]] / "feats.scp"))
    assert np.array_equal(probe[keys[-1]], arrays[keys[-1]])
    print("- check: all cases wrote identical feats.ark bytes and feats.scp offsets")

    print(f"\n{args.items:,} float32 arrays of shape {SHAPE}, median of {args.repeats} interleaved runs "
          "(min..max in brackets)\n")
    print("| case | median ms | min..max ms | us per item | ratio of medians | ratio of minimums |")
    print("|---|---:|---:|---:|---:|---:|")
    bmed, bmin = statistics.median(times["bare loop"]), min(times["bare loop"])
    for name in CASES:
        med, low = statistics.median(times[name]), min(times[name])
        ratios = "baseline | baseline" if name == "bare loop" else f"{med / bmed:.2f}x | {low / bmin:.2f}x"
        print(f"| {name} | {med * 1e3:.1f} | {low * 1e3:.1f}..{max(times[name]) * 1e3:.1f} "
              f"| {med / args.items * 1e6:.2f} | {ratios} |")
    print("\nThe shard path also clears and claims the dir, checks each array for NaN/inf, fsyncs feats.ark and "
          "feats.scp at close, reads the scp back for its CRC-32, and writes done (fsync'd, renamed).")


if __name__ == "__main__":
    main()
