"""Benchmark (not a test): planning a big manifest in the Snakemake driver, cold and warm (issue 29).

A JSON Lines manifest of N keys, one line per key: ``{"key": "utt0000001", "duration": 4.37}`` (durations
drawn from a fixed seed, 1-10 s). One stage with ``sharding: {shard_size: 10000}`` (N / 10,000 shard jobs in
the DAG) and the bench toy runner. Per size:
  * ``snakemake -n --cores 1`` cold (plans: reads the manifest, writes split.N/keys and items.json), warm
    (plan reused), and appended (1% more lines at the manifest's end: only they are read): wall s and the
    driver's peak RSS (``wait4``);
  * ``--planner-only``: ``ensure_plan`` alone in a fresh process, the new planner and, for sizes up to
    ``--reference-max``, the planner before it streamed (tests/reference_plan.py: the whole manifest as
    ``Item`` objects), wall s and peak RSS;
  * one more cold ``snakemake -n`` (the plan removed), its memory in all processes (the driver and the planner's
    forked workers: the sum of their PSS, sampled every 0.1 s; the sampling slows it, so its time is not used).

``--workers N`` sets SNAKESHARD_PLAN_WORKERS for every run (1: plan in the driver alone); unset, the default.
``--rich``: lines as a corpus's manifest has them (an audio path, a text, a speaker: ~150 bytes, not 42).
``--default-sharding``: the stage sets no ``sharding`` (the default, core/plan.py ``DEFAULT_SHARDING``: 8 shards),
and the planner alone plans that too.

    python bench/plan_scale.py [--sizes 1000000 3000000 10000000] [--repeats 1] [--reference-max 1000000]
                               [--workers N] [--rich] [--default-sharding]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from benchlib import TOY_STAGE_MODULE, fresh_project, machine_info, measured

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "work" / "plan_scale"
PLAN_ALONE = '''
import json, resource, sys, time
sys.path.insert(0, {tests!r})
t0 = time.perf_counter()
sharding = {sharding!r}
if sys.argv[1] == "reference":
    from reference_plan import reference_files
    reference_files({{"path": sys.argv[2], "format": "jsonl"}}, sharding)
else:
    from snakeshard.core.plan import ensure_plan
    ensure_plan(sys.argv[3], {{"path": sys.argv[2], "format": "jsonl"}}, sharding)
print(json.dumps([time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]))
'''


WAVS = sorted(str(p) for p in (ROOT / "data/demo/wav").glob("*.wav"))
WORDS = "the of and to in he was that it his her with as had for you on not".split()


def manifest(n: int, rich: bool = False) -> Path:
    """The N-key manifest, written once and reused across runs (bench/work is not in git). ``rich``: each line
    also has an absolute audio path (the 10 demo recordings in turn: each is checked to exist), a text of 3-12
    words and a speaker, as a corpus's manifest has (~150 bytes a line instead of 42)."""
    path = WORK / f"manifest-{'rich-' * rich}{n}.jsonl"
    if not path.exists():
        rng = random.Random(0)
        WORK.mkdir(parents=True, exist_ok=True)
        with open(f"{path}.tmp", "w") as f:
            for i in range(n):
                duration = round(rng.uniform(1, 10), 2)
                if rich:
                    text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 13)))
                    f.write(json.dumps({"key": f"utt{i:09d}", "audio": WAVS[i % len(WAVS)], "duration": duration,
                                        "text": text, "speaker": f"spk{i % 2000:04d}"}) + "\n")
                else:
                    f.write(f'{{"key": "utt{i:09d}", "duration": {duration}}}\n')
        os.replace(f"{path}.tmp", path)
    return path


def project(n: int, rich: bool = False, sharding: dict | None = None) -> Path:
    """The bench's project over the N-key manifest; ``sharding`` None: the stage sets none (the default)."""
    wd = fresh_project(WORK / f"n{n}{'-rich' * rich}{'-default' * (sharding is None)}")
    (wd / "toy_stage.py").write_text(TOY_STAGE_MODULE)
    shutil.copyfile(manifest(n, rich), wd / "items.jsonl")  # its own copy: the appended case writes to it
    config = {"canary": 0, "datasets": {"big": {"path": "items.jsonl", "format": "jsonl"}},
              "stages": {"count": {"runner": "toy_stage.Runner", "provider": "toy_stage.Provider",
                                   "datasets": ["big"], **({"sharding": sharding} if sharding else {})}}}
    (wd / "config/config.yaml").write_text(yaml.safe_dump(config))
    return wd


