"""Snakeshard's Snakemake patches (src/snakeshard/workflow/snakemake_patches.py) are applied only on the Snakemake
versions they were checked against: the installed Snakemake must be in each patch's range and ship the
methods the patch was written against (recorded in docs/upstream/original/); outside the range a patch is
left out, and a real run says so once per patch. What each patch does is tested in test_job_overhead.py."""

from __future__ import annotations

import difflib
import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
from conftest import PROJECT, run_snakemake
from packaging.specifiers import SpecifierSet

from snakeshard.workflow.snakemake_patches import PATCHES

ORIGINALS = PROJECT / "docs" / "upstream" / "original"

# In a fresh interpreter (a patch another test applied must not stand in for Snakemake's own methods): per
# patch, the installed Snakemake's source of the method it replaces and of those it calls; then apply(), twice,
# told of a version no patch was checked on, and whether Snakemake's methods are still its own after that.
FRESH = """
import importlib, inspect, json
from snakeshard.workflow import snakemake_patches
def methods(attrs):
    return {name: [getattr(importlib.import_module(p.module), p.cls).__dict__[a] for a in attrs(p)]
            for name, p in snakemake_patches.PATCHES.items()}
shipped = methods(lambda p: (p.attr, *p.relies_on))
source = {name: "\\n".join(inspect.getsource(getattr(m, "fget", m)) for m in ms)  # a property: its getter
          for name, ms in shipped.items()}
replaced = methods(lambda p: (p.attr,))
first = snakemake_patches.apply(version="9.99.0")
second = snakemake_patches.apply(version="9.99.0")
print(json.dumps({"source": source, "first": first, "second": second,
                  "unchanged": methods(lambda p: (p.attr,)) == replaced}))
"""


@pytest.fixture(scope="module")
def fresh() -> dict:
    run = subprocess.run([sys.executable, "-c", FRESH], check=False, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return {**json.loads(run.stdout), "stderr": run.stderr}


def not_applied_line(name: str, version: str) -> str:
    patch = PATCHES[name]
    return (f"snakeshard: note: patch {name} ({patch.cls}.{patch.attr}) not applied: snakemake {version} is outside "
            f"the versions it was checked against ({patch.checked}); Snakemake runs as shipped "
            f"(docs/upstream/{name}.md)")


@pytest.mark.parametrize("name", PATCHES)
def test_the_installed_snakemake_is_one_the_patch_was_checked_against(name, fresh):
    """Fails on a Snakemake upgrade (or a changed method), saying which patch to re-check and how."""
    patch = PATCHES[name]
    version = importlib.metadata.version("snakemake")
    todo = (f"Re-check patch {name} (src/snakeshard/workflow/snakemake_patches.py) against snakemake {version}: compare "
            f"{patch.cls}.{patch.attr} and the code that calls it with docs/upstream/original/{name}.py.txt, run "
            f"the reproduction of docs/upstream/{name}.md and tests/test_job_overhead.py; then widen CHECKED and "
            f"record the new source, or drop the patch if Snakemake no longer has the cost.")
    recorded = (ORIGINALS / f"{name}.py.txt").read_text()
    diff = "".join(difflib.unified_diff(recorded.splitlines(keepends=True),
                                        fresh["source"][name].splitlines(keepends=True),
                                        f"docs/upstream/original/{name}.py.txt", f"snakemake {version}"))
    assert not diff, f"snakemake {version}'s {patch.cls}.{patch.attr} is not the method patch {name} " \
                     f"was written against. {todo}\n{diff}"
    assert SpecifierSet(patch.checked).contains(version), \
        f"snakemake {version} is outside the versions patch {name} was checked against ({patch.checked}): " \
        f"the workflow runs without it. {todo}"


def test_outside_the_checked_versions_a_patch_is_not_applied_and_says_so_once(fresh):
    assert fresh["first"] == fresh["second"] == {name: False for name in PATCHES}
    assert fresh["unchanged"] is True  # Snakemake's own methods are still in place
    said = [line for line in fresh["stderr"].splitlines() if "not applied" in line]
    assert said == [not_applied_line(name, "9.99.0") for name in PATCHES]  # each once, not once per call


def test_a_real_run_on_an_unchecked_snakemake_says_so_once_per_patch_and_runs_as_shipped(toy_workdir, tmp_path,
                                                                                        monkeypatch):
    """A checked Snakemake's run prints no such line. With a Snakemake that reports version 9.99.0 (a
    distribution record put first on the path: the code is the installed Snakemake), the workflow's run
    prints each patch's line once and runs to its end without the patches."""
    dry = run_snakemake(toy_workdir, "-n")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "not applied" not in dry.stderr
    fake = tmp_path / "fake_version"
    (fake / "snakemake-9.99.0.dist-info").mkdir(parents=True)
    (fake / "snakemake-9.99.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: snakemake\nVersion: 9.99.0\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(fake), os.environ.get("PYTHONPATH")) if p))
    assert subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('snakemake'))"],
                          check=False, capture_output=True, text=True).stdout.strip() == "9.99.0"
    run = run_snakemake(toy_workdir)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stderr.splitlines()
    for name in PATCHES:
        assert lines.count(not_applied_line(name, "9.99.0")) == 1, run.stderr[-3000:]
    assert sum("not applied" in line for line in lines) == len(PATCHES)
    assert (toy_workdir / "results/upper/toy/text").read_text().splitlines()[0] == "utt000 UTT000"
