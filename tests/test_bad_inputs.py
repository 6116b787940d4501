"""Bad data, config and runner code fed to real `snakemake` (and `snakeshard plan`) runs.

Every case must fail with a non-zero exit and a message naming what to fix (key, file, line,
config key path), and must not destroy results computed before. Data and config errors
happen while the Snakefile is parsed (planning runs at parse time), so `-n` dry runs see them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import (PROJECT, TOY_MODULE, WORKFLOW_PARTS, copy_workflow, make_kaldi_dir, read_config, run_cli,
                      run_snakemake, write_config)

ERROR_PREFIX = "snakeshard: error: "
WAV = "data/demo/wav/cards-001.wav"
@pytest.fixture
def toy(toy_workdir: Path) -> Path:
    """conftest's toy workflow (40 keys, 4 shards, toy.UpperRunner)."""
    return toy_workdir


def output(proc) -> str:
    return proc.stdout + proc.stderr


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root`` with its bytes and mtime."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def append_line(wd: Path, line: str) -> None:
    with open(wd / "data/toy/wav.scp", "a") as f:
        f.write(line + "\n")


def use_jsonl(wd: Path, keys: list[str]) -> None:
    """Point dataset 'toy' at a JSON Lines file holding ``keys``."""
    (wd / "data/x.jsonl").write_text("".join(json.dumps({"key": k, "audio": WAV}) + "\n" for k in keys))
    config = read_config(wd)
    config["datasets"]["toy"] = {"path": "data/x.jsonl", "format": "jsonl"}
    write_config(wd, config)


def set_stage(wd: Path, **changes) -> None:
    config = read_config(wd)
    config["stages"]["upper"].update(changes)
    write_config(wd, config)


def rename_stage(wd: Path, old: str, new: str) -> None:
    config = read_config(wd)
    config["stages"][new] = config["stages"].pop(old)
    write_config(wd, config)


def rename_stage_key(wd: Path, old: str, new: str) -> None:
    config = read_config(wd)
    stage = config["stages"]["upper"]
    stage[new] = stage.pop(old)
    write_config(wd, config)


def set_top(wd: Path, **changes) -> None:
    config = read_config(wd)
    config.update(changes)
    write_config(wd, config)


# (id, edit of a working toy workflow, substrings the error must contain)
DATA_CASES = [
    ("missing-audio", lambda wd: append_line(wd, "utt040 data/toy/missing.wav"),
     ["1 audio file(s) not found", "key 'utt040'", "data/toy/missing.wav", "data/toy/wav.scp:41"]),
    ("duplicate-key", lambda wd: append_line(wd, f"utt007 {WAV}"),
     ["duplicate key(s)", "'utt007'", "data/toy/wav.scp:41", "first at data/toy/wav.scp:8"]),
    # a repeated key in a table beside the key file took its last line silently (a Kaldi user's trial: WER moved)
    ("duplicate-key-in-text", lambda wd: (wd / "data/toy/text").write_text(
        "".join(f"utt{n:03d} words\n" for n in range(40)) + "utt007 other words\n"),
     ["duplicate key(s)", "'utt007'", "data/toy/text:41", "first at data/toy/text:8"]),
    ("kaldi-key-with-space", lambda wd: append_line(wd, "utt 1 data/x.wav"),
     ["data/toy/wav.scp:41", "'utt 1 data/x.wav'", "keys and paths must be free of whitespace"]),
    ("jsonl-key-with-space", lambda wd: use_jsonl(wd, ["a", "b", "a b", "c"]),
     ["datasets.toy: 1 key(s) are empty or contain whitespace", "'a b'", "data/x.jsonl:3"]),
    ("empty-key-list", lambda wd: (wd / "data/toy/wav.scp").write_text(""),
     ["datasets.toy: dataset data/toy has no items", "data/toy/wav.scp lists no key"]),
    ("blank-line", lambda wd: append_line(wd, ""),
     ["data/toy/wav.scp:41: empty line"]),
    # a wav.scp written for another directory: counted, 5 listed and the rest counted, where they were looked for
    ("seven-missing-relative-audio",
     lambda wd: [append_line(wd, f"utt{n:03d} wav/utt{n:03d}.wav") for n in range(40, 47)],
     ["7 audio file(s) not found: key 'utt040': wav/utt040.wav (data/toy/wav.scp:41), key 'utt041'",
      "key 'utt044': wav/utt044.wav (data/toy/wav.scp:45) and 2 more (relative audio paths are taken from the "
      "working directory "]),
]

