"""First-contact defects of issue 25, part 2 (each test failed before its fix): ESPnet3's provider style and
int indices in-process, DanLing's meters made on first use, messages naming the real stage and dataset,
the command line's help and version.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PROJECT, make_kaldi_dir, read_config, run_cli, run_snakemake, write_config
from snakeshard import BaseRunner, EnvironmentProvider, InferenceProvider
from snakeshard import load_dataset
from snakeshard.errors import ContractError, DataError

DEMO = {"path": str(PROJECT / "data/demo")}
DEMO_KEYS = [line.split()[0] for line in (PROJECT / "data/demo/wav.scp").read_text().splitlines()]


class KeyRunner(BaseRunner):
    @staticmethod
    def forward(key, *, dataset, model):
        return {"text": model(dataset[key]["key"])}


# -- 1. an ESPnet3-style provider (build_worker_setup_fn only) runs in-process as in a shard job --

class Espnet3StyleProvider(InferenceProvider):
    """ESPnet3's pattern: the provider returns a zero-argument function that builds the env."""

    setups = 0

    def build_worker_setup_fn(self):
        config = self.config

        def setup():
            type(self).setups += 1
            return {"dataset": load_dataset(config["dataset"]), "model": str.upper}

        return setup


class BuildEnvProvider(InferenceProvider):
    """snakeshard's own pattern: build_env."""

    def build_env(self):
        return {"dataset": load_dataset(self.config["dataset"]), "model": str.upper}


class PlainWorkerSetupProvider(EnvironmentProvider):
    """ESPnet3's pattern on the plain EnvironmentProvider: only the worker setup function."""

    def build_worker_setup_fn(self):
        return lambda: {"dataset": load_dataset(self.config["dataset"]), "model": str.upper}


@pytest.mark.parametrize("provider_cls", [Espnet3StyleProvider, BuildEnvProvider, PlainWorkerSetupProvider])
def test_both_provider_styles_run_in_process(provider_cls, tmp_path):
    """runner(keys) in-process with a provider overriding only build_worker_setup_fn (was: NotImplementedError
    '... must implement build_env()'), or only build_env: the same results, without and with output_dir."""
    provider = provider_cls({"dataset": DEMO})
    assert KeyRunner(provider)(DEMO_KEYS[:2]) == [{"text": k.upper(), "key": k} for k in DEMO_KEYS[:2]]
    assert KeyRunner(provider, output_dir=tmp_path)(DEMO_KEYS[:3])["items"] == 3
    assert (tmp_path / "text").read_text() == "".join(f"{k} {k.upper()}\n" for k in DEMO_KEYS[:3])


def test_espnet3_style_inference_provider_builds_once_in_process():
    """In-process, InferenceProvider builds the env once per provider, through build_worker_setup_fn()()."""
    Espnet3StyleProvider.setups = 0
    provider = Espnet3StyleProvider({"dataset": DEMO})
    KeyRunner(provider)(DEMO_KEYS[:1])
    KeyRunner(provider)(DEMO_KEYS[1:2])
    assert Espnet3StyleProvider.setups == 1


def test_provider_implementing_nothing_names_both_entries():
    class Bare(InferenceProvider):
        pass

    with pytest.raises(NotImplementedError, match=r"Bare must implement build_env\(\) \(or build_worker_setup_fn"):
        KeyRunner(Bare({"dataset": DEMO}))(DEMO_KEYS[:1])


ESPNET3_MODULE = '''
from snakeshard import BaseRunner, InferenceProvider
from snakeshard import load_dataset


class Espnet3StyleProvider(InferenceProvider):
    def build_worker_setup_fn(self):
        config = self.config

        def setup():
            return {"dataset": load_dataset(config["dataset"]), "model": str.upper}

        return setup


class KeyRunner(BaseRunner):
    @staticmethod
    def forward(key, *, dataset, model):
        return {"text": model(dataset[key]["key"])}
'''


def test_espnet3_style_provider_in_a_shard_job_and_in_process_agree(workdir, monkeypatch):
    """The same module in a real run (canary on, 2 shards) and in-process: the same text for every key."""
    (workdir / "espnet3_style.py").write_text(ESPNET3_MODULE)
    config = read_config(workdir)
    config["stages"] = {"upper": {"runner": "espnet3_style.KeyRunner", "provider": "espnet3_style.Espnet3StyleProvider",
                                  "datasets": ["demo"], "sharding": {"num_shards": 2}, "canary": 1}}
    config["datasets"] = {"demo": config["datasets"]["demo"]}
    write_config(workdir, config)
    run = run_snakemake(workdir)
    assert run.returncode == 0, run.stderr[-3000:]
    merged = (workdir / "results/upper/demo/text").read_text()
    assert merged == "".join(f"{k} {k.upper()}\n" for k in DEMO_KEYS)

    monkeypatch.syspath_prepend(str(workdir))
    monkeypatch.chdir(workdir)
    from espnet3_style import Espnet3StyleProvider as Provider
    from espnet3_style import KeyRunner as Runner

    results = Runner(Provider({"dataset": {"path": "data/demo"}}))(DEMO_KEYS)
    assert "".join(f"{r['key']} {r['text']}\n" for r in results) == merged


