"""Benchmark (not a test): the CPU of one one-key shard job, for one or more checkouts, against `python -c pass`.

For each checkout (``--code NAME=ROOT``, ROOT a repository root: its ``src`` goes on PYTHONPATH, its Snakefile,
workflow/ and config/ make the project), a project of 10 one-key shards of the toy stage is planned with
``snakemake -n -p``; shard 5's exact command (``python -m snakeshard run-shard ...``) is then run R times,
alternated with ``python -c pass`` and the other checkouts' jobs, so load from other processes hits every case
alike. CPU is the child's rusage (user + system); the table gives medians. Bytecode is written and reused (as
for a pip install, which compiles it). Run it with the interpreter of the install to measure: an editable
install's finder imports pathlib at every start-up, a regular install does not.

    python bench/job_cpu.py --code before=/tmp/wt-before --code after=. [--runs 50]
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import yaml
from benchlib import TOY_STAGE_MODULE, machine_info

WORK = Path(__file__).resolve().parent / "work" / "job_cpu"


def _env(root: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}
    if root is not None:
        env["PYTHONPATH"] = str(root / "src")
    return env


def project(name: str, root: Path) -> tuple[Path, list[str]]:
    """A planned project of 10 one-key shards made with ``root``'s workflow; shard 5's job command."""
    path = WORK / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    for part in ("Snakefile", "workflow", "config"):
        (shutil.copytree if (root / part).is_dir() else shutil.copy2)(root / part, path / part)
    (path / "data/toy").mkdir(parents=True)
    (path / "data/toy/items.jsonl").write_text("".join(f'{{"key": "k{i:06d}"}}\n' for i in range(10)))
    (path / "toy_bench.py").write_text(TOY_STAGE_MODULE)
    config = {"datasets": {"toy": {"path": "data/toy/items.jsonl", "format": "jsonl"}},
              "stages": {"echo": {"runner": "toy_bench.Runner", "provider": "toy_bench.Provider",
                                  "datasets": ["toy"], "sharding": {"shard_size": 1}}}}
    (path / "config/config.yaml").write_text(yaml.safe_dump(config))
    dry = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "--profile", "config/profiles/local",
                          "--cores", "2"], cwd=path, env=_env(root), capture_output=True, text=True, check=False)
    if dry.returncode != 0:
        sys.exit(f"snakemake -n in {path} failed:\n{dry.stderr[-3000:]}")
    line = next(x for x in dry.stdout.splitlines() if "run-shard --shard 5 " in x)
    return path, shlex.split(line.split("-m snakeshard ", 1)[1])


def cpu_ms(cmd: list[str], cwd: Path, env: dict) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"{cmd} failed in {cwd}:\n{proc.stderr[-3000:]}")
    return 1000 * (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--code", action="append", required=True, help="NAME=ROOT (a checkout's repository root)")
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()
    print(machine_info())
    codes = {name: Path(root).resolve() for name, _, root in (c.partition("=") for c in args.code)}
    cases = {"python -c pass": (Path.cwd(), [sys.executable, "-c", "pass"], _env(None))}
    for name, root in codes.items():
        path, job = project(name, root)
        cases[f"one-key job, {name}"] = (path, [sys.executable, "-m", "snakeshard", *job], _env(root))
    for cwd, cmd, env in cases.values():  # warm-up: bytecode written, files cached
        cpu_ms(cmd, cwd, env)
    runs = {case: [] for case in cases}
    for _ in range(args.runs):
        for case, (cwd, cmd, env) in cases.items():
            runs[case].append(cpu_ms(cmd, cwd, env))
    bare = statistics.median(runs["python -c pass"])
    print(f"\nCPU ms, median of {args.runs} alternated runs (min in brackets)\n")
    print("| case | CPU ms | less `python -c pass` |")
    print("|---|---:|---:|")
    for case, values in runs.items():
        m = statistics.median(values)
        print(f"| {case} | {m:.1f} ({min(values):.1f}) | {m - bare:.1f} |")


if __name__ == "__main__":
    main()
