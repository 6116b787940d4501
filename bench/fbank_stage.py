"""Benchmark (not a test): the fbank stage end to end with Snakemake vs a plain sequential loop.

Data: a Kaldi data dir of N keys (``demo000000-<orig>`` ...) cycling through the 10 demo wavs
(absolute paths in wav.scp, plus utt2dur copied from data/demo so nothing reads 10k headers).
Snakeshard side: a copy of Snakefile, workflow/ and config/ whose config has only the ``fbank``
stage (FbankRunner, 80 bins, ``batch_size: null``, ``sharding: {shard_size: 1000}``) over that dir;
timed: ``snakemake --profile config/profiles/local --cores 2`` from a clean state (results/ and
.snakemake/ deleted before each run): parse, plan, canary, shard jobs, merge.
Baseline: one Python process reading each wav with soundfile (int16 -> float32), running the same
``compute_fbank(samples, fbank_options({"num_mel_bins": 80}, 16000))`` and writing feats.ark/scp
(kaldiio.WriteHelper) and utt2num_frames. Runs are interleaved (the order alternates); the table
gives medians of R runs and speedup = loop / snakeshard. Once, the script checks that the merged
feats.scp and the loop's hold equal matrices for a sample of 50 keys.

    python bench/fbank_stage.py [--utts 10000] [--shard-size 1000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchlib import machine_info, timed_run
from dryrun_scale import REPO, copy_workflow

WORK = REPO / "bench" / "work" / "fbank_stage"
DEMO = REPO / "data" / "demo"
SNAKEMAKE = [sys.executable, "-m", "snakemake", "--profile", "config/profiles/local", "--cores", "2"]

CONFIG = """\
output_dir: results
datasets:
  big: {{path: {data}, format: kaldi}}
stages:
  fbank:
    runner: snakeshard.stages.fbank.FbankRunner
    provider: snakeshard.stages.fbank.FbankProvider
    provider_config: {{num_mel_bins: 80}}
    datasets: [big]
    sample_rate: 16000
    batch_size: null
    sharding: {{shard_size: {shard_size}}}
    resources: {{mem_mb: 1000, runtime: 10, cpus_per_task: 1}}
"""


def make_data(data: Path, n: int) -> None:
    """wav.scp (absolute paths), utt2spk and utt2dur of n keys cycling through the demo wavs."""
    demo = [line.split(" ", 1) for line in (DEMO / "wav.scp").read_text().splitlines()]
    durs = dict(line.split() for line in (DEMO / "utt2dur").read_text().splitlines())
    data.mkdir(parents=True)
    wav, spk, dur = [], [], []
    for i in range(n):
        orig, path = demo[i % len(demo)]
        key = f"demo{i:06d}-{orig}"
        wav.append(f"{key} {(REPO / path).resolve()}\n")
        spk.append(f"{key} demo{i:06d}\n")
        dur.append(f"{key} {durs[orig]}\n")
    (data / "wav.scp").write_text("".join(wav))
    (data / "utt2spk").write_text("".join(spk))
    (data / "utt2dur").write_text("".join(dur))


def loop_fbanks(data: Path):
    """(key, samples, feats) per line of data/wav.scp, as the baseline loops compute them: soundfile int16
    read, then the stage's own ``compute_fbank`` (80 bins, 16 kHz)."""
    import soundfile

    from snakeshard.stages.fbank import compute_fbank, fbank_options

    opts = fbank_options({"num_mel_bins": 80}, 16000)
    with open(data / "wav.scp") as f:
        entries = [line.rstrip("\n").split(" ", 1) for line in f]
    for key, path in entries:
        samples, rate = soundfile.read(path, dtype="int16")
        assert rate == 16000, (key, rate)
        yield key, samples, compute_fbank(samples.astype("float32"), opts)