def peak_pss(cmd: list[str], cwd) -> float:
    """The peak of the summed PSS (MB) of ``cmd``'s process and its children, sampled every 0.1 s."""
    import time

    import psutil

    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    top, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            peak = max(peak, sum(p.memory_full_info().pss for p in [top, *top.children(recursive=True)]))
        except psutil.Error:  # a worker gone between the listing and the reading
            pass
        time.sleep(0.1)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed in {cwd}")
    return peak / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000000, 3000000, 10000000])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--reference-max", type=int, default=1000000)
    ap.add_argument("--workers", help="SNAKESHARD_PLAN_WORKERS for every run (unset: the default)")
    ap.add_argument("--rich", action="store_true", help="manifests with audio paths, text and speakers")
    ap.add_argument("--default-sharding", action="store_true", help="no sharding in the config: the default")
    args = ap.parse_args()
    from snakeshard.core.plan import DEFAULT_SHARDING

    sharding = None if args.default_sharding else {"shard_size": 10000}
    print(f"sharding: {sharding or f'none set (the default, {DEFAULT_SHARDING})'}")
    if args.workers:
        os.environ["SNAKESHARD_PLAN_WORKERS"] = args.workers
    print(f"SNAKESHARD_PLAN_WORKERS={os.environ.get('SNAKESHARD_PLAN_WORKERS', '(unset)')}")
    import snakemake

    print(machine_info(snakemake=snakemake.__version__))
    dry = [sys.executable, "-m", "snakemake", "-n", "--cores", "1", "-q"]
    alone = [sys.executable, "-c", PLAN_ALONE.format(tests=str(ROOT / "tests"), sharding=sharding or DEFAULT_SHARDING)]
    raw = WORK / "raw"  # snakemake's own start: one rule, nothing to plan
    raw.mkdir(parents=True, exist_ok=True)
    (raw / "Snakefile").write_text('rule all:\n    output: "x"\n    shell: "touch {output}"\n')
    floor = sorted(measured(dry, raw)[0] for _ in range(3))[1]
    print(f"raw `snakemake -n` of a one-rule Snakefile (median of 3): {floor:.2f} s\n")
    print("| keys | manifest MB | `-n` cold s | cold RSS MB | `-n` warm s | warm RSS MB | `-n` after +1% s | its RSS MB "
          "| planner alone s (µs/key) | its RSS MB | planner before s | its RSS MB | cold, all processes' PSS MB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.sizes:
        for _ in range(args.repeats):
            path = manifest(n, args.rich)
            wd = project(n, args.rich, sharding)
            cold = measured(dry, wd)
            warm = measured(dry, wd)
            with open(wd / "items.jsonl", "a") as f:
                f.writelines(f'{{"key": "more{i:09d}", "duration": 2.5}}\n' for i in range(n // 100))
            appended = measured(dry, wd)
            shutil.rmtree(WORK / "alone", ignore_errors=True)
            new = json.loads(measured([*alone, "new", str(path), str(WORK / "alone")], WORK)[2].splitlines()[-1])
            old = ["-", "-"]
            if n <= args.reference_max:
                old = json.loads(measured([*alone, "reference", str(path)], WORK)[2].splitlines()[-1])
                old = [f"{old[0]:.2f}", f"{old[1]:.0f}"]
            shutil.rmtree(wd / "results")
            pss = peak_pss(dry, wd)
            print(f"| {n:,} | {path.stat().st_size / 1e6:.0f} | {cold[0]:.2f} | {cold[1]:.0f} | {warm[0]:.2f} | "
                  f"{warm[1]:.0f} | {appended[0]:.2f} | {appended[1]:.0f} | {new[0]:.2f} ({new[0] / n * 1e6:.2f}) | "
                  f"{new[1]:.0f} | {old[0]} | {old[1]} | {pss:.0f} |", flush=True)


if __name__ == "__main__":
    main()