# (id, config edit, substrings naming the config key path)
CONFIG_CASES = [
    ("num-shards-0", lambda wd: set_stage(wd, sharding={"num_shards": 0}),
     ["stages.upper.sharding.num_shards", "0 is less than the minimum of 1"]),
    ("unknown-top-level-key", lambda wd: set_top(wd, shards=4),
     ["(top level)", "'shards' was unexpected"]),
    ("misspelt-stage-key", lambda wd: set_stage(wd, provider_conifg={}),
     ["stages.upper", "'provider_conifg' was unexpected"]),
    ("both-num-shards-and-shard-size", lambda wd: set_stage(wd, sharding={"num_shards": 2, "shard_size": 5}),
     ["stages.upper.sharding", "exactly one of num_shards, shard_size, shard_seconds", "['num_shards', 'shard_size']"]),
    ("no-sharding-mode", lambda wd: set_stage(wd, sharding={}),
     ["stages.upper.sharding", "exactly one of num_shards, shard_size, shard_seconds"]),
    ("undefined-dataset", lambda wd: set_stage(wd, datasets=["toy", "dev"]),
     ["stages.upper.datasets", "'dev' is not defined under datasets", "['toy']"]),
    ("misspelt-dataset", lambda wd: set_stage(wd, datasets=["tyo"]),
     ["stages.upper.datasets: 'tyo' is not defined under datasets (['toy']); did you mean 'toy'?"]),
    # a user trial: blamed on datasets.out.dataset, which reads the stage's datasets, not on the misspelt name
    ("misspelt-dataset-read-downstream", lambda wd: (set_stage(wd, datasets=["tyo"]), set_top(wd, datasets={
        "toy": {"path": "data/toy"}, "out": {"from_stage": "upper", "dataset": "toy"}})),
     ["stages.upper.datasets: 'tyo' is not defined under datasets (['out', 'toy']); did you mean 'toy'?"]),
    ("misspelt-runner-class", lambda wd: set_stage(wd, runner="toy.UperRunner"),
     ["stages.upper.runner: cannot import 'toy.UperRunner': module 'toy' (", "defines no 'UperRunner' (did you mean "
      "'UpperRunner'?)"]),
    ("bad-dataset-format", lambda wd: set_top(wd, datasets={"toy": {"path": "data/toy", "format": "csv"}}),
     ["datasets.toy.format", "'csv'"]),
    ("batch-size-0", lambda wd: set_stage(wd, batch_size=0),
     ["stages.upper.batch_size", "less than the minimum of 1"]),
    ("unknown-runner-module", lambda wd: set_stage(wd, runner="nosuchpkg.Runner"),
     ["stages.upper.runner", "'nosuchpkg.Runner'", "no module named 'nosuchpkg'"]),
    ("unknown-provider-module", lambda wd: set_stage(wd, provider="nosuchpkg.sub.Provider"),
     ["stages.upper.provider", "'nosuchpkg.sub.Provider'"]),
    ("runner-not-an-import-path", lambda wd: set_stage(wd, runner="UpperRunner"),
     ["stages.upper.runner", "'UpperRunner' is not an import path"]),
    ("stage-name-not-a-rule-name", lambda wd: rename_stage(wd, "upper", "up-per"),
     ["stages", "'up-per' does not match"]),
    ("provider-config-sets-devices", lambda wd: set_stage(wd, provider_config={"devices": ["cuda:3"]}),
     ["stages.upper.provider_config.devices", "set by snakeshard"]),
    ("negative-retries", lambda wd: set_stage(wd, retries=-1),
     ["stages.upper.retries", "less than the minimum of 0"]),
    ("unknown-resource", lambda wd: set_stage(wd, resources={"memory": 100}),
     ["stages.upper.resources", "'memory' was unexpected"]),
    # a user trial: a misspelt provider: key printed the whole stage too, "... is not valid under any of the
    # given schemas" (the stage is none of the kinds of stage); now the one line, with the key it is close to
    ("misspelt-stage-key", lambda wd: rename_stage_key(wd, "provider", "provder"),
     ["  stages.upper: Additional properties are not allowed ('provder' was unexpected); 'provder': did you mean "
      "'provider'?\n"]),
    ("misspelt-sharding-key", lambda wd: set_stage(wd, sharding={"shard_secs": 10}),
     ["stages.upper.sharding: Additional properties are not allowed ('shard_secs' was unexpected); 'shard_secs': "
      "did you mean 'shard_seconds'?"]),
    ("stage-without-runner", lambda wd: rename_stage_key(wd, "runner", "model"),
     ["  stages.upper: 'runner' is a required property\n"]),
]


