"""From an installed wheel, in a fresh virtualenv, in an empty directory: the README's "Your own
project" block as written, then a kill -9 of one shard and a rerun, then a rule of the user's own
beside the module's, all from the project directory with no clone on sys.path.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from conftest import PROJECT, shard_process
from doc_blocks import fenced_blocks, shown_output


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory) -> dict:
    """Run the README's quick-start block in bash, the venv and the clone's paths substituted."""
    home = tmp_path_factory.mktemp("user")
    block = next(lines for lang, lines in fenced_blocks("README.md")
                 if lang == "bash" and lines[0].startswith("python3 -m venv"))
    script = "\n".join(block).replace("~/.venvs/snakeshard", str(home / "venv")).replace("./snakeshard", str(PROJECT))
    # Each command's output, marked so the test can compare it with what the README shows.
    marked = "\n".join(f"echo '@@@ {line.split('#')[0].strip()}'\n{line}" for line in script.splitlines())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(["bash", "-ec", marked], cwd=home, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    outputs = dict(re.findall(r"^@@@ (.*)\n((?:(?!@@@ ).*\n)*)", proc.stdout, re.M))
    return {"home": home, "project": home / "my_project", "venv": home / "venv", "outputs": outputs,
            "stderr": proc.stderr, "env": env}


def venv_run(qs: dict, *args: str, **kwargs) -> subprocess.CompletedProcess:
    env = {**qs["env"], "PATH": f"{qs['venv']}/bin:{qs['env']['PATH']}"}
    return subprocess.run(list(args), cwd=qs["project"], env=env, capture_output=True, text=True,
                          timeout=kwargs.pop("timeout", 600), **kwargs)


def test_quick_start_prints_what_the_readme_shows(quick_start):
    out = quick_start["outputs"]
    assert out["snakeshard init my_project"].splitlines()[0] == shown_output("README.md", "snakeshard init my_project")[0]
    assert out["snakeshard plan"].splitlines() == shown_output("README.md", "snakeshard plan")
    assert out["snakeshard status"].splitlines() == shown_output("README.md", "snakeshard status")
    dry = quick_start["stderr"] + out["snakemake -n"]
    for line in shown_output("README.md", "snakemake -n"):
        assert line in dry.splitlines(), line
    assert "5 of 5 steps (100%) done" in quick_start["stderr"]
    energy = (quick_start["project"] / "results/energy/demo/energy_db").read_text().splitlines()
    assert len(energy) == 10 and energy[0] == "cards-001 -19.77"


def test_installed_package_runs_without_the_clone(quick_start):
    """snakeshard and its workflow come from the venv's site-packages, not from the clone."""
    code = "import snakeshard, sys; print(snakeshard.__file__); print(snakeshard.snakefile()); print(sys.path)"
    out = venv_run(quick_start, "python", "-c", code).stdout.splitlines()
    site = str(quick_start["venv"] / "lib")
    assert out[0].startswith(site) and out[1].startswith(site) and out[1].endswith("_workflow/Snakefile")
    assert str(PROJECT) not in out[2]


SLOW_STAGE = '''
import time

from my_stage import EnergyProvider, EnergyRunner


class SlowEnergyRunner(EnergyRunner):
    @staticmethod
    def forward(key, *, dataset, floor_db):
        time.sleep(0.5)
        return EnergyRunner.forward(key, dataset=dataset, floor_db=floor_db)
'''