def run_snakeshard(root: Path) -> tuple[float, float]:
    """(wall s, CPU s of all child processes) of one clean `snakemake --profile config/profiles/local --cores 2`."""
    for name in ("results", ".snakemake"):
        shutil.rmtree(root / name, ignore_errors=True)
    return timed_run(SNAKEMAKE, root, "snakemake")


def run_loop(data: Path, out: Path) -> tuple[float, float]:
    """(wall s, CPU s) of the sequential loop writing out/{feats.ark, feats.scp, utt2num_frames}."""
    import kaldiio

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0, c0 = time.perf_counter(), time.process_time()
    with kaldiio.WriteHelper(f"ark,scp:{out / 'feats.ark'},{out / 'feats.scp'}") as writer, \
            open(out / "utt2num_frames", "w") as frames:
        for key, _, feats in loop_fbanks(data):
            writer(key, feats)
            frames.write(f"{key} {len(feats)}\n")
    return time.perf_counter() - t0, time.process_time() - c0


def check_equal(merged_scp: Path, loop_scp: Path, sample: int = 50) -> str:
    import kaldiio
    import numpy as np

    merged, loop = kaldiio.load_scp(str(merged_scp)), kaldiio.load_scp(str(loop_scp))
    if list(merged.keys()) != list(loop.keys()):
        return f"FAILED: key lists differ ({len(merged)} merged vs {len(loop)} loop keys)"
    keys = random.Random(0).sample(list(loop.keys()), min(sample, len(loop)))
    bad = [k for k in keys if not np.array_equal(merged[k], loop[k])]
    if bad:
        return f"FAILED: {len(bad)} of {len(keys)} sampled keys differ, e.g. {bad[:3]}"
    return f"OK: same {len(loop)} keys in the same order; {len(keys)} sampled matrices np.array_equal"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--utts", type=int, default=10_000)
    ap.add_argument("--shard-size", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import snakemake

    print(f"- {machine_info(snakemake=snakemake.__version__)}")
    shutil.rmtree(WORK, ignore_errors=True)
    root = WORK / "project"
    copy_workflow(root)
    data = WORK / "data" / "big"
    make_data(data, args.utts)
    (root / "config" / "config.yaml").write_text(CONFIG.format(data=data, shard_size=args.shard_size))
    loop_out = WORK / "loop"

    runs = {"loop": [], "snakeshard": []}
    for rep in range(args.repeats):
        order = ["loop", "snakeshard"] if rep % 2 == 0 else ["snakeshard", "loop"]
        for side in order:
            r = run_loop(data, loop_out) if side == "loop" else run_snakeshard(root)
            runs[side].append(r)
            print(f"  repeat {rep}: {side} {r[0]:.2f} s wall, {r[1]:.2f} s CPU", flush=True)
        if rep == 0:
            merged = root / "results" / "fbank" / "big"
            print(f"- check: {check_equal(merged / 'feats.scp', loop_out / 'feats.scp')}")
            same = (merged / "utt2num_frames").read_text() == (loop_out / "utt2num_frames").read_text()
            print(f"- check: utt2num_frames {'identical' if same else 'DIFFER'}")

    shards = -(-args.utts // args.shard_size)
    med = {side: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
           for side, rs in runs.items()}
    print(f"\n{args.utts:,} utterances ({shards} shards of <= {args.shard_size}), median of {args.repeats} "
          "interleaved runs (wall time of each run in brackets); CPU: the process (loop) or all of "
          "snakemake's child processes (snakeshard)\n")
    print("| case | wall s | CPU s | speedup (loop / case, wall) |")
    print("|---|---:|---:|---:|")
    for side, label in (("loop", "sequential Python loop"),
                        ("snakeshard", "snakemake --profile config/profiles/local --cores 2")):
        each = ", ".join(f"{w:.2f}" for w, _ in runs[side])
        speed = "baseline" if side == "loop" else f"**{med['loop'][0] / med[side][0]:.2f}x**"
        print(f"| {label} | {med[side][0]:.2f} ({each}) | {med[side][1]:.2f} | {speed} |")


if __name__ == "__main__":
    main()