def assert_dry_run_refuses(wd: Path, expected: list[str]) -> None:
    """`snakemake -n` exits non-zero, prints every expected substring, and plans nothing on disk."""
    proc = run_snakemake(wd, "-n")
    assert proc.returncode != 0
    for text in expected:
        assert text in output(proc), (text, output(proc)[-2000:])
    assert "is not valid under any of the given schemas" not in output(proc)
    assert not (wd / "results").exists()


@pytest.mark.parametrize("edit, expected", [c[1:] for c in DATA_CASES], ids=[c[0] for c in DATA_CASES])
def test_bad_data_fails_dry_run_naming_key_and_file(toy, edit, expected):
    """Bad wav.scp / jsonl fed to `snakemake -n`: non-zero exit, message names key, file and line; nothing planned on disk."""
    edit(toy)
    assert_dry_run_refuses(toy, expected)


@pytest.mark.parametrize("edit, expected", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_fails_dry_run_naming_key_path(toy, edit, expected):
    """A config breaking the schema or a cross-reference fed to `snakemake -n`: non-zero exit, message names the key path."""
    edit(toy)
    assert_dry_run_refuses(toy, expected)


# A parse-time error of each kind: (id, edit, what its one error line names)
PARSE_ERROR_CASES = [
    ("schema", lambda wd: set_stage(wd, sharding={"num_shards": 0}), "config does not match"),
    ("unknown-runner-module", lambda wd: set_stage(wd, runner="nosuchpkg.Runner"), "stages.upper.runner: "),
    ("bad-data", lambda wd: append_line(wd, f"utt007 {WAV}"), "data/toy/wav.scp:41"),
    ("runner-syntax-error", lambda wd: ((wd / "syn.py").write_text("class R:\n    def forward(:\n"),
                                        set_stage(wd, runner="syn.R")), "stages.upper.runner: "),
]


@pytest.mark.parametrize("edit, expected", [c[1:] for c in PARSE_ERROR_CASES], ids=[c[0] for c in PARSE_ERROR_CASES])
def test_parse_time_error_is_one_line_without_tracebacks(toy, edit, expected):
    """An error raised while Snakemake parses the Snakefile prints its one `snakeshard: error:` line, not
    the frames of snakeshard's code that raised it (Snakemake printed six for a misspelt runner module)."""
    edit(toy)
    proc = run_snakemake(toy, "-n")
    assert proc.returncode != 0
    lines = output(proc).splitlines()
    errors = [line for line in lines if "snakeshard: error:" in line]
    assert len(errors) == 1 and errors[0].startswith(ERROR_PREFIX) and expected in errors[0], output(proc)
    assert not [line for line in lines if 'File "' in line or "Traceback" in line], output(proc)


PRESERVE_CASES = DATA_CASES + [c for c in CONFIG_CASES if c[0] in ("unknown-runner-module", "undefined-dataset")]


@pytest.fixture(scope="module")
def finished_toy(tmp_path_factory) -> Path:
    """The toy workflow of conftest's ``toy_workdir`` (40 keys, 4 shards), run to completion once per module."""
    wd = tmp_path_factory.mktemp("finished") / "wf"
    wd.mkdir()
    for part in WORKFLOW_PARTS:
        src = PROJECT / part
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, wd / part)
    (wd / "toy.py").write_text(TOY_MODULE)
    make_kaldi_dir(wd / "data/toy", [f"utt{i:03d}" for i in range(40)], Path(WAV))
    write_config(wd, {
        "output_dir": "results",
        "datasets": {"toy": {"path": "data/toy", "format": "kaldi"}},
        "stages": {"upper": {"runner": "toy.UpperRunner", "provider": "toy.ToyProvider", "provider_config": {},
                             "datasets": ["toy"], "sharding": {"num_shards": 4}}},
    })
    proc = run_snakemake(wd)
    assert proc.returncode == 0, output(proc)[-3000:]
    assert (wd / "results/upper/toy/merged.json").is_file()
    assert len(list((wd / "results/upper/toy").glob("split.*/done"))) == 4
    return wd


@pytest.mark.parametrize("edit, expected", [c[1:] for c in PRESERVE_CASES], ids=[c[0] for c in PRESERVE_CASES])
def test_bad_input_after_success_keeps_results(finished_toy, tmp_path, edit, expected):
    """Breaks data or config of a completed workflow and runs snakemake again: fails naming the problem, results/ untouched."""
    wd = tmp_path / "wf"
    shutil.copytree(finished_toy, wd, symlinks=True)  # copy2 keeps mtimes, so nothing looks newer than before
    results = wd / "results"
    before = snapshot(results)

    edit(wd)
    proc = run_snakemake(wd)
    assert proc.returncode != 0
    for text in expected:
        assert text in output(proc), (text, output(proc)[-2000:])
    assert snapshot(results) == before


