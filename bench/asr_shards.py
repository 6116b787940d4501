"""Benchmark (not a test): PocketSphinx ASR over N utterances, a plain loop vs snakeshard with 2 and 8 shards.

Data: ``make_data`` of bench/fbank_stage.py, a Kaldi data dir of N keys (``--utts``, default 200)
cycling through the 10 demo wavs (16 kHz, 3.4 s on average).
  * loop: one Python process (started fresh, its start-up and model load timed) that makes one decoder
    and, per key in wav.scp order, reads the wav (soundfile, int16) and decodes it
    (``snakeshard.demo.pocketsphinx_asr``: ``decode`` resets the decoder's feature state per utterance);
    writes ``key text`` lines;
  * ceiling: two copies of the loop at once, each over half of wav.scp (no orchestration at all): what
    2 processes can get on this machine;
  * shards2 / shards8 / default: the demo's ``asr`` stage alone (PocketsphinxRunner/Provider) with
    ``sharding: {num_shards: 2 or 8}``, or no sharding (the default), `snakemake --profile config/profiles/local --cores 2` from a clean
    state (parse, plan, canary, shard jobs, merge), everything included. ``--canary N`` sets the config's
    top-level ``canary`` (a job decoding the first N keys before the shard jobs start: a decoder load and
    N decodes on the critical path); without it the workflow's default holds (2 keys since the canary went on by
    default; 0, no canary work, in the runs RESULTS.md recorded before).
Rounds interleave the cases; each case's text is compared with the loop's, key by key (any difference is
printed: decoding must not depend on the shard layout). Reports median wall and the ratio to the loop.

    python bench/asr_shards.py [--utts 200] [--repeats 2] [--cases loop,ceiling,shards2,shards8,default] [--canary N]
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

import yaml

from benchlib import fresh_project, machine_info, rotated
from fbank_stage import make_data

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "work" / "asr_shards"
LOOP = '''
import sys
import soundfile
from snakeshard.demo.pocketsphinx_asr import decode, make_decoder

data, out = sys.argv[1], sys.argv[2]
decoder = make_decoder()
with open(f"{data}/wav.scp") as f, open(out, "w") as o:
    for line in f:
        key, path = line.split(maxsplit=1)
        samples, _ = soundfile.read(path.strip(), dtype="int16")
        o.write(f"{key} {decode(decoder, samples)}\\n")
'''


def stage_dir(path: Path, data: Path, shards: int | None, canary: int | None) -> Path:
    fresh_project(path)
    full = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    asr = {**full["stages"]["asr"], "datasets": ["big"], "sharding": {"num_shards": shards}}
    if shards is None:  # the default: no sharding in the config
        del asr["sharding"]
    config = {"datasets": {"big": {"path": str(data)}}, "stages": {"asr": asr}}
    if canary is not None:
        config["canary"] = canary
    (path / "config/config.yaml").write_text(yaml.safe_dump(config))
    return path


def texts(path: Path) -> dict:
    return dict((line.split(" ", 1) + [""])[:2] for line in path.read_text().splitlines())


def run_ceiling(data: Path, env: dict) -> tuple[float, dict]:
    """Two loops at once, over the two halves of wav.scp."""
    lines = (data / "wav.scp").read_text().splitlines(keepends=True)
    halves = [lines[: len(lines) // 2], lines[len(lines) // 2:]]
    procs = []
    t0 = time.perf_counter()
    for n, half in enumerate(halves):
        part = WORK / f"half{n}"
        part.mkdir(exist_ok=True)
        (part / "wav.scp").write_text("".join(half))
        procs.append(subprocess.Popen([sys.executable, "-c", LOOP, str(part), str(part / "out.txt")], env=env))
    if any(p.wait() for p in procs):
        sys.exit("ceiling: a loop failed")
    wall = time.perf_counter() - t0
    return wall, {**texts(WORK / "half0/out.txt"), **texts(WORK / "half1/out.txt")}


def run_case(case: str, data: Path, env: dict, canary: int | None) -> tuple[float, dict]:
    if case == "ceiling":
        return run_ceiling(data, env)
    if case == "loop":
        out = WORK / "loop.txt"
        cmd, cwd, result = [sys.executable, "-c", LOOP, str(data), str(out)], WORK, out
    else:
        cwd = stage_dir(WORK / case, data, None if case == "default" else int(case.removeprefix("shards")), canary)
        cmd = [sys.executable, "-m", "snakemake", "--profile", "config/profiles/local", "--cores", "2"]
        result = cwd / "results/asr/big/text"
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{case} failed:\n{proc.stderr[-4000:]}")
    return wall, texts(result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--utts", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cases", default="loop,ceiling,shards2,shards8")
    ap.add_argument("--canary", type=int, default=None, help="the config's canary keys (default: the profile's, 0)")
    args = ap.parse_args()
    from importlib.metadata import version

    import snakemake

    print(machine_info(snakemake=snakemake.__version__, pocketsphinx=version("pocketsphinx")))
    shutil.rmtree(WORK, ignore_errors=True)
    data = WORK / "data"
    make_data(data, args.utts)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    cases = args.cases.split(",")
    walls = {case: [] for case in cases}
    reference = None
    for rep in range(args.repeats):
        for case in rotated(cases, rep):
            wall, hyps = run_case(case, data, env, args.canary)
            walls[case].append(wall)
            if case == "loop":
                reference = reference or hyps
            print(f"  round {rep} {case}: {wall:.1f} s", file=sys.stderr)
            if reference and case != "loop":
                differ = sorted(k for k in reference if hyps.get(k) != reference[k])
                print(f"  {case}: {len(differ)} of {len(reference)} keys decoded differently from the loop"
                      + (f": {differ[:5]}" if differ else ""), file=sys.stderr)
    loop = statistics.median(walls["loop"]) if walls.get("loop") else float("nan")
    if walls.get("ceiling"):
        for case in cases:
            per_round = [w / c for w, c in zip(walls[case], walls["ceiling"])]
            print(f"{case} / ceiling, per round: " + ", ".join(f"{r:.3f}" for r in per_round))
    canary = "the profile's (0)" if args.canary is None else args.canary
    print(f"\n{args.utts} utterances, --cores 2, canary {canary}, median of {args.repeats}\n")
    print("| case | wall s | wall / loop |")
    print("|---|---:|---:|")
    for case in cases:
        w = statistics.median(walls[case])
        print(f"| {case} | {w:.1f} | {w / loop:.2f} |")


if __name__ == "__main__":
    main()
