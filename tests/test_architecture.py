"""The import contracts of pyproject.toml's [tool.importlinter]: no import circles in src/snakeshard, and its layers
(the command line over the workflow glue, over training, over the built-in stages, over the core, over I/O), and the
layers inside snakeshard.core and snakeshard.workflow.

`lint-imports` (import-linter, pinned in the test extra) reads every import of the package, those inside functions
too: a function-level import is how a circle hides from Python at run time, not from a reader. Also here: the import
paths of the flat layout before the subpackages fail naming the new ones."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import keep_only_stage, read_config, run_snakemake, write_config

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = str(Path(sys.executable).parent / "lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """lint-imports over the snakeshard package under ``root``/src, with ``root``/pyproject.toml's contracts."""
    env = {**os.environ, "PYTHONPATH": str(root / "src")}  # ahead of the editable install's finder
    return subprocess.run([LINT_IMPORTS, "--no-cache", "--config", str(root / "pyproject.toml")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_package_keeps_its_import_contracts():
    run = lint_imports(REPO)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "Contracts: 4 kept, 0 broken." in run.stdout


def test_a_function_level_import_that_closes_a_circle_breaks_both_contracts_naming_it(tmp_path):
    """The negative control: the datasets importing the workflow glue (inside a function, as the old circles did)
    is reported as a circle and as a violation of each layers contract, naming the import and its line."""
    shutil.copytree(REPO / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    data = tmp_path / "src/snakeshard/core/data.py"
    source = data.read_text()
    hook = "def is_pipe(value: str) -> bool:\n"
    assert hook in source
    data.write_text(source.replace(hook, hook + "    from snakeshard.workflow.parse import Workflow  # noqa: F401\n\n", 1))
    line = data.read_text().splitlines().index("    from snakeshard.workflow.parse import Workflow  # noqa: F401") + 1

    run = lint_imports(tmp_path)
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-2000:]
    assert "Contracts: 0 kept, 4 broken." in run.stdout
    assert "- .core -> .workflow (1 import)" in run.stdout  # the circle, and the import that would break it
    assert f"- snakeshard.core.data -> snakeshard.workflow.parse (l.{line})" in run.stdout  # the layer it crosses


def python_error(code: str) -> str:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stdout + run.stderr
    return run.stderr.strip().splitlines()[-1]


def test_an_old_flat_import_path_fails_naming_its_new_one():
    """The modules that sat flat in snakeshard/ before its subpackages: an import names where each went; a name
    that never existed fails as Python says, with no such hint; the public names import from the package."""
    assert python_error("import snakeshard.runners.fbank") == (
        "ModuleNotFoundError: No module named 'snakeshard.runners': it moved to 'snakeshard.stages'")
    assert python_error("from snakeshard.data import load_dataset") == (
        "ModuleNotFoundError: No module named 'snakeshard.data': it moved to 'snakeshard.core.data' "
        "(a provider's load_dataset: from snakeshard import load_dataset)")
    assert python_error("import snakeshard.nonesuch") == "ModuleNotFoundError: No module named 'snakeshard.nonesuch'"
    public = subprocess.run([sys.executable, "-c", "from snakeshard import load_dataset, BaseRunner; "
                             "from snakeshard.stages import ScoringRunner; print(load_dataset.__module__)"],
                            capture_output=True, text=True, timeout=60)
    assert public.stdout.strip() == "snakeshard.core.data", public.stderr


def test_a_config_naming_an_old_runner_path_fails_naming_the_new_one(workdir):
    """`runner: snakeshard.runners.fbank.FbankRunner` (a config written before the subpackages): the parse fails
    on that key with the path to write instead, and writes nothing."""
    config = keep_only_stage(read_config(workdir), "asr")
    config["stages"]["asr"]["runner"] = "snakeshard.runners.fbank.FbankRunner"
    write_config(workdir, config)
    run = run_snakemake(workdir, "-n")
    assert run.returncode == 1
    assert ("snakeshard: error: stages.asr.runner: 'snakeshard.runners.fbank.FbankRunner' moved to "
            "'snakeshard.stages.fbank.FbankRunner' (snakeshard's modules went into subpackages)") in run.stderr, run.stderr
    assert not (workdir / "results").exists()
