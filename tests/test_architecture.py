"""The import contracts of pyproject.toml's [tool.importlinter]: no import circles in src/snakeshard, and its layers
(the command line over the workflow glue, over jobs and stages, over the core, over I/O and helpers).

`lint-imports` (import-linter, pinned in the test extra) reads every import of the package, those inside functions
too: a function-level import is how a circle hides from Python at run time, not from a reader."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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
    assert "Contracts: 2 kept, 0 broken." in run.stdout


def test_a_function_level_import_that_closes_a_circle_breaks_both_contracts_naming_it(tmp_path):
    """The negative control: the data readers importing the workflow glue (inside a function, as the old circles
    did) is reported as a circle and as a layer violation, each naming the import and its line."""
    shutil.copytree(REPO / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    data = tmp_path / "src/snakeshard/data.py"
    source = data.read_text()
    hook = "def is_pipe(value: str) -> bool:\n"
    assert hook in source
    data.write_text(source.replace(hook, hook + "    from snakeshard.workflow import Workflow  # noqa: F401\n\n", 1))
    line = data.read_text().splitlines().index("    from snakeshard.workflow import Workflow  # noqa: F401") + 1

    run = lint_imports(tmp_path)
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-2000:]
    assert "Contracts: 0 kept, 2 broken." in run.stdout
    assert "- .data -> .workflow (1 import)" in run.stdout  # the circle, and the import that would break it
    assert f"- snakeshard.data -> snakeshard.workflow (l.{line})" in run.stdout  # the layer it crosses