# -- 2. ints are positions into the env's dataset (ESPnet3's runner(range(n))), in its order --

def test_int_indices_are_positions_into_the_dataset_in_plan_order():
    """runner(range(2)) runs the dataset's first two keys (was: KeyError: 0); the dataset's order is the
    plan's (the keys of split.0, then split.1, ...); list(dataset) gives the keys."""
    provider = BuildEnvProvider({"dataset": DEMO})
    assert [r["key"] for r in KeyRunner(provider)(range(2))] == DEMO_KEYS[:2]
    assert [r["key"] for r in KeyRunner(provider)([9, 0])] == [DEMO_KEYS[9], DEMO_KEYS[0]]
    assert list(load_dataset(DEMO)) == DEMO_KEYS
    with pytest.raises(KeyError, match=r"0: a dataset's keys are strings; dataset.keys\[0\] is the key at that "
                                       r"position \(dataset.keys\[0\] is 'cards-001'\)"):
        load_dataset(DEMO)[0]  # an ESPnet3 dataset's dataset[0]: was a bare KeyError: 0 (a user trial)

    from snakeshard.core.plan import make_plan

    shard_keys = []
    make_plan({"name": "demo", **DEMO}, {"num_shards": 3}, on_shard=lambda n, rows: shard_keys.append(rows.keys))
    assert len(shard_keys) == 3 and [k for keys in shard_keys for k in keys] == DEMO_KEYS


def test_int_indices_refused_outside_the_dataset_or_without_one():
    provider = BuildEnvProvider({"dataset": DEMO})
    with pytest.raises(ContractError, match=r"position 10 is outside the dataset's 10 keys \(0 to 9\)"):
        KeyRunner(provider)([10])
    with pytest.raises(ContractError, match=r"position -1 is outside"):
        KeyRunner(provider)([-1])

    class DictDataset(InferenceProvider):
        def build_env(self):
            return {"dataset": {"a": {"key": "a"}}, "model": str.upper}

    with pytest.raises(ContractError, match=r"runner\(keys\): 0 is an int; keys are strings \(list\(dataset\) gives "
                                            r"a dataset's keys in order\).*this env has a dict 'dataset'"):
        KeyRunner(DictDataset({}))(range(1))
    with pytest.raises(ContractError, match=r"runner\(keys\): 1.5 is a float; keys are strings"):
        KeyRunner(provider)([DEMO_KEYS[0], 1.5])


# -- 3. DanLing's AverageMeters: meters start on first use, attribute access, merge across shards --

from snakeshard.metrics import AverageMeter, AverageMeters  # noqa: E402
from test_metrics import assert_close, partition, roundtrip  # noqa: E402


def test_average_meters_start_on_first_use_as_danlings():
    """AverageMeters() then update(loss=...) (was: KeyError: no meter 'loss' (declared: [])), DanLing's numbers."""
    meters = AverageMeters()
    meters.update(loss=0.6)
    meters.update({"loss": 0.8, "auroc": 0.7}, n=3)
    assert list(meters) == ["loss", "auroc"]
    assert meters["loss"].count == 4 and math.isclose(meters["loss"].avg, (0.6 + 3 * 0.8) / 4, rel_tol=1e-12)
    assert f"{meters['auroc']:.4f}" == "0.7000 (0.7000)"
    fresh = AverageMeters()
    fresh["acc"].update(0.5)  # reading a name starts its meter too, as DanLing's DefaultDict does
    assert fresh.count == {"acc": 1}


def test_average_meters_attribute_access():
    meters = AverageMeters()
    meters.loss.update(0.7)  # DanLing's docstring example
    meters.loss.update(0.9)
    assert meters.loss is meters["loss"] and meters.loss.count == 2 and math.isclose(meters.loss.avg, 0.8)
    assert meters.avg == {"loss": meters.loss.avg}  # avg is the class's: all averages
    declared = AverageMeters("loss")
    declared.loss.update(1.0)
    with pytest.raises(AttributeError, match="no meter 'lsos'"):
        declared.lsos
    assert not hasattr(declared, "lsos") and "lsos" not in declared
    import copy
    import pickle

    assert pickle.loads(pickle.dumps(meters)).loss.count == 2 and copy.deepcopy(meters).avg == meters.avg