def test_kill9_of_one_shard_then_rerun_from_the_project(quick_start):
    """A slow stage of 4 shards: kill -9 of shard 2 mid-run; status names it; the rerun runs only it."""
    project = quick_start["project"]
    (project / "slow_stage.py").write_text(SLOW_STAGE)
    config = (project / "config/config.yaml").read_text()
    config += ("  slow:\n    runner: slow_stage.SlowEnergyRunner\n    provider: my_stage.EnergyProvider\n"
               "    datasets: [demo]\n    sharding: {num_shards: 4}\n")
    (project / "config/config.yaml").write_text(config)
    env = {**quick_start["env"], "PATH": f"{quick_start['venv']}/bin:{quick_start['env']['PATH']}"}
    driver = subprocess.Popen(["snakemake", "--profile", "profiles/local", "--cores", "2"], cwd=project, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not (victim := shard_process(project, 2)) and time.time() < deadline:
        time.sleep(0.05)
    assert victim, "shard 2 never started"
    time.sleep(0.7)
    victim.send_signal(signal.SIGKILL)
    out, _ = driver.communicate(timeout=300)
    assert driver.returncode != 0, out
    base = project / "results/slow/demo"
    assert not (base / "split.2/done").exists() and not (base / "merged.json").exists()
    status = venv_run(quick_start, "snakeshard", "status").stdout
    assert re.search(r"split\.2\s+(failed|incomplete)", status), status
    assert "summary: 5 done, 1 incomplete" in status or "summary: 5 done, 1 failed" in status  # 2 energy + 3 slow

    rerun = venv_run(quick_start, "snakemake", "--profile", "profiles/local", "--cores", "2")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    shards = re.findall(r"rule shard_slow:\n(?:    .*\n)*?    wildcards: .*shard=(\d+)", rerun.stdout + rerun.stderr)
    assert shards == ["2"]
    assert (base / "energy_db").read_text() == (project / "results/energy/demo/energy_db").read_text()
    assert "summary: 6 done" in venv_run(quick_start, "snakeshard", "status").stdout


def test_a_rule_of_the_users_own_reads_a_merged_output(quick_start):
    """The commented example at the end of the generated Snakefile, uncommented, runs after the module's rules, in a
    plain run too: its `everything` rule is the default target (without it, a user trial's rule never ran)."""
    project = quick_start["project"]
    snakefile = (project / "Snakefile").read_text()
    example = snakefile[snakefile.index("# rule loudest:"):]
    (project / "Snakefile").write_text(snakefile + "\n" + "\n".join(line[2:] for line in example.splitlines()) + "\n")
    run = venv_run(quick_start, "snakemake", "--profile", "profiles/local")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rule loudest:" in run.stdout + run.stderr
    energy = dict(line.split() for line in (project / "results/energy/demo/energy_db").read_text().splitlines())
    loudest = sorted(energy.items(), key=lambda kv: -float(kv[1]))[:3]
    assert (project / "results/loudest.txt").read_text() == "".join(f"{k} {v}\n" for k, v in loudest)


def test_local_runs_never_touch_slurm_without_the_extra(quick_start, tmp_path):
    """The quick start installs no SLURM plugin: with SLURM's client tools on PATH (here stand-ins that
    record every call), `snakemake --version`, a dry run and a local run call none of them, and the SLURM
    profile stops at once naming the missing executor plugin."""
    calls = tmp_path / "calls"
    tools = tmp_path / "slurm_tools"
    tools.mkdir()
    for tool in ("scontrol", "sinfo", "squeue", "sacct", "sbatch"):
        (tools / tool).write_text(f"#!/bin/sh\necho {tool} >> {calls}\nsleep 30\n")
        (tools / tool).chmod(0o755)
    env = {**quick_start["env"], "PATH": f"{quick_start['venv']}/bin:{tools}:{quick_start['env']['PATH']}"}

    def run(*args):
        return subprocess.run(list(args), cwd=quick_start["project"], env=env, capture_output=True, text=True,
                              timeout=300)

    assert run("python", "-c", "import importlib.util as u; print(u.find_spec('snakemake_executor_plugin_slurm'))"
               ).stdout.strip() == "None"
    imports = run("python", "-X", "importtime", "-m", "snakemake", "--version")
    assert imports.returncode == 0 and "snakemake_executor_plugin_slurm" not in imports.stderr
    assert run("snakemake", "-n").returncode == 0
    assert run("snakemake", "--profile", "profiles/local", "--forceall").returncode == 0
    assert not calls.exists(), calls.read_text()
    slurm = run("snakemake", "--profile", "profiles/slurm", "-n")
    assert slurm.returncode != 0 and "slurm" in (slurm.stdout + slurm.stderr).lower()
    assert not calls.exists()


def test_snakemake_report_shows_each_sets_summary(quick_start):
    """`snakemake --report report.html` in the installed project (its dependencies come with the package:
    before, it failed asking for pygments) holds each merged set's summary.html: shards, items, audio,
    compute time and real-time factor, one row per shard."""
    import base64

    report = venv_run(quick_start, "snakemake", "--report", "report.html")
    assert report.returncode == 0, report.stdout[-2000:] + report.stderr[-2000:]
    page = (quick_start["project"] / "report.html").read_text()
    embedded = re.search(r"filename=summary\.html;base64,([A-Za-z0-9+/=]+)", page).group(1)
    summary = base64.b64decode(embedded).decode()
    assert "<h3>stage energy, dataset demo</h3>" in summary
    assert re.search(r"<p>2 shards done, 10 items, audio 34\.\d\d s; compute \d+\.\d\d s over the shard jobs "
                     r"\(first start to last end: \d+\.\d s\); real-time factor 0\.\d{4} ", summary), summary
    assert summary.count("<tr><td>") == 2


def test_the_installed_package_writes_the_digits_recipe(quick_start, tmp_path):
    """`snakeshard init --recipe digits` from the wheel writes every recipe file: each is package data, and a file
    missing from pyproject.toml's package-data would only show on a user's machine."""
    from snakeshard.recipes import FILES, PROFILES

    (tmp_path / "wavs").mkdir()
    (tmp_path / "wavs/3_theo_7.wav").write_bytes((PROJECT / "data/demo/wav/cards-001.wav").read_bytes())
    made = venv_run(quick_start, "snakeshard", "init", "--recipe", "digits", str(tmp_path / "digits"), "--data",
                    str(tmp_path / "wavs"))
    assert made.returncode == 0, made.stderr
    for path in (*FILES.values(), *PROFILES):
        assert (tmp_path / "digits" / path).is_file(), path
    assert (tmp_path / "digits/digits.py").read_text() == (PROJECT / "src/snakeshard/recipes/digits/digits.py").read_text()
