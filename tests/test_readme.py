"""The README and the pages under docs/ are true: their example stage runs as written, their outputs are a real
run's, CI runs the README's commands."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib

import yaml

from conftest import PROJECT, read_config, run_cli, run_snakemake, write_config
from doc_blocks import doc_block, doc_text, prose, shown_output

TEMPLATE = PROJECT / "src/snakeshard/project_template"
GUIDE, STAGES, OUTPUTS, RERUNS = "docs/guide.md", "docs/stages.md", "docs/outputs.md", "docs/failures-and-reruns.md"


def test_readme_custom_stage_runs_as_written(workdir, monkeypatch):
    """my_stage.py + its config stage from the guide: 3 shards, merged duration/energy_db for all 10 keys."""
    (workdir / "my_stage.py").write_text(doc_block(GUIDE, "python", "# my_stage.py"))
    stage = yaml.safe_load(doc_block(GUIDE, "yaml", "  energy:"))
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

    # The in-process lines of the guide's doctest-style example give what it shows.
    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(workdir))
    from my_stage import EnergyProvider, EnergyRunner

    shown = doc_block(GUIDE, "python", ">>> from my_stage")
    expected = re.search(r">>> runner\(\[\"cards-001\"\]\).*\n(.*)\n", shown).group(1)
    runner = EnergyRunner(EnergyProvider({"dataset": {"path": "data/demo"}}))
    assert repr(runner(["cards-001"])) == expected
    energy = dict(line.split() for line in (base / "energy_db").read_text().splitlines())
    assert repr(energy["cards-001"]) in expected  # the workflow and the in-process call agree
    done = EnergyRunner(EnergyProvider({"dataset": {"path": "data/demo"}}), output_dir=workdir / "e")(["cards-001"])
    assert done["items"] == 1 and (workdir / "e/energy_db").read_text() == f"cards-001 {energy['cards-001']}\n"


def test_readme_stage_is_what_init_writes():
    """The guide's my_stage.py and the README's project Snakefile are the files `snakeshard init` writes."""
    assert doc_block(GUIDE, "python", "# my_stage.py") == (TEMPLATE / "my_stage.py").read_text()
    shown = doc_block("README.md", "python", "# A snakeshard project")
    assert (TEMPLATE / "Snakefile").read_text().startswith(shown)


def test_repository_snakefile_is_the_project_template_on_the_repositorys_workflow():
    """The clone's demo runs through the same module directive a user's project uses."""
    def code(text):
        return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    template = [line.replace("snakeshard.snakefile()", '"workflow/Snakefile"')
                for line in code((TEMPLATE / "Snakefile").read_text())]
    assert code((PROJECT / "Snakefile").read_text()) == template


def test_ci_runs_the_readme_commands_and_command_1_installs_what_command_2_needs():
    """Defect: command 1 installed .[demo] only, so command 2 answered `No module named pytest`."""
    printed = subprocess.run([sys.executable, PROJECT / ".ci/readme_commands.py"], capture_output=True, text=True,
                             check=True).stdout.splitlines()
    section = doc_text("README.md").split("## From a clone: two commands", 1)[1]
    assert printed == [line for line in section.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
                       if line and not line.startswith("#")]
    setup, tests = printed
    assert tests == ".venv/bin/python -m pytest -q"
    extras = re.search(r'pip install -q -e "\.\[([a-z,]+)\]"', setup).group(1).split(",")
    project = tomllib.loads((PROJECT / "pyproject.toml").read_text())["project"]
    installed = [req for extra in extras for req in project["optional-dependencies"][extra]]
    assert any(req.startswith("pytest") for req in installed), extras
    ci = (PROJECT / ".ci/run").read_text()
    assert "python3 .ci/readme_commands.py" in ci and 'eval "$command"' in ci
    assert "pytest" not in ci.replace("the tests", "")  # no variant of the commands of its own


def test_readme_stands_alone():
    """No link outside the repository (../shared is not in a clone), in the README or a page under docs/."""
    for page in ["README.md", *sorted(str(p.relative_to(PROJECT)) for p in (PROJECT / "docs").glob("*.md"))]:
        text = doc_text(page)
        assert "../shared" not in text and "DESIGN.md" not in text, page


def job_stats(text: str) -> list[str]:
    """The first `Job stats` table of a snakemake (dry) run."""
    lines = text.splitlines()
    start = lines.index("job           count") if "job           count" in lines else next(
        i for i, line in enumerate(lines) if line.startswith("job ") and line.endswith("count"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("total"))
    return lines[start:end + 1]


def test_readme_demo_outputs_are_real(workdir):
    """`snakeshard plan`, `snakemake -n` and `snakeshard status` of the demo print what the guide shows, and the demo's