def test_a_key_set_twice_in_the_config_file_is_refused_naming_both_lines(toy):
    """YAML keeps the last of two equal keys and drops the first without a word (Snakemake's loader too): a
    user trial's second `sharding:` further down a stage replaced the first. The dry run and `snakeshard status`
    refuse it, naming the file, both lines and the key's place; nothing is planned."""
    path = toy / "config/config.yaml"
    lines = path.read_text().splitlines(keepends=True)
    at = lines.index("  upper:\n") + 1
    lines[at:at] = ["    retries: 1\n", "    retries: 2\n"]
    path.write_text("".join(lines))
    message = (f"config/config.yaml:{at + 2}: stages.upper.retries is set twice (first at line {at + 1}); YAML keeps "
               "the last one and drops the first without a word: remove one")
    assert_dry_run_refuses(toy, [ERROR_PREFIX + message])
    status = run_cli(toy, "status")
    assert status.returncode != 0 and message in status.stderr, status.stderr


def test_provider_config_keys_the_provider_does_not_take_are_refused_at_parse_all_at_once(toy, tmp_path):
    """A provider that declares its keys (``config_keys``, a literal in its class body, as every built-in stage's
    does): each key it does not take is named in one parse error, with the key it is close to. Before, the
    built-in stages refused them in the canary job, one per run (a user trial: two typos, two runs)."""
    wd = copy_workflow(tmp_path / "shipped")
    config = read_config(wd)
    config["stages"]["fbank"]["provider_config"] = {"num_mel_bin": 80, "dithr": 0.0, "colour": "blue"}
    write_config(wd, config)
    assert_dry_run_refuses(wd, [
        ERROR_PREFIX + "stages.fbank.provider_config: 'num_mel_bin' (did you mean 'num_mel_bins'?), 'dithr' (did "
        "you mean 'dither'?), 'colour' are not keys that snakeshard.stages.fbank.FbankProvider takes (num_mel_bins, "
        "frame_length, frame_shift, dither, "])
    # a provider of the user's own: the same check once it declares its keys; without, any key is passed on
    (toy / "keyed.py").write_text("from toy import ToyProvider\n\n\nclass KeyedProvider(ToyProvider):\n"
                                  "    config_keys = ('suffix', 'item_delay')\n")
    set_stage(toy, provider="keyed.KeyedProvider", provider_config={"sufix": "!"})
    assert_dry_run_refuses(toy, [ERROR_PREFIX + "stages.upper.provider_config: 'sufix' (did you mean 'suffix'?) is "
                                 "not a key that keyed.KeyedProvider takes (suffix, item_delay)"])
    # computed rather than written out: read without importing, it cannot be known, and was taken as undeclared
    # (every key passed on, silently; a code review)
    (toy / "keyed.py").write_text("from toy import ToyProvider\n\nBASE = ('suffix',)\n\n\nclass KeyedProvider(ToyProvider):\n"
                                  "    config_keys = BASE + ('item_delay',)\n")
    assert_dry_run_refuses(toy, [ERROR_PREFIX + "stages.upper.provider: keyed.KeyedProvider.config_keys = BASE + "
                                 f"('item_delay',) ({toy / 'keyed.py'}:7) is not a literal: snakeshard reads it from the "
                                 "source at parse, without importing the module; write its value out"])
    set_stage(toy, provider="toy.ToyProvider")
    assert run_snakemake(toy, "-n").returncode == 0


def test_missing_runner_class_fails_at_parse_naming_class_and_key(toy):
    """runner 'toy.NoSuchRunner' (module exists, class does not): found by reading the module's source at parse, no job runs."""
    set_stage(toy, runner="toy.NoSuchRunner")
    proc = run_snakemake(toy)
    assert proc.returncode != 0
    assert "stages.upper.runner: cannot import 'toy.NoSuchRunner': module 'toy'" in output(proc)
    assert "defines no 'NoSuchRunner'" in output(proc)
    assert not list((toy / "results/upper/toy").glob("split.*/done"))
    assert not list((toy / "results/upper/toy").glob("logs/split.*.log"))


