"""Config strings that reach the rules' shell commands: real `snakemake` runs with hostile values.

Every value a rule puts in a command (paths under output_dir, params, wildcards, log and output files)
is quoted with Snakemake's ``{...:q}``, so an output_dir holding spaces, quotes, ``$()``, backticks or
``;`` is only a directory name: the run finishes, merges, draws its report and `snakeshard status`
reads it, and no command it names runs. Stage and dataset names never need quoting: the config schema
restricts them to ``[A-Za-z][A-Za-z0-9_]*`` and ``[A-Za-z0-9][A-Za-z0-9_.-]*`` (a stage name is part of a
rule name, a dataset name a directory), and ``from_stage``/``dataset`` must name one of them; a name
outside those patterns is refused at parse, naming its key (tested below).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import read_config, run_cli, run_snakemake, write_config

KEYS = [f"utt{i:03d}" for i in range(40)]  # conftest's toy dataset
# {marker}: the absolute path a successful injection would create
OUTPUT_DIRS = [
    ("dollar-paren", "res$(touch {marker})"),
    ("backticks", "res`touch {marker}`"),
    ("semicolon", "res;touch {marker}"),
    ("spaces", "res dir with spaces"),
    ("single-quote", "res'quote"),
    ("double-quote", 'res"dq'),
]


def hostile_config(workdir: Path, out: str) -> None:
    """The toy stage (4 shards, run 2 per job: the run-shards rule) with its canary on, and a scoring stage
    over its output (one job per shard: the run-shard rule; its runner draws metrics.png: the report rule)."""
    (workdir / "data/toy/text").write_text("".join(f"{k} {k}\n" for k in KEYS))  # the references
    config = read_config(workdir)
    config["output_dir"] = out
    config["canary"] = 1
    config["datasets"]["toy_upper"] = {"from_stage": "upper", "dataset": "toy"}
    config["stages"]["upper"]["shards_per_job"] = 2
    config["stages"]["score"] = {
        "runner": "snakeshard.stages.ScoringRunner", "provider": "snakeshard.stages.ScoringProvider",
        "provider_config": {"metrics": ["wer"], "hypothesis": "text", "reference": "text", "normalize": ["lowercase"]},
        "datasets": ["toy_upper"], "sharding": {"num_shards": 2}}
    write_config(workdir, config)


def assert_no_marker(tmp_path: Path, marker: Path) -> None:
    assert not marker.exists()
    # `res;touch <marker>` is also a relative directory path: directories named MARKER are expected
    assert not [p for p in tmp_path.rglob(marker.name) if p.is_file()]


@pytest.mark.parametrize("template", [c[1] for c in OUTPUT_DIRS], ids=[c[0] for c in OUTPUT_DIRS])
def test_hostile_output_dir_is_only_a_directory_name(toy_workdir, tmp_path, template):
    """A run with this output_dir exits 0, runs no command it holds, merges the expected lines (and the
    scoring stage's WER and report), and `snakeshard status` reads every shard as done."""
    marker = tmp_path / "MARKER"
    out = template.format(marker=marker)
    hostile_config(toy_workdir, out)

    run = run_snakemake(toy_workdir)
    assert_no_marker(tmp_path, marker)
    assert run.returncode == 0, run.stderr[-3000:]
    results = toy_workdir / out
    assert (results / "upper/toy/text").read_text() == "".join(f"{k} {k.upper()}\n" for k in KEYS)
    assert json.loads((results / "upper/toy/merged.json").read_text())["items"] == len(KEYS)
    metrics = json.loads((results / "score/toy_upper/metrics.json").read_text())
    assert metrics["metrics"]["wer"]["value"]["wer"] == 0.0  # UTT000 against utt000, lowercased
    assert metrics["metrics"]["wer"]["value"]["hits"] == len(KEYS)
    assert (results / "score/toy_upper/metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert list((results / "upper/_canary").glob("*/done"))  # the canary ran

    status = run_cli(toy_workdir, "status")
    assert status.returncode == 0, status.stderr
    assert "summary: 6 done" in status.stdout, status.stdout
    assert status.stdout.count("merged: yes, current") == 2, status.stdout
    assert_no_marker(tmp_path, marker)


@pytest.mark.parametrize("out, expected", [
    ("res{x}", "output_dir: 'res{x}' holds a brace"),  # Snakemake would read {x} as a wildcard
    ("-res", "output_dir: '-res' starts with '-'"),  # merge's argparse would read --spec -res/... as options
])
def test_output_dir_snakemake_or_a_command_would_misread_is_refused_at_parse(toy_workdir, out, expected):
    config = read_config(toy_workdir)
    config["output_dir"] = out
    write_config(toy_workdir, config)
    run = run_snakemake(toy_workdir, "-n")
    assert run.returncode != 0
    assert expected in run.stdout + run.stderr, run.stderr[-3000:]


@pytest.mark.parametrize("edit, key", [
    (lambda c: c["stages"].update({"up$(touch {marker})": c["stages"].pop("upper")}), "stages"),
    (lambda c: c["datasets"].update({"toy;touch {marker}": c["datasets"]["toy"]}), "datasets"),
], ids=["stage-name", "dataset-name"])
def test_stage_and_dataset_names_with_shell_characters_are_refused_at_parse(toy_workdir, tmp_path, edit, key):
    """The schema's name patterns (see the module doc) refuse them, naming the key; nothing runs."""
    marker = tmp_path / "MARKER"
    config = read_config(toy_workdir)
    edit(config)
    write_config(toy_workdir, json.loads(json.dumps(config).replace("{marker}", str(marker))))
    run = run_snakemake(toy_workdir)
    assert run.returncode != 0
    output = run.stdout + run.stderr
    assert f"{key}: " in output and "does not match" in output, output[-3000:]
    assert_no_marker(tmp_path, marker)
    assert not (toy_workdir / "results").exists()


def test_wildcards_of_a_requested_target_reach_no_shell(toy_workdir, tmp_path):
    """Targets asked for on the command line fill the rules' wildcards: a report name holding `$()` is drawn
    under that name (the report rule quotes its output); a dataset that is not planned fails the run."""
    marker = tmp_path / "MARKER"
    hostile_config(toy_workdir, "results")
    report = f"results/score/toy_upper/x$(touch {marker}).png"
    run = run_snakemake(toy_workdir, report)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (toy_workdir / report).read_bytes()[:4] == b"\x89PNG"
    run = run_snakemake(toy_workdir, f"results/upper/toy$(touch {marker})/merged.json")
    assert run.returncode != 0
    assert_no_marker(tmp_path, marker)