other outputs what the README and docs/stages.md and docs/outputs.md show."""
    assert run_cli(workdir, "plan").stdout.splitlines() == shown_output(GUIDE, "snakeshard plan                      #")
    dry = run_snakemake(workdir, "-n")
    assert job_stats(dry.stdout + dry.stderr) == shown_output(GUIDE, "snakemake -n --profile config/profiles/local")
    run = run_snakemake(workdir)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run_cli(workdir, "status").stdout.splitlines() == shown_output(GUIDE, "snakeshard status                    #")
    # the score stage: its metrics.txt as docs/stages.md shows it, and the WER lines the README quotes
    metrics = (workdir / "results/score/demo_asr/metrics.txt").read_text().splitlines()
    assert metrics[:2] == shown_output("README.md", "head -2 results/score/demo_asr/metrics.txt")
    assert (workdir / "results/score/demo_asr/alignment.jsonl").read_text().splitlines()[1:2] == shown_output(
        STAGES, "sed -n 2p results/score/demo_asr/alignment.jsonl")
    assert metrics[:len(shown_output(STAGES, "cat results/score/demo_asr/metrics.txt"))] == shown_output(
        STAGES, "cat results/score/demo_asr/metrics.txt")
    assert (workdir / "results/score/demo_asr/metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the typed outputs of the fbank and vad stages, and the chained fbank over vad's output
    for path in ("results/vad/demo/speech.jsonl", "results/fbank/demo/utt2num_frames",
                 "results/fbank/demo_vad/utt2num_frames"):
        assert (workdir / path).read_text().splitlines()[:2] == shown_output(STAGES, f"head -2 {path}")
    padding = (workdir / "results/fbank/demo/logs/split.0.log").read_text().splitlines()
    assert next(line for line in padding if "padding" in line) in prose(OUTPUTS)
    # the stats stage: its files, its log's seconds line (timings vary), and the GlobalMVN lines
    assert (workdir / "results/stats/train/speech_shape").read_text().splitlines()[:2] == shown_output(
        STAGES, "head -2 results/stats/train/speech_shape")
    assert (workdir / "results/stats/train/stats_keys").read_text().splitlines() == shown_output(
        STAGES, "cat results/stats/train/stats_keys")
    log = (workdir / "results/stats/train/logs/split.0.log").read_text()
    assert re.search(r"shard 0: 6 items \(16\.2 s of audio, \d+x real time\) in \d+\.\d\d s", log), log
    assert "shard 0: 6 items (16.2 s of audio, " in doc_text(STAGES)
    import doctest
    import os

    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        for page, first in ((STAGES, ">>> import kaldiio, numpy as np"), (GUIDE, ">>> import snakeshard\n>>> record")):
            test = doctest.DocTestParser().get_doctest(doc_block(page, "python", first), {}, page, page, 0)
            assert doctest.DocTestRunner().run(test).failed == 0, page
    finally:
        os.chdir(cwd)


def test_readme_rerun_after_new_audio_is_real(workdir):
    """'What reruns when something changes': new audio at an existing path makes status and the dry run
    print what docs/failures-and-reruns.md shows (the stale shards with their causes, then the jobs that rerun)."""
    import shutil

    assert run_snakemake(workdir).returncode == 0
    shutil.copyfile(workdir / "data/demo/wav/cards-002.wav", workdir / "data/demo/wav/cards-001.wav")
    status = run_cli(workdir, "status").stdout.splitlines()
    assert status == shown_output(RERUNS, "snakeshard status                    # before rerunning")
    dry = run_snakemake(workdir, "-n")
    assert job_stats(dry.stdout + dry.stderr) == shown_output(RERUNS, "snakemake -n --profile config/profiles/local     # after")


def test_readme_batch_example_is_real():
    """The doctest-style collate/unbatch lines print what docs/outputs.md shows."""
    import doctest

    block = doc_block(OUTPUTS, "python", ">>> import numpy as np")
    test = doctest.DocTestParser().get_doctest(block, {}, OUTPUTS, OUTPUTS, 0)
    assert doctest.DocTestRunner().run(test).failed == 0


def test_readme_metrics_example_is_real():
    """The meters and metrics lines in docs/stages.md's "Scoring" print what it shows."""
    import doctest

    block = doc_block(STAGES, "python", ">>> from snakeshard.metrics import")
    test = doctest.DocTestParser().get_doctest(block, {}, STAGES, STAGES, 0)
    assert doctest.DocTestRunner().run(test).failed == 0