def test_runner_class_missing_at_job_time_fails_the_shard_naming_it(toy):
    """A module that binds names dynamically (star import) passes the parse check; the job then names the class and key."""
    (toy / "dyn.py").write_text("from toy import *\n")
    # canary 0: each shard job's own line (with the canary on, by default, its one job fails with it instead)
    set_stage(toy, runner="dyn.NoSuchRunner", provider="toy.ToyProvider", canary=0)
    proc = run_snakemake(toy)
    assert proc.returncode != 0
    set_dir = toy / "results/upper/toy"
    for n in range(4):
        log = (set_dir / f"logs/split.{n}.log").read_text()
        assert log.strip().splitlines()[-1] == (
            ERROR_PREFIX + "stages.upper.runner: module 'dyn' has no attribute 'NoSuchRunner'"), log
        assert not (set_dir / f"split.{n}/done").exists()
    assert not (set_dir / "merged.json").exists()
    assert "NoSuchRunner" in output(proc)  # show-failed-logs puts it on the console too


# A toy stage module whose own top-level import is of a package that is not installed
MISSING_PACKAGE_MODULES = [
    ("import", '"""A stage."""\nimport os\nimport not_a_real_package\n', 3, "'not_a_real_package'"),
    ("from-import", "import os\nlog = None\nfrom not_a_real_package.sub import thing\n", 3,
     "'not_a_real_package.sub'"),
]


@pytest.mark.parametrize("role", ["runner", "provider"])
@pytest.mark.parametrize("source, line, named", [c[1:] for c in MISSING_PACKAGE_MODULES],
                         ids=[c[0] for c in MISSING_PACKAGE_MODULES])
def test_stage_module_importing_a_missing_package_fails_at_parse(toy, role, source, line, named):
    """The module's top-level imports are looked up (not imported) at parse: a dry run refuses it naming the
    config key, file:line and the package; every shard job would have failed importing it."""
    (toy / "needs_pkg.py").write_text(source + TOY_MODULE)
    set_stage(toy, **{role: "needs_pkg." + ("UpperRunner" if role == "runner" else "ToyProvider")})
    proc = run_snakemake(toy, "-n")
    assert proc.returncode != 0
    assert (f"{ERROR_PREFIX}stages.upper.{role}: {toy / 'needs_pkg.py'}:{line} imports {named}, but no module "
            "named 'not_a_real_package' is installed") in proc.stderr, output(proc)
    assert not (toy / "results").exists()


VENDORED = "import sys\nsys.path.insert(0, 'vendor')\nimport vendored_pkg\n"


def test_imports_after_other_statements_are_left_to_the_job(toy):
    """An import after a statement that may make it findable (here sys.path.insert) is not looked up at
    parse: the stage runs."""
    (toy / "vendor").mkdir()
    (toy / "vendor/vendored_pkg.py").write_text("")
    (toy / "vendoring.py").write_text(VENDORED + TOY_MODULE)
    set_stage(toy, runner="vendoring.UpperRunner", provider="vendoring.ToyProvider")
    proc = run_snakemake(toy)
    assert proc.returncode == 0, output(proc)[-3000:]
    assert (toy / "results/upper/toy/merged.json").is_file()


def broken_import_chain(wd: Path) -> str:
    """A stage module that imports a module of its own that imports a package that is not installed: not
    visible at parse (only the stage module's own imports are looked up). The job's error line for it."""
    (wd / "helper.py").write_text("import not_a_real_package\n")
    (wd / "chain.py").write_text("import helper\n" + TOY_MODULE)
    set_stage(wd, runner="chain.UpperRunner")
    return (f"{ERROR_PREFIX}stages.upper.runner: importing chain.UpperRunner failed at {wd / 'helper.py'}:1: "
            "No module named 'not_a_real_package'")


def test_module_failing_to_import_fails_each_shard_with_one_line_naming_key_and_package(toy):
    """Every shard job ends in one error line naming the config key, where the import failed and the
    missing package (its traceback above it in the log); nothing merges."""
    line = broken_import_chain(toy)
    set_stage(toy, canary=0)  # each shard job's own line (the canary's: the next test)
    assert run_snakemake(toy, "-n").returncode == 0
    proc = run_snakemake(toy)
    assert proc.returncode != 0
    set_dir = toy / "results/upper/toy"
    for n in range(4):
        log = (set_dir / f"logs/split.{n}.log").read_text()
        assert log.strip().splitlines()[-1].startswith(line), log
        assert "ModuleNotFoundError: No module named 'not_a_real_package'" in log  # the traceback
    assert not (set_dir / "merged.json").exists()
    assert line in proc.stderr  # each job's line reaches snakemake's own output too