def _meters_pass(items):
    meters = AverageMeters()
    for name, value, n in items:
        if name == "count":  # an attribute of AverageMeters (all counts): by name
            meters.update({name: value}, n=n)
        else:
            getattr(meters, name).update(value, n)
    return meters


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("parts", [2, 5, 9])
def test_average_meters_started_in_other_orders_and_sets_merge_to_one_pass(parts, seed):
    """Shards whose meters started in different orders, some lacking a name (or every name): merging their JSON
    states, in any order, equals one AverageMeters over all values (counts exactly, sums to 1e-12; with dyadic
    values, exactly); before, the merge refused shards whose meter names differed."""
    rng = random.Random(seed)
    names = ["loss", "acc", "count", "grad_norm"]  # "count" is also an attribute: updated by name
    items = [(rng.choice(names[:3]) if i % 17 else "grad_norm", rng.uniform(-2, 2), rng.randint(1, 16))
             for i in range(120)]
    whole = _meters_pass(items)
    states = [roundtrip(_meters_pass(part).state()) for part in partition(items, parts, seed)]
    assert len({tuple(s["meters"]) for s in states}) > 1  # the shards started different names, or in other orders
    merged = AverageMeters.merge(states)
    shuffled = AverageMeters.merge(rng.sample(states, len(states)))
    for meters in (merged, shuffled):
        assert set(meters) == set(whole)
        assert meters.count == whole.count
        assert_close(meters.sum, whole.sum)
        assert_close(meters.avg, whole.avg)
    assert list(merged) == list(shuffled) and merged.sum == shuffled.sum  # the same bits in any order

    dyadic = [(name, round(value * 8) / 8, n) for name, value, n in items]
    one = _meters_pass(dyadic)
    exact = AverageMeters.merge([_meters_pass(p).state() for p in partition(dyadic, parts, seed)])
    assert exact.sum == one.sum and exact.count == one.count and exact.avg == one.avg


def test_average_meters_merge_keeps_an_empty_meter_harmless():
    """A shard that read a meter without updating it holds it empty: it adds nothing."""
    one, other = AverageMeters(), AverageMeters()
    one.update(loss=1.0, n=2)
    other.loss  # started, never updated
    other.update(acc=0.5)
    merged = AverageMeters.merge([one.state(), other.state()])
    assert merged.count == {"loss": 2, "acc": 1} and merged.avg == {"loss": 1.0, "acc": 0.5}
    assert AverageMeters.merge([AverageMeters().state()]).count == {}
    with pytest.raises(KeyError, match="no meter 'nope'"):
        merged["nope"]
    assert isinstance(merged["loss"], AverageMeter)


# -- 4. messages name the real stage and dataset, not stages.<stage> / datasets.<name> --

TEMPLATE_STAGE = PROJECT / "src/snakeshard/project_template/my_stage.py"


def energy_stage(wd: Path, stage: str, dataset: str, **settings) -> None:
    """``wd``'s config: one stage of the template's EnergyRunner (it loads each key's audio) over ``dataset``."""
    (wd / "my_stage.py").write_text(TEMPLATE_STAGE.read_text())
    config = read_config(wd)
    config["stages"] = {stage: {"runner": "my_stage.EnergyRunner", "provider": "my_stage.EnergyProvider",
                                "datasets": [dataset], **settings}}
    write_config(wd, config)


def failed_output(wd: Path, run) -> str:
    """What a failed run printed, and every log it left."""
    assert run.returncode != 0, run.stderr[-3000:]
    return run.stdout + run.stderr + "".join(p.read_text() for p in (wd / "results").rglob("logs/*.log"))


@pytest.mark.parametrize("job", [{}, {"canary": 2}, {"shards_per_job": 2}], ids=["shard", "canary", "run-shards"])
def test_wrong_sample_rate_names_the_stage(workdir, job):
    """A 16 kHz demo wav under a stage with sample_rate: 8000: the error names stages.energy8k.sample_rate (was:
    stages.<stage>.sample_rate), in a shard job, the canary, and a job of several shards."""
    config = read_config(workdir)
    config["datasets"] = {"demo": config["datasets"]["demo"]}
    write_config(workdir, config)
    energy_stage(workdir, "energy8k", "demo", sample_rate=8000, sharding={"num_shards": 2}, **job)
    out = failed_output(workdir, run_snakemake(workdir))
    assert "is 16000 Hz, the stage expects 8000 Hz (stages.energy8k.sample_rate)" in out, out[-3000:]
    assert "<stage>" not in out