def test_readme_pool_example_runs_as_shown(tmp_path):
    """`python my_pool.py` (the guide's pool example, written to a fresh directory) prints what the guide shows."""
    import subprocess
    import sys

    (tmp_path / "my_pool.py").write_text(doc_block(GUIDE, "python", "# my_pool.py"))
    run = subprocess.run([sys.executable, "my_pool.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == shown_output(GUIDE, "python my_pool.py")


def test_readme_scoring_stage_block_is_the_shipped_one():
    """The score stage docs/stages.md shows is the demo config's (comments aside)."""
    shown = yaml.safe_load(doc_block(STAGES, "yaml", "datasets:\n  demo_asr:"))
    config = yaml.safe_load((PROJECT / "config/config.yaml").read_text())
    assert shown["stages"]["score"] == {k: v for k, v in config["stages"]["score"].items() if k != "resources"}
    assert shown["datasets"]["demo_asr"] == config["datasets"]["demo_asr"]


def test_readme_config_block_is_a_valid_config():
    """The annotated config in the guide's config section passes the schema and its cross-checks."""
    from snakeshard.workflow.parse import validate_config

    validate_config(yaml.safe_load(doc_block(GUIDE, "yaml", "output_dir: results")))


def test_the_guides_keep_together_keeps_each_speaker_in_one_shard_and_a_split_speaker_is_named(toy_workdir):
    """The guide's `keep_together` line in a real run: 40 keys of 60 s by 5 speakers of 3-13 consecutive keys. By
    seconds alone, 600 s a shard cuts 4 shards of 10 keys across speakers; with it, whole speakers (the 13 of one
    speaker a shard of their own). A speaker whose keys are not consecutive is refused by `snakemake -n`."""
    wd = toy_workdir
    sizes = [3, 13, 8, 8, 8]
    speakers = [f"spk{s}" for s, n in enumerate(sizes) for _ in range(n)]
    keys = [f"utt{i:03d}" for i in range(40)]
    (wd / "data/toy/utt2spk").write_text("".join(f"{k} {s}\n" for k, s in zip(keys, speakers)))
    (wd / "data/toy/utt2dur").write_text("".join(f"{k} 60\n" for k in keys))
    config = read_config(wd)
    config["stages"]["upper"].update(yaml.safe_load(doc_block(GUIDE, "yaml", "sharding: {shard_seconds: 600, "
                                                                              "keep_together: spk}")))
    write_config(wd, config)
    run = run_snakemake(wd)
    assert run.returncode == 0, run.stderr[-3000:]
    set_dir = wd / "results/upper/toy"
    plan = json.loads((set_dir / "plan.json").read_text())
    shards = [(set_dir / f"split.{n}/keys").read_text().split() for n in range(plan["num_shards"])]
    by_speaker = dict(zip(keys, speakers))
    assert [sorted({by_speaker[k] for k in shard}) for shard in shards] == [[f"spk{s}"] for s in range(5)]
    assert [len(shard) for shard in shards] == sizes
    assert len((set_dir / "text").read_text().splitlines()) == 40
    # spk0 comes back after spk1: refused at the plan, naming the key, its line and the speaker's first key
    speakers[20] = "spk0"
    (wd / "data/toy/utt2spk").write_text("".join(f"{k} {s}\n" for k, s in zip(keys, speakers)))
    refused = run_snakemake(wd, "-n")
    assert refused.returncode != 0
    assert ("datasets.toy: stages.upper.sharding.keep_together: spk 'spk0' of key 'utt020' (data/toy/wav.scp:21) comes back after other values "
            "(its first key: 'utt000' (data/toy/wav.scp:1))") in refused.stdout + refused.stderr