def test_module_failing_to_import_fails_the_canary_once(toy):
    """With the canary on, its one job fails with that line and no shard job starts."""
    line = broken_import_chain(toy)
    set_stage(toy, canary=2)
    proc = run_snakemake(toy)
    assert proc.returncode != 0
    log = (toy / "results/upper/logs/canary.log").read_text()
    last = log.strip().splitlines()[-1]
    assert last.startswith(f"{ERROR_PREFIX}canary of stage 'upper' failed, so none of its shard jobs was started"), log
    assert line.removeprefix(ERROR_PREFIX) in last
    assert not list((toy / "results/upper/toy").glob("logs/split.*.log"))
    assert not list((toy / "results/upper/toy").glob("split.*/.attempt"))


NEWLINE_RUNNER = '''
from snakeshard import BaseRunner


class NewlineRunner(BaseRunner):
    @staticmethod
    def forward(key, **env):
        return {"text": "first line\\nsecond line" if key == "utt013" else key.upper()}
'''


def test_forward_value_with_newline_fails_its_shard_only(toy):
    """A runner returns a value holding a newline for utt013: that shard fails naming key and field, no done; others finish."""
    (toy / "nl.py").write_text(NEWLINE_RUNNER)
    set_stage(toy, runner="nl.NewlineRunner")
    proc = run_snakemake(toy)
    assert proc.returncode != 0
    set_dir = toy / "results/upper/toy"
    bad = next(n for n in range(4) if "utt013\n" in (set_dir / f"split.{n}/keys").read_text())
    log = (set_dir / f"logs/split.{bad}.log").read_text()
    last = log.strip().splitlines()[-1]
    assert last.startswith(ERROR_PREFIX + f"shard {bad} "), log
    assert "item 'utt013'" in last and "field 'text' holds a line break ('\\n')" in last
    assert not (set_dir / f"split.{bad}/done").exists()
    good = [n for n in range(4) if n != bad]
    for n in good:
        assert (set_dir / f"split.{n}/done").is_file()
    assert not (set_dir / "merged.json").exists()

    # Fix the runner and rerun: its source is part of the stage fingerprint, so every shard runs again
    # (the finished ones were made by the old code).
    kept = {n: (set_dir / f"split.{n}/done").read_bytes() for n in good}
    fixed = NEWLINE_RUNNER.replace('"first line\\nsecond line"', '"fixed"')
    assert fixed != NEWLINE_RUNNER
    (toy / "nl.py").write_text(fixed)
    again = run_snakemake(toy)
    assert again.returncode == 0, output(again)[-3000:]
    assert all((set_dir / f"split.{n}/done").read_bytes() != kept[n] for n in good)
    assert "utt013 fixed\n" in (set_dir / "text").read_text()


@pytest.mark.parametrize("edit, expected", [c[1:] for c in DATA_CASES[:5]], ids=[c[0] for c in DATA_CASES[:5]])
def test_plan_cli_on_bad_dataset_prints_one_line(toy, edit, expected):
    """`snakeshard plan` on bad data: exit 1, stdout empty, stderr one line 'snakeshard: error: ...' naming the problem."""
    edit(toy)
    proc = run_cli(toy, "plan")
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), proc.stderr
    for text in expected:
        assert text in lines[0]
    assert not (toy / "results").exists()


def write_utt2dur(wd: Path, bad_line: int) -> None:
    keys = [line.split()[0] for line in (wd / "data/toy/wav.scp").read_text().splitlines()]
    (wd / "data/toy/utt2dur").write_text(
        "".join(f"{k} {'1.x' if n == bad_line else '1.0'}\n" for n, k in enumerate(keys, 1)))


def write_segments(wd: Path) -> None:
    (wd / "data/toy/segments").write_text("seg1 utt000 0 1.0\nseg2 utt000 1.0 2,5\n")


