"""Benchmark (not a test): per-item overhead of the shard path vs a bare Python loop.

A trivial forward over N keys, through ``snakeshard.core.shard.run_shard_dir`` (what a shard
job runs once its env is built: progress bar on, stderr going to a log file) and through a
bare loop that writes the same files (``text``, and a ``done`` with the same fields,
keys digest included). Both read the keys from ``<dir>/keys``.
Runs are interleaved; the table reports the median of R runs and its ratio to the
baseline of the same kind (per-item or batched) measured in the same run.

    python bench/in_shard_overhead.py [--items 100000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import hashlib
import socket
import contextlib
import json
import shutil
import statistics
import time
from pathlib import Path

from benchlib import case_dirs, rotated
from snakeshard import BaseRunner
from snakeshard.core.shard import run_shard_dir

WORK = Path(__file__).resolve().parent / "work" / "in_shard"
ENV = {"suffix": "x"}


def forward(key, *, suffix):
    return {"text": key + suffix}


def forward_batch(keys, *, suffix):
    return [{"text": k + suffix} for k in keys]


class ItemRunner(BaseRunner):
    forward = staticmethod(forward)


class BatchRunner(BaseRunner):
    forward = staticmethod(forward_batch)


def bare_loop(shard_dir: Path, batch_size: int | None = None) -> None:
    """A hand-written loop producing the same two files: ``text``, and a ``done`` with the same fields."""
    raw = (shard_dir / "keys").read_bytes()
    keys = raw.decode("utf-8").split("\n")[:-1]
    started = time.time()
    with open(shard_dir / "text", "w", encoding="utf-8") as f:
        if not batch_size:
            for key in keys:
                f.write(f"{key} {forward(key, **ENV)['text']}\n")
        else:
            for i in range(0, len(keys), batch_size):
                batch = keys[i:i + batch_size]
                for key, result in zip(batch, forward_batch(batch, **ENV)):
                    f.write(f"{key} {result['text']}\n")
    done = {"shard": 0, "items": len(keys), "keys_digest": hashlib.sha256(raw).hexdigest()[:20], "fingerprint": "x",
            "fragments": ["text"], "start": round(started, 3), "end": round(time.time(), 3),
            "host": socket.gethostname(), "snakeshard": "bare"}
    (shard_dir / "done").write_text(json.dumps(done, indent=1) + "\n")


def shard_path(shard_dir: Path, batch_size: int | None = None, progress: bool = True) -> None:
    """What `snakeshard run-shard` does once the env is built."""
    runner = BatchRunner if batch_size else ItemRunner
    run_shard_dir(runner, dict(ENV), shard_dir, shard_id=0, fingerprint="x", batch_size=batch_size,
                  progress=progress)


# name -> (function, kwargs, name of the baseline it is compared with)
CASES = {
    "bare loop": (bare_loop, {}, None),
    "run_shard, progress=True": (shard_path, {}, "bare loop"),
    "run_shard, progress=False": (shard_path, {"progress": False}, "bare loop"),
    "bare loop, batches of 64": (bare_loop, {"batch_size": 64}, None),
    "run_shard, batch_size=64, progress=True": (shard_path, {"batch_size": 64}, "bare loop, batches of 64"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    shutil.rmtree(WORK, ignore_errors=True)
    keys = [f"spk{i // 100:04d}-utt{i:07d}" for i in range(args.items)]
    dirs = case_dirs(WORK, CASES, keys)

    times: dict[str, list[float]] = {name: [] for name in CASES}
    with open(WORK / "job.log", "w") as log, contextlib.redirect_stderr(log):  # like `> {log} 2>&1`
        for rep in range(args.repeats + 1):  # round 0 warms up and is not counted
            for name in rotated(CASES, rep):
                fn, kwargs, _ = CASES[name]
                t0 = time.perf_counter()
                fn(dirs[name], **kwargs)
                elapsed = time.perf_counter() - t0
                if rep:
                    times[name].append(elapsed)
    for name in CASES:  # both sides wrote the same text file
        assert (dirs[name] / "text").read_text() == (dirs["bare loop"] / "text").read_text(), name

    print(f"{args.items:,} items, median of {args.repeats} interleaved runs (min..max in brackets)\n")
    # On a shared 2-core machine the minimum is the steadier estimate; both are shown.
    print("| case | median ms | min..max ms | ratio of medians | ratio of minimums |")
    print("|---|---:|---:|---:|---:|")
    for name, (_, _, base) in CASES.items():
        med, low = statistics.median(times[name]), min(times[name])
        if base:
            ratios = f"{med / statistics.median(times[base]):.2f}x | {low / min(times[base]):.2f}x"
        else:
            ratios = "baseline | baseline"
        print(f"| {name} | {med * 1e3:.1f} | {low * 1e3:.1f}..{max(times[name]) * 1e3:.1f} | {ratios} |")


if __name__ == "__main__":
    main()
