"""Shared fixtures: a copy of the workflow in a temp dir, and real `snakemake` runs in it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

PROJECT = Path(__file__).resolve().parents[1]
WORKFLOW_PARTS = ("Snakefile", "workflow", "config", "data")

# A tiny runner/provider for workflow tests that need many items fast; the shard job imports it
# from the workflow directory (`python -m snakeshard` puts the working directory on sys.path).
TOY_MODULE = '''
import os
import time

from snakeshard import BaseRunner, EnvironmentProvider
from snakeshard import load_dataset


class ToyProvider(EnvironmentProvider):
    def build_env_local(self):
        # allocate_mb: hold this much touched memory for the whole job (to trigger memory limits)
        self.ballast = b"\\x01" * (int(self.config.get("allocate_mb", 0)) * 1024 * 1024)
        return {
            "dataset": load_dataset(self.config["dataset"]),
            "fail_on_keys": set(self.config.get("fail_on_keys", [])),
            "item_delay": float(self.config.get("item_delay", 0)),
            "suffix": self.config.get("suffix", ""),
        }


class UpperRunner(BaseRunner):
    @staticmethod
    def forward(key, *, dataset, fail_on_keys, item_delay, suffix):
        if key in fail_on_keys:
            raise RuntimeError(f"asked to fail on {key}")
        if item_delay:
            time.sleep(item_delay)
        return {"text": key.upper() + suffix, "audio": dataset[key]["audio"]}
'''


# The suite runs on parallel workers (pytest-xdist, `--dist loadscope` in pyproject.toml's addopts): a worker takes
# a whole module at a time, so a module-scoped fixture runs once, and the SLURM tests (all in test_slurm.py) never
# queue on the one-node cluster beside each other.
def pytest_collection_modifyitems(config, items):
    # The SLURM tests first: their module is the longest (~18 of the 26-29 minutes here, mostly waiting on the
    # cluster), and modules are handed out in this order (`--no-loadscope-reorder`), so the others run beside it,
    # not after it.
    items.sort(key=lambda item: not item.get_closest_marker("slurm"))


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n logical` (pyproject.toml's addopts): one worker more than the CPUs. The SLURM module's worker spends most
    of its time waiting on the cluster (its jobs' status is polled every second), and other tests wait on sleeps
    and kills; a third worker fills those waits on 2 cores."""
    import psutil

    return (psutil.cpu_count(logical=True) or 1) + 1


def pytest_configure(config):
    # Once, in the process that starts the workers (they have `workerinput`), before any test runs: installing a
    # package while other workers' snakemake runs import the plugin registry would race them.
    if not hasattr(config, "workerinput"):
        install_slurm_extra_when_a_cluster_answers()


def slurm_cluster_up() -> bool:
    if not shutil.which("sinfo"):
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


# The `slurm` extra (the executor plugins) lives here, outside the venv, and only the snakemake runs that use the
# slurm profile see it (`slurm_env`). Snakemake imports every executor plugin it can find at each start, and this
# one imports pandas: in the venv, every local snakemake run of the suite paid ~0.46 s of CPU for it
# (bench/RESULTS.md section 24); here the local runs are what a user without the extra runs.
SLURM_EXTRA = PROJECT / "build" / "slurm-extra"


def slurm_extra_available() -> bool:
    """The slurm plugin is importable with ``slurm_env()``: in SLURM_EXTRA, or installed in the venv by hand."""
    import importlib.util

    return ((SLURM_EXTRA / "snakemake_executor_plugin_slurm" / "__init__.py").is_file()
            or importlib.util.find_spec("snakemake_executor_plugin_slurm") is not None)


