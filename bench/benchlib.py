"""What every benchmark script here shares: the machine line, timed commands, interleaved rounds.

Scripts are run as ``python bench/<name>.py`` from the repository root, so ``bench/`` is on sys.path.
"""

from __future__ import annotations

import datetime
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A toy stage for benchmarks of the fixed costs: the provider builds nothing, forward upper-cases the key.
TOY_STAGE_MODULE = '''
from snakeshard import BaseRunner, EnvironmentProvider


class Provider(EnvironmentProvider):
    def build_env_local(self):
        return {}


class Runner(BaseRunner):
    @staticmethod
    def forward(key):
        return {"text": key.upper()}
'''


def fresh_project(path: Path) -> Path:
    """``path``, emptied, holding a copy of the repository's Snakefile, workflow/ and config/."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    for part in ("Snakefile", "workflow", "config"):
        (shutil.copytree if (REPO / part).is_dir() else shutil.copy2)(REPO / part, path / part)
    return path


def machine_info(**versions: str) -> str:
    """Date, cores, CPU model, Python, the given library versions, load average: the line each result records."""
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    libs = "".join(f", {name} {version}" for name, version in versions.items())
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{datetime.datetime.now():%Y-%m-%d %H:%M}, nproc {os.cpu_count()}, CPU {cpu}, "
            f"Python {platform.python_version()}{libs}, load average {load}")


def cpu_children() -> float:
    """CPU seconds (user + system) of all child processes waited for so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def timed_run(cmd: list[str], cwd, what: str) -> tuple[float, float]:
    """(wall s, CPU s of it and its children) of one run of ``cmd`` in ``cwd``; exits naming ``what`` if it fails."""
    t0, c0 = time.perf_counter(), cpu_children()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, cpu_children() - c0
    if proc.returncode != 0:
        sys.exit(f"{what} failed in {cwd}:\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}")
    return wall, cpu


def rotated(names, rep: int) -> list:
    """``names`` rotated by ``rep``: interleaved rounds run the cases in a different order each time."""
    names = list(names)
    k = rep % len(names)
    return names[k:] + names[:k]


def case_dirs(work: Path, cases, keys: list[str]) -> dict:
    """name -> ``work/case<N>``, one fresh shard dir per case, each holding ``keys`` as a shard's keys file."""
    from snakeshard.core.fingerprint import keys_text

    dirs = {}
    for n, name in enumerate(cases):
        dirs[name] = Path(work) / f"case{n}"
        dirs[name].mkdir(parents=True)
        (dirs[name] / "keys").write_text(keys_text(keys), encoding="utf-8")
    return dirs


def measured(cmd: list[str], cwd, env=None) -> tuple[float, float, str]:
    """(wall s, peak RSS MB of the process, its stdout and stderr) of one run of ``cmd``; exits if it fails."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(cmd)} failed in {cwd}:\n{out[-4000:]}")
    return wall, usage.ru_maxrss / 1024, out
