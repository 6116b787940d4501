"""The README's custom stage example runs as written, through snakemake and in-process."""

from __future__ import annotations

import re

import yaml

from conftest import PROJECT, read_config, run_snakemake, write_config


def readme_block(lang: str, first_line: str) -> str:
    """The README code block in ``lang`` whose first line starts with ``first_line``."""
    for block in re.findall(rf"```{lang}\n(.*?)```", (PROJECT / "README.md").read_text(), re.S):
        if block.startswith(first_line):
            return block
    raise AssertionError(f"README has no ```{lang} block starting with {first_line!r}")


def test_readme_custom_stage_runs_as_written(workdir, monkeypatch):
    """my_stage.py + its config stage from the README: 3 shards, merged duration/energy_db for all 10 keys."""
    (workdir / "my_stage.py").write_text(readme_block("python", "# my_stage.py"))
    stage = yaml.safe_load(readme_block("yaml", "  energy:"))
    config = read_config(workdir)
    config["stages"].update(stage)
    write_config(workdir, config)

    run = run_snakemake(workdir)
    assert run.returncode == 0, run.stderr[-3000:]
    base = workdir / "results/energy/demo"
    assert len(list(base.glob("split.*/done"))) == 3
    durations = dict(line.split() for line in (base / "duration").read_text().splitlines())
    assert list(durations) == [line.split()[0] for line in (workdir / "data/demo/wav.scp").read_text().splitlines()]
    assert durations["cards-001"] == "1.095"

    # The in-process lines of the README's doctest-style example give what it shows.
    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(workdir))
    from my_stage import EnergyProvider, EnergyRunner

    shown = readme_block("python", ">>> from my_stage")
    expected = re.search(r">>> runner\(\[\"cards-001\"\]\).*\n(.*)\n", shown).group(1)
    runner = EnergyRunner(EnergyProvider({"dataset": {"path": "data/demo"}}))
    assert repr(runner(["cards-001"])) == expected
    energy = dict(line.split() for line in (base / "energy_db").read_text().splitlines())
    assert repr(energy["cards-001"]) in expected  # the workflow and the in-process call agree
    done = EnergyRunner(EnergyProvider({"dataset": {"path": "data/demo"}}), output_dir=workdir / "e")(["cards-001"])
    assert done["items"] == 1 and (workdir / "e/energy_db").read_text() == f"cards-001 {energy['cards-001']}\n"