def slurm_env() -> dict:
    """The environment for a snakemake run with the slurm profile: SLURM_EXTRA on PYTHONPATH (a SLURM job inherits
    it: the plugin submits with --export=ALL, and the job's own snakemake needs the jobstep plugin)."""
    import os

    path = os.pathsep.join(filter(None, [str(SLURM_EXTRA), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def install_slurm_extra_when_a_cluster_answers() -> None:
    """The `slurm` extra, installed into SLURM_EXTRA when a cluster answers and the plugin is nowhere: the plugins
    (``snakemake-executor-plugin-*``) there, their other requirements (pandas, ...) into the venv, where they cost
    nothing until imported. The README's commands do not install it, so that local runs never load it."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement

    if slurm_extra_available() or not slurm_cluster_up():
        return
    # the extra's requirements as pyproject.toml pins them (not `-e .[slurm]`: that would reinstall snakeshard)
    wanted = tomllib.loads((PROJECT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["slurm"]
    staging = SLURM_EXTRA.with_name(SLURM_EXTRA.name + ".partial")  # renamed when complete: a cut install is redone
    shutil.rmtree(staging, ignore_errors=True)
    plugins, others, done = list(wanted), [], set()
    while plugins:  # the plugins with --no-deps, then what they require: plugins here, the rest to the venv
        pip_install("--target", str(staging), "--no-deps", *plugins)
        done.update(Requirement(r).name for r in plugins)
        plugins = []
        for dist in importlib.metadata.distributions(path=[str(staging)]):
            for line in dist.requires or ():
                req = Requirement(line)
                if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                    continue
                if req.name.startswith("snakemake-executor-plugin-"):
                    if req.name not in done:
                        plugins.append(line)
                        done.add(req.name)
                elif line not in others:
                    others.append(line)
    if others:
        pip_install(*others)
    shutil.rmtree(SLURM_EXTRA, ignore_errors=True)
    staging.rename(SLURM_EXTRA)


def pip_install(*args: str) -> None:
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args],
                             capture_output=True, text=True, timeout=600)
    if install.returncode != 0:
        raise pytest.UsageError(f"installing the slurm extra failed (pip install {' '.join(args)}):\n"
                                + install.stderr[-3000:])


def run_snakemake(workdir: Path, *args: str, timeout: int = 600, profile: str = "local") -> subprocess.CompletedProcess:
    """Run the real snakemake CLI in ``workdir`` with a profile; returns the completed process (never raises)."""
    cmd = [sys.executable, "-m", "snakemake", "--profile", f"config/profiles/{profile}", "--cores", "2", *args]
    return subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=timeout,
                          env=slurm_env() if profile == "slurm" else None)


def run_cli(workdir: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakeshard", *args], cwd=workdir, capture_output=True,
                          text=True, timeout=timeout)


def read_config(workdir: Path) -> dict:
    return yaml.safe_load((workdir / "config/config.yaml").read_text())


def write_config(workdir: Path, config: dict) -> None:
    (workdir / "config/config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def shard_process(workdir: Path, shard: int):
    """The `snakeshard run-shard` process of ``shard`` running in ``workdir`` (other test runs may be alive)."""
    import psutil

    for proc in psutil.process_iter(["cmdline", "cwd"]):
        cmd = proc.info["cmdline"] or []
        if "run-shard" in cmd and proc.info["cwd"] == str(workdir) and cmd[cmd.index("--shard") + 1] == str(shard):
            return proc
    return None


def wait_for(predicate, timeout: float, what: str):
    """``predicate()``'s first truthy value, polled every 20 ms; an AssertionError after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def keep_only_stage(config: dict, stage: str) -> dict:
    """``config`` with one stage (and only the datasets it reads): for tests about one stage of the demo."""
    config["stages"] = {stage: config["stages"][stage]}
    config["datasets"] = {name: config["datasets"][name] for name in config["stages"][stage]["datasets"]}
    return config


def make_kaldi_dir(path: Path, keys: list[str], wav: Path) -> Path:
    """A Kaldi data dir whose every key points at ``wav`` (an existing file)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "wav.scp").write_text("".join(f"{k} {wav}\n" for k in keys))
    return path


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A fresh copy of the project's workflow (Snakefile, rules, config, demo data) to run snakemake in."""
    wd = copy_workflow(tmp_path / "wf")
    (wd / "toy.py").write_text(TOY_MODULE)
    return wd


@pytest.fixture
def toy_workdir(workdir: Path) -> Path:
    """The workflow configured with the toy runner over 40 keys in 4 shards."""
    keys = [f"utt{i:03d}" for i in range(40)]
    make_kaldi_dir(workdir / "data/toy", keys, Path("data/demo/wav/cards-001.wav"))
    config = {
        "output_dir": "results",
        "datasets": {"toy": {"path": "data/toy", "format": "kaldi"}},
        "stages": {
            "upper": {
                "runner": "toy.UpperRunner",
                "provider": "toy.ToyProvider",
                "provider_config": {},
                "datasets": ["toy"],
                "sharding": {"num_shards": 4},
            }
        },
    }
    write_config(workdir, config)
    return workdir


def copy_workflow(wd: Path) -> Path:
    wd.mkdir(parents=True)
    for part in WORKFLOW_PARTS:
        src = PROJECT / part
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, wd / part)
    return wd


def once_per_session(tmp_path_factory, name: str, compute):
    """``compute(directory)``'s result, computed once in the whole test session, whichever xdist worker asks first.

    A reference run that tests in two modules compare against (the digits recipe, an uninterrupted training) would
    otherwise run once per worker that holds such a module. The first worker to ask runs ``compute`` in a
    directory of its own while holding a lock beside the workers' temp dirs; the others wait on that lock and read
    the pickled result. A compute that fails leaves no result: the next worker to ask runs it again (and fails the
    same way, in its own test)."""
    import fcntl
    import os
    import pickle

    base = tmp_path_factory.getbasetemp()
    # under xdist every worker's basetemp (popen-gwN) sits in one directory of this session; without it, our own
    home = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "once_per_session"
    home.mkdir(exist_ok=True)
    result = home / f"{name}.pickle"
    with open(home / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this worker dies
        if not result.exists():
            directory = home / name
            shutil.rmtree(directory, ignore_errors=True)  # a compute that failed before
            directory.mkdir()
            value = compute(directory)
            partial = result.with_suffix(".partial")
            partial.write_bytes(pickle.dumps(value))
            partial.replace(result)
        return pickle.loads(result.read_bytes())


@pytest.fixture(scope="session")
def clean_demo_text(tmp_path_factory) -> bytes:
    """The merged demo hypotheses of one uninterrupted local run, to compare other runs against."""
    def compute(directory: Path) -> bytes:
        wd = copy_workflow(directory / "wf")
        write_config(wd, keep_only_stage(read_config(wd), "asr"))
        run = run_snakemake(wd)
        assert run.returncode == 0, run.stderr[-3000:]
        return (wd / "results/asr/demo/text").read_bytes()
    return once_per_session(tmp_path_factory, "clean_demo_text", compute)