def write_jsonl(wd: Path, records: list, bom: bool = False) -> None:
    (wd / "data/x.jsonl").write_text("\ufeff" * bom + "".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    config = read_config(wd)
    config["datasets"]["toy"] = {"path": "data/x.jsonl", "format": "jsonl"}
    write_config(wd, config)


BAD_FIELD_CASES = [
    ("utt2dur-not-a-number", lambda wd: write_utt2dur(wd, 3), ["data/toy/utt2dur:3"]),
    ("segments-not-a-number", write_segments, ["data/toy/segments:2", "seg2"]),
    ("jsonl-duration-not-a-number",
     lambda wd: write_jsonl(wd, [{"key": "a", "audio": WAV, "duration": 1}, {"key": "b", "audio": WAV, "duration": "1.2s"}]),
     ["data/x.jsonl:2", "duration"]),
    ("jsonl-audio-not-a-string", lambda wd: write_jsonl(wd, [{"key": "a", "audio": 7}]),
     ["data/x.jsonl:1", "audio"]),
    ("jsonl-duration-true",  # JSON's true is no 1 s
     lambda wd: write_jsonl(wd, [{"key": "a", "audio": WAV, "duration": 1}, {"key": "b", "audio": WAV, "duration": True}]),
     ["snakeshard: error: datasets.toy: ", "data/x.jsonl:2: 'duration' of 'b' True is not a number of seconds"]),
    ("jsonl-line-an-array", lambda wd: write_jsonl(wd, [{"key": "a", "audio": WAV}, ["b", WAV]]),
     ["data/x.jsonl:2: an array, not a JSON object; a JSON Lines record is one {...} per line"]),
    ("jsonl-with-a-bom", lambda wd: write_jsonl(wd, [{"key": "a", "audio": WAV}], bom=True),
     ["data/x.jsonl:1: the file starts with a UTF-8 byte order mark (BOM), which JSON Lines does not allow; remove "
      "it, e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' "]),
    ("jsonl-without-its-format",
     lambda wd: (write_jsonl(wd, [{"key": "a", "audio": WAV}]),
                 set_top(wd, datasets={"toy": {"path": "data/x.jsonl"}})),
     ["data/x.jsonl: not a Kaldi data dir (no wav.scp, no feats.scp); a JSON Lines manifest needs format: jsonl in "
      "its datasets entry"]),
]


@pytest.mark.parametrize("edit, expected", [c[1:] for c in BAD_FIELD_CASES], ids=[c[0] for c in BAD_FIELD_CASES])
def test_plan_cli_on_malformed_field_names_file_and_line(toy, edit, expected):
    """A non-numeric duration / segment time or a non-string jsonl audio: `snakeshard plan` prints one line naming file:line."""
    edit(toy)
    proc = run_cli(toy, "plan")
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), proc.stderr
    for text in expected:
        assert text in lines[0]


