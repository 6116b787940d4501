"""Benchmark (not a test): silero-vad one utterance at a time vs padded batches by seconds.

Data: N speech utterances synthesized with flite (voices kal16, slt, rms, awb, in turn; random
sentences from a fixed word list, seeded), converted with ``sox -D in.wav -r 16000 -b 16 -c 1
out.wav pad 0.25 0.4`` (some silence around the speech) and kept when they last 2-8 s, in a Kaldi
data dir (wav.scp, utt2dur) under bench/work/vad_batching/data, reused by later runs of the same
N (``--rebuild`` makes it again). Without flite or sox, the 10 demo wavs are replicated instead.

Each case is the in-process call of the shard path, ``SileroVadRunner(provider, batch_seconds=S,
sort_by_length=...)(keys)`` without an output dir (results are returned, nothing is written), over
one provider whose env (dataset, TorchScript model, torch.set_num_threads(threads=1)) is built once
before any timing. Cases: one at a time (no batching: one forward call per key); batch_seconds 30
unsorted; 30 sorted by length; 60 sorted. One warm-up round is not counted, the order of the cases
rotates each round, the table gives items/s from the median of R runs and the speedup over one at
a time, and, against the one-at-a-time results, the largest absolute difference of speech_prob and
how many keys' ``speech`` segments differ.

    python bench/vad_batching.py [--utts 60] [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchlib import machine_info, rotated

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "bench" / "work" / "vad_batching"
DATA = WORK / "data"
DEMO = REPO / "data" / "demo"
VOICES = ["kal16", "slt", "rms", "awb"]
MIN_S, MAX_S = 2.0, 8.0
WORDS = ("the a of and to in that was he she it for on with as his her at by had from this which be "
         "morning evening garden letter house family sister brother window road river mountain "
         "quietly suddenly always never perhaps certainly walked talked wondered answered opened "
         "closed remembered believed returned arrived carriage dinner weather country village "
         "afternoon neighbour question reason moment pleasure doubt friend stranger journey").split()

CASES = {  # name -> SileroVadRunner options
    "one at a time": {},
    "batch_seconds 30, unsorted": {"batch_seconds": 30, "sort_by_length": False},
    "batch_seconds 30, sorted": {"batch_seconds": 30, "sort_by_length": True},
    "batch_seconds 60, sorted": {"batch_seconds": 60, "sort_by_length": True},
}


def synthesize(n: int) -> str:
    """wav.scp + utt2dur of n flite utterances of 2-8 s in DATA; returns how the data was made."""
    import soundfile

    (DATA / "wav").mkdir(parents=True)
    rng = random.Random(0)
    wav, dur = [], []
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.wav"
        i = tries = 0
        while i < n:
            tries += 1
            if tries > 10 * n:
                raise SystemExit(f"flite: only {i} of {n} utterances of {MIN_S}-{MAX_S} s after {tries} tries")
            voice = VOICES[i % len(VOICES)]
            target = rng.uniform(MIN_S + 0.5, MAX_S - 0.5)
            text = " ".join(rng.choice(WORDS) for _ in range(max(3, round(target * 2.6)))) + "."
            key = f"{voice}-{i:04d}"
            out = DATA / "wav" / f"{key}.wav"
            subprocess.run(["flite", "-voice", voice, "-t", text, "-o", str(raw)], check=True, capture_output=True)
            subprocess.run(["sox", "-D", str(raw), "-r", "16000", "-b", "16", "-c", "1", str(out),
                            "pad", "0.25", "0.4"], check=True, capture_output=True)
            seconds = soundfile.info(str(out)).duration
            if not MIN_S <= seconds <= MAX_S:
                out.unlink()
                continue
            wav.append(f"{key} {out}\n")
            dur.append(f"{key} {seconds:.4f}\n")
            i += 1
    (DATA / "wav.scp").write_text("".join(wav))
    (DATA / "utt2dur").write_text("".join(dur))
    return f"flite ({', '.join(VOICES)}) + sox, {tries} syntheses for {n} kept"


def replicate_demo(n: int) -> str:
    demo = [line.split(" ", 1) for line in (DEMO / "wav.scp").read_text().splitlines()]
    durs = dict(line.split() for line in (DEMO / "utt2dur").read_text().splitlines())
    DATA.mkdir(parents=True)
    wav, dur = [], []
    for i in range(n):
        orig, path = demo[i % len(demo)]
        wav.append(f"demo{i:04d}-{orig} {(REPO / path).resolve()}\n")
        dur.append(f"demo{i:04d}-{orig} {durs[orig]}\n")
    (DATA / "wav.scp").write_text("".join(wav))
    (DATA / "utt2dur").write_text("".join(dur))
    return "the 10 demo wavs, replicated (flite or sox not found)"


def make_data(n: int, rebuild: bool) -> str:
    scp = DATA / "wav.scp"
    if not rebuild and scp.is_file() and len(scp.read_text().splitlines()) == n:
        return f"reused {DATA}"
    shutil.rmtree(DATA, ignore_errors=True)
    if shutil.which("flite") and shutil.which("sox"):
        return synthesize(n)
    return replicate_demo(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--utts", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rebuild", action="store_true", help="synthesize the data again")
    args = ap.parse_args()

    import numpy as np
    import torch

    from snakeshard.io.batch import padding_ratio, plan_batches
    from snakeshard.stages.vad import SileroVadProvider, SileroVadRunner

    print(f"- {machine_info(torch=torch.__version__)}")
    how = make_data(args.utts, args.rebuild)
    keys = [line.split(" ", 1)[0] for line in (DATA / "wav.scp").read_text().splitlines()]
    provider = SileroVadProvider({"dataset": {"path": str(DATA), "format": "kaldi"}})
    t0 = time.perf_counter()
    env = provider.build_env_local()  # built once; every runner below reuses it
    lengths = [env["dataset"].duration(k) for k in keys]
    print(f"- data: {how}: {len(keys)} utterances, {sum(lengths):.1f} s of audio "
          f"({min(lengths):.2f}..{max(lengths):.2f} s each); model loaded in {time.perf_counter() - t0:.2f} s")

    times: dict[str, list[float]] = {name: [] for name in CASES}
    results: dict[str, list[dict]] = {}
    WORK.mkdir(parents=True, exist_ok=True)
    with open(WORK / "job.log", "w") as log, contextlib.redirect_stderr(log):  # the batch summary lines
        for rep in range(args.repeats + 1):  # round 0 warms up and is not counted
            for name in rotated(CASES, rep):
                runner = SileroVadRunner(provider, **CASES[name])
                t0 = time.perf_counter()
                out = runner(keys)
                elapsed = time.perf_counter() - t0
                if rep:
                    times[name].append(elapsed)
                results[name] = out

    ref = results["one at a time"]
    assert [r["key"] for r in ref] == keys
    found = sum(bool(r["speech"]) for r in ref)
    print(f"- one at a time found speech in {found} of {len(keys)} utterances "
          f"({sum(len(r['speech']) for r in ref)} segments)")
    print(f"\n{len(keys)} utterances ({sum(lengths):.1f} s of audio), 1 torch thread, median of {args.repeats} "
          "interleaved runs; differences are against one at a time\n")
    print("| case | batches | padding | median s | items/s | speedup | max abs diff speech_prob "
          "| keys with other segments |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = statistics.median(times["one at a time"])
    for name, opts in CASES.items():
        med = statistics.median(times[name])
        got = results[name]
        assert [r["key"] for r in got] == keys, name
        diff = max(float(np.max(np.abs(a["speech_prob"] - b["speech_prob"]))) for a, b in zip(got, ref))
        other = sum(a["speech"] != b["speech"] for a, b in zip(got, ref))
        if opts:
            batches = plan_batches(lengths, **opts)
            nb, pad = len(batches), f"{100 * padding_ratio(lengths, batches):.1f}%"
        else:
            nb, pad = len(keys), "0%"
        print(f"| {name} | {nb} | {pad} | {med:.3f} | {len(keys) / med:.1f} | {base / med:.2f}x "
              f"| {diff:.2e} | {other} |")


if __name__ == "__main__":
    main()
