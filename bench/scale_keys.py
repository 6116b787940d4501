"""Benchmark (not a test): what a dataset's size costs the driver and one shard job.

A JSON Lines dataset of N keys (10k, 100k, 1M; each record a key and a 60-character text), one
stage sharded into shards of 10,000 keys, a toy provider that calls ``load_dataset`` (as the
README's example does) and a forward that records when it saw its first key. Per size:
  * ``snakemake -n`` cold (plans: writes split.N/keys and items.json) and warm (plan reused):
    wall s and the driver's peak RSS;
  * the first shard's job, started as the rule starts it (the command `snakemake -n -p` prints):
    peak RSS and time from its start to its first item.
Shard jobs hold 10,000 keys whatever N is, so what grows with N is what the slicing failed to cut.

    python bench/scale_keys.py [--sizes 10000 100000 1000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import yaml

from benchlib import fresh_project, machine_info, measured

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "work" / "scale_keys"
TOY = '''
import os
import time

from snakeshard import BaseRunner, EnvironmentProvider
from snakeshard.core.data import load_dataset

FIRST = []


class Provider(EnvironmentProvider):
    def build_env_local(self):
        return {"dataset": load_dataset(self.config["dataset"])}


class Runner(BaseRunner):
    @staticmethod
    def forward(key, dataset):
        if not FIRST:
            FIRST.append(time.time())
            with open(os.environ["FIRST_ITEM_FILE"], "w") as f:
                f.write(repr(FIRST[0]))
        return {"chars": len(dataset[key]["text"])}
'''


def make_dir(path: Path, n: int) -> Path:
    fresh_project(path)
    with open(path / "items.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"key": f"utt{i:07d}", "text": f"the words of utterance number {i:07d} " * 2}) + "\n")
    (path / "toy_keys.py").write_text(TOY)
    config = {"canary": 0, "datasets": {"big": {"path": "items.jsonl", "format": "jsonl"}},
              "stages": {"count": {"runner": "toy_keys.Runner", "provider": "toy_keys.Provider",
                                   "datasets": ["big"], "sharding": {"shard_size": 10000}}}}
    (path / "config/config.yaml").write_text(yaml.safe_dump(config))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10000, 100000, 1000000])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import snakemake

    print(machine_info(snakemake=snakemake.__version__))
    dry = [sys.executable, "-m", "snakemake", "-n", "-p", "--cores", "1"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    rows = []
    for n in args.sizes:
        cold, warm, job_rss, first = [], [], [], []
        for rep in range(args.repeats):
            wd = make_dir(WORK / f"n{n}", n)
            cold.append(measured(dry, wd, env)[:2])
            warm_run = measured(dry, wd, env)
            warm.append(warm_run[:2])
            command = next(m.group(1) for m in re.finditer(r'"\$SNAKESHARD_PYTHON" (-m snakeshard run-shard .*)',
                                                          warm_run[2]) if "--shard 0 " in m.group(1))
            job_env = {**env, "SNAKESHARD_PYTHON": sys.executable, "FIRST_ITEM_FILE": str(wd / "first_item")}
            t0 = time.time()
            wall, rss, _ = measured([sys.executable, *command.split()], wd, job_env)
            job_rss.append(rss)
            first.append(float((wd / "first_item").read_text()) - t0)
            print(f"  n={n} round {rep}: cold {cold[-1]}, warm {warm[-1]}, job rss {rss:.0f} MB, "
                  f"first item {first[-1]:.3f} s, job wall {wall:.2f} s", file=sys.stderr)
        med = lambda xs: statistics.median(xs)  # noqa: E731
        rows.append((n, med(c[0] for c in cold), med(c[1] for c in cold), med(w[0] for w in warm),
                     med(w[1] for w in warm), med(job_rss), med(first)))
    print(f"\nshards of 10,000 keys; median of {args.repeats}\n")
    print("| dataset keys | `-n` cold s | cold driver RSS MB | `-n` warm s | warm driver RSS MB | "
          "shard job peak RSS MB | job start to first item s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n, cw, cr, ww, wr, rss, fi in rows:
        print(f"| {n:,} | {cw:.2f} | {cr:.0f} | {ww:.2f} | {wr:.0f} | {rss:.0f} | {fi:.3f} |")


if __name__ == "__main__":
    main()