def test_a_job_imports_the_users_class_and_explains_each_failure(tmp_path, monkeypatch):
    """user_code.import_object, what a job calls for stages.X.runner/provider: a class it finds is returned;
    a path naming no module or no class (the module removed or edited after the parse) raises the parse-time
    check's ConfigError naming the config key; a module that is there but fails importing a package that is
    not installed raises a ConfigError naming the key, the failed import's file:line and the package, caused by
    the ModuleNotFoundError."""
    from snakeshard.core.user_code import import_object
    from snakeshard.errors import ConfigError

    (tmp_path / "good_stage.py").write_text("class Runner:\n    pass\n")
    (tmp_path / "broken_stage.py").write_text("import no_such_package_xyz\n\nclass Runner:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_object("good_stage.Runner", "stages.s.runner").__name__ == "Runner"
    with pytest.raises(ConfigError, match=r"stages\.s\.runner: cannot import 'gone_stage\.Runner': no module named"):
        import_object("gone_stage.Runner", "stages.s.runner")
    with pytest.raises(ConfigError, match=r"stages\.s\.runner: cannot import 'good_stage\.Other'.*defines no 'Other'"):
        import_object("good_stage.Other", "stages.s.runner")
    with pytest.raises(ConfigError, match=r"stages\.s\.provider: 'Runner' is not an import path"):
        import_object("Runner", "stages.s.provider")
    with pytest.raises(ConfigError, match=r"stages\.s\.runner: importing broken_stage\.Runner failed at "
                       r".*broken_stage\.py:1: No module named 'no_such_package_xyz'") as raised:
        import_object("broken_stage.Runner", "stages.s.runner")
    assert isinstance(raised.value.__cause__, ModuleNotFoundError)  # its traceback goes to the job's log


def test_a_json_lines_record_without_audio_names_the_audio_field(tmp_path):
    """A record whose audio sits under another field (here "wav"): the item that needs its audio fails naming
    key, file:line and the config key that says which field holds the audio."""
    from snakeshard import load_dataset
    from snakeshard.errors import DataError

    path = tmp_path / "m.jsonl"
    path.write_text('{"key": "a", "wav": "a.wav", "duration": 1.5}\n')
    dataset = load_dataset({"name": "small", "path": str(path), "format": "jsonl"})
    with pytest.raises(DataError) as failed:
        dataset.load_audio("a")
    assert str(failed.value) == f"key 'a' ({path}:1) has no audio; datasets.small.audio_field is 'audio'"


def test_kaldi_dir_lines_that_validate_data_dir_refuses_are_noted_not_refused(toy):
    """What Kaldi's validate_data_dir.sh refuses but a filtered data dir often holds: a text (or utt2spk) line whose
    key has no recording is ignored, a key with no text line has no 'text' field, a spk2utt without utt2spk is not
    read. The plan goes on (40 keys, 4 shards) and says each, naming file, counts and keys: `snakeshard plan` under
    its table, and a run's driver once on stderr however many times it parses."""
    data = toy / "data/toy"
    keys = [line.split()[0] for line in (data / "wav.scp").read_text().splitlines()]
    (data / "text").write_text("".join(f"{k} hello\n" for k in keys[2:]) + "gone1 bye\ngone2 bye\n")
    (data / "spk2utt").write_text("spk " + " ".join(keys) + "\n")
    proc = run_cli(toy, "plan")
    assert proc.returncode == 0, output(proc)
    notes = [line for line in proc.stdout.splitlines() if line.startswith("note: ")]
    assert notes == [
        f"note: data/toy/text: 2 key(s) with no recording in wav.scp, ignored: 'gone1' (line 39), 'gone2' (line 40) "
        "(Kaldi's utils/fix_data_dir.sh drops them)",
        "note: data/toy/text: no line for 2 of 40 key(s), their 'text' field unset: 'utt000', 'utt001'",
        "note: data/toy/spk2utt: not read: speakers come from utt2spk, which this dir lacks "
        "(Kaldi's utils/spk2utt_to_utt2spk.pl makes it)",
    ], proc.stdout
    dry = run_snakemake(toy, "-n")
    assert dry.returncode == 0, output(dry)[-3000:]
    said = [line for line in dry.stderr.splitlines() if line.startswith("snakeshard: note: data/toy/")]
    assert said == ["snakeshard: " + n for n in notes], dry.stderr
    # A data dir Kaldi would accept says nothing.
    (data / "text").write_text("".join(f"{k} hello\n" for k in keys))
    (data / "utt2spk").write_text("".join(f"{k} spk\n" for k in keys))
    quiet = run_cli(toy, "plan")
    assert quiet.returncode == 0 and "note:" not in quiet.stdout, output(quiet)
    # a spk2utt beside utt2spk is checked against it (Kaldi's validate_data_dir.sh; a trial: never read)
    (data / "spk2utt").write_text("spk " + " ".join(keys) + "\n")
    assert "note:" not in run_cli(toy, "plan").stdout
    (data / "spk2utt").write_text("spk " + " ".join(keys[:5]) + "\nother " + " ".join(keys[5:]) + "\n")
    disagreeing = run_cli(toy, "plan")
    assert [line for line in disagreeing.stdout.splitlines() if line.startswith("note: ")] == [
        "note: data/toy/spk2utt: does not agree with utt2spk (data/toy/utt2spk:6: 'utt005' is speaker 'spk'); "
        "speakers come from utt2spk (Kaldi's utils/utt2spk_to_spk2utt.pl remakes spk2utt)"], output(disagreeing)
    (data / "spk2utt").unlink()
    # keys out of Kaldi's order (LC_ALL=C sort): noted, the shards keep the order (a Kaldi user's trial)
    lines = (data / "wav.scp").read_text().splitlines(keepends=True)
    (data / "wav.scp").write_text("".join(lines[:5] + lines[6:7] + lines[5:6] + lines[7:]))
    unsorted = run_cli(toy, "plan")
    assert unsorted.returncode == 0, output(unsorted)
    assert [line for line in unsorted.stdout.splitlines() if line.startswith("note: ")] == [
        "note: data/toy/wav.scp: keys are not sorted (data/toy/wav.scp:7: 'utt005' after 'utt006'); shards and merged "
        "files keep this order, and Kaldi's tools want it sorted (LC_ALL=C sort, or utils/fix_data_dir.sh)"]


def test_a_chained_dataset_whose_upstream_shard_lost_its_done_is_named_not_a_type_error(tmp_path):
    """A trial's scoring canary met a TypeError ('NoneType' object is not subscriptable) when the upstream shard's
    done was gone (another run redoing it): the error names the shard dir and what to do."""
    from snakeshard.core.data import StageOutputDataset
    from snakeshard.errors import DataError

    (tmp_path / "split.0").mkdir()
    (tmp_path / "wav.scp").write_text("k1 /nowhere/k1.wav\n")  # the merged set's listing, as a stage's output has one
    with pytest.raises(DataError, match=r"split\.0/done is missing: the upstream shard this job reads is not done "
                                        r"\(another run redoing it\?\); run snakemake again"):
        StageOutputDataset({"path": str(tmp_path), "upstream_dirs": [str(tmp_path / "split.0")]})