def test_segment_past_the_recording_names_the_dataset(workdir, monkeypatch):
    """A segment ending 2 s past its recording's end: the error names datasets.segs.max_segment_overshoot (was:
    datasets.<name>.max_segment_overshoot); in-process, with an unnamed spec, the dataset spec's key."""
    segs = workdir / "data/segs"
    make_kaldi_dir(segs, ["rec1"], Path("data/demo/wav/cards-001.wav"))  # 1.095 s
    (segs / "segments").write_text("rec1-a rec1 0.00 0.50\nrec1-b rec1 0.50 3.10\n")
    config = read_config(workdir)
    config["datasets"] = {"segs": {"path": "data/segs", "format": "kaldi"}}
    write_config(workdir, config)
    energy_stage(workdir, "energy", "segs", sharding={"num_shards": 1})
    out = failed_output(workdir, run_snakemake(workdir))
    assert "ends past the end of data/demo/wav/cards-001.wav (1.095 s) by more than max_segment_overshoot=0.5 s; " \
           "fix the segment or set datasets.segs.max_segment_overshoot" in out, out[-3000:]
    assert "<name>" not in out

    monkeypatch.chdir(workdir)  # wav.scp's paths are relative to the project
    dataset = load_dataset({"path": "data/segs"})
    with pytest.raises(DataError, match="fix the segment or set max_segment_overshoot in the dataset spec"):
        dataset.load_audio("rec1-b")
    assert dataset.load_audio("rec1-a")[0].shape == (8000,)


# -- 5. --help describes every option; --version --

def test_every_option_of_every_command_has_help():
    """Every argument of the top-level parser and of each command's parser has a help string (was: init's DIR,
    plan --stage, run-shard --shard-dir, merge/report --set-dir, report --output, wer --hyp/--ref/--out had none)."""
    import argparse

    from snakeshard.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parsers = {"snakeshard": parser, **{f"snakeshard {name}": sub for name, sub in commands.choices.items()}}
    assert {"init", "plan", "status", "wer", "merge", "report", "run-shard", "run-shards"} <= set(commands.choices)
    missing = [f"{where} {'/'.join(action.option_strings) or action.metavar or action.dest}"
               for where, p in parsers.items() for action in p._actions
               if not action.help or action.help == argparse.SUPPRESS]
    assert missing == []


def test_version_option_prints_the_version(tmp_path):
    import snakeshard

    script = Path(sys.executable).parent / "snakeshard"
    runs = [subprocess.run([sys.executable, "-m", "snakeshard", "--version"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)]
    if script.exists():  # the console script `pip install` writes
        runs.append(subprocess.run([str(script), "--version"], cwd=tmp_path, capture_output=True, text=True,
                                   timeout=60))
    for run in runs:
        assert run.returncode == 0 and run.stdout == f"snakeshard {snakeshard.__version__}\n", run.stderr
    assert "--version" in run_cli(tmp_path, "--help").stdout


# -- 6. the README's "Your own project" block says how to install the extras --

def test_your_own_project_block_says_how_to_install_the_extras():
    """A comment line of the block (test_installed runs the block; a comment installs nothing) gives the extras'
    install, torch pinned first as command 1 pins it; the extras exist (was: the block never named them)."""
    import re
    import tomllib

    from doc_blocks import doc_text, fenced_blocks

    block = next(lines for lang, lines in fenced_blocks("README.md")
                 if lang == "bash" and lines[0].startswith("python3 -m venv"))
    extras_line = next(line for line in block if "[demo,torch]" in line)
    assert extras_line.startswith("# ")
    command = extras_line.split(": ", 1)[1]
    readme = doc_text("README.md")
    command_1 = readme.split("## From a clone: two commands", 1)[1].split("```bash\n", 1)[1].splitlines()[1]
    pin = re.search(r"pip install -q (torch==\S+)", command_1).group(1)
    assert command == (f"~/.venvs/snakeshard/bin/pip install -q {pin} && "
                       '~/.venvs/snakeshard/bin/pip install -q "./snakeshard[demo,torch]"')
    extras = tomllib.loads((PROJECT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"demo", "torch"} <= set(extras)


# -- 7. command 2's stated time says under what load it was measured --

def test_command_2_time_says_under_what_load():
    """What was measured, and under what load: a run on 2 quiet cores with the cluster up (was: '~17 minutes on 2
    cores', said of 490 tests)."""
    import re

    section = (PROJECT / "README.md").read_text().split("## From a clone: two commands", 1)[1]
    comment = next(line for line in section.splitlines() if line.startswith("# 2. run the tests"))
    assert re.search(r"\d+ tests: \d+ minutes measured on 2 quiet cores with the local cluster up", comment)
