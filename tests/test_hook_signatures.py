"""Hook signatures checked at parse, from the runner's source (as forward is): a hook that cannot take the call
the workflow makes fails `snakemake -n`, naming class, hook, file:line and the signature to define.

Before, `snakemake -n` passed and every shard job (or the merge, or the report) died in a raw traceback:
ESPnet3's `close_writers(writers)` with `TypeError: ... unexpected keyword argument 'dataset'`, a
`merge(self, shard_dirs)` with `AttributeError: 'list' object has no attribute ...`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import TOY_MODULE, read_config, run_snakemake, write_config

ERROR_PREFIX = "snakeshard: error: "


def use_runner(wd: Path, hook_source: str) -> int:
    """Stage 'upper' runs hooks.Runner: the toy runner with ``hook_source`` (indented) in its body; returns the
    line of the hook's ``def``."""
    text = TOY_MODULE + "\n\nclass Runner(UpperRunner):\n" + "".join(f"    {line}\n" for line in hook_source.splitlines())
    (wd / "hooks.py").write_text(text)
    config = read_config(wd)
    config["stages"]["upper"]["runner"] = "hooks.Runner"
    write_config(wd, config)
    lines = text.splitlines()
    start = lines.index("class Runner(UpperRunner):")
    return next(n for n, line in enumerate(lines[start:], start + 1) if line.lstrip().startswith("def "))


ENV_CALL = "shard jobs call it on the class as {call}, with every env entry by name"

# (id, the hook's source, its signature as the message shows it, the call, why it cannot take it, the signature to define)
WRONG = [
    ("espnet3-close-writers", "@staticmethod\ndef close_writers(writers):\n    writers.close()",
     "@staticmethod close_writers(writers)", ENV_CALL.format(call="close_writers(writers, state, **env)"),
     "it takes 1 positional parameter where the call passes 2", "@staticmethod close_writers(writers, state, **env)"),
    ("merge-instance-method", "def merge(self, shard_dirs):\n    return []",
     "merge(self, shard_dirs)", "the merge rule calls it on the class as merge(shard_dirs, output_dir)",
     "it is not a @classmethod", "@classmethod merge(cls, shard_dirs, output_dir)"),
    ("merge-classmethod-one-dir", "@classmethod\ndef merge(cls, shard_dirs):\n    return []",
     "@classmethod merge(cls, shard_dirs)", "the merge rule calls it on the class as merge(shard_dirs, output_dir)",
     "it takes 1 positional parameter where the call passes 2", "@classmethod merge(cls, shard_dirs, output_dir)"),
    ("merge-keyword-only-without-default", "@classmethod\ndef merge(cls, shard_dirs, output_dir, *, fmt):\n    return []",
     "@classmethod merge(cls, shard_dirs, output_dir, *, fmt)",
     "the merge rule calls it on the class as merge(shard_dirs, output_dir)",
     "its keyword-only parameter 'fmt' has no default, and the call gives it no value",
     "@classmethod merge(cls, shard_dirs, output_dir)"),
    ("write-record-instance-method", "def write_record(self, writers, result, state, **env):\n    writers.write(result)",
     "write_record(self, writers, result, state, **env)",
     ENV_CALL.format(call="write_record(writers, result, state, **env)"), "it is not a @staticmethod",
     "@staticmethod write_record(writers, result, state, **env)"),
    ("static-hook-with-self", "@staticmethod\ndef open_writers(self, shard_dir, **env):\n    return None",
     "@staticmethod open_writers(self, shard_dir, **env)", ENV_CALL.format(call="open_writers(shard_dir, **env)"),
     "its parameter 'shard_dir', after the 1 the call passes, has no default (an env name there must be "
     "keyword-only: after *)", "@staticmethod open_writers(shard_dir, **env)"),
    ("init-state-without-env", "@staticmethod\ndef init_state():\n    return 0",
     "@staticmethod init_state()", ENV_CALL.format(call="init_state(**env)"),
     "it takes no **env (nor any env name), so the first env entry fails the call", "@staticmethod init_state(**env)"),
    ("reduce-state-without-result", "@staticmethod\ndef reduce_state(state, **env):\n    return state",
     "@staticmethod reduce_state(state, **env)", ENV_CALL.format(call="reduce_state(state, result, **env)"),
     "it takes 1 positional parameter where the call passes 2", "@staticmethod reduce_state(state, result, **env)"),
    ("finalize-state-without-env", "@staticmethod\ndef finalize_state(state, shard_dir):\n    return []",
     "@staticmethod finalize_state(state, shard_dir)", ENV_CALL.format(call="finalize_state(state, shard_dir, **env)"),
     "it takes no **env (nor any env name), so the first env entry fails the call",
     "@staticmethod finalize_state(state, shard_dir, **env)"),
    ("item-length-instance-method", "def item_length(self, key):\n    return 1.0",
     "item_length(self, key)", ENV_CALL.format(call="item_length(key, **env)"), "it is not a @staticmethod",
     "@staticmethod item_length(key, **env)"),
    ("open-writers-classmethod-without-dir", "@classmethod\ndef open_writers(cls, **env):\n    return None",
     "@classmethod open_writers(cls, **env)", ENV_CALL.format(call="open_writers(shard_dir, **env)"),
     "it takes 0 positional parameters where the call passes 1", "@staticmethod open_writers(shard_dir, **env)"),
    ("report-without-name", "@classmethod\ndef report(cls, set_dir, path):\n    pass",
     "@classmethod report(cls, set_dir, path)", "the report rule calls it on the class as report(set_dir, name, path)",
     "it takes 2 positional parameters where the call passes 3", "@classmethod report(cls, set_dir, name, path)"),
]


@pytest.mark.parametrize("source, defined, call, problem, expected", [c[1:] for c in WRONG], ids=[c[0] for c in WRONG])
def test_wrong_hook_signature_fails_the_dry_run_naming_class_hook_line_and_signature(toy_workdir, source, defined,
                                                                                       call, problem, expected):
    line = use_runner(toy_workdir, source)
    hook = expected.split()[1].split("(")[0]
    dry = run_snakemake(toy_workdir, "-n")
    assert dry.returncode != 0
    message = (f"{ERROR_PREFIX}stages.upper.runner: hooks.Runner.{hook} ({toy_workdir / 'hooks.py'}:{line}) is defined "
               f"as {defined}, but {call}, and {problem}: define it as {expected}")
    assert message in dry.stderr.splitlines(), dry.stdout[-2000:] + dry.stderr[-2000:]
    assert "Traceback" not in dry.stderr
    assert not (toy_workdir / "results").exists()  # refused before anything was planned


# Signatures that take the workflow's calls: env names keyword-only or with defaults, **env, a classmethod env hook,
# a staticmethod merge, positional-only parameters, *args, a hook under another decorator (left to the job)
RIGHT = '''
@staticmethod
def init_state(*, suffix, **env):
    return 0

@classmethod
def reduce_state(cls, state, result, /, **env):
    return state + 1

@staticmethod
def write_record(writers, result, state, *, dataset, fail_on_keys, item_delay, suffix):
    writers.write(result)

@staticmethod
def close_writers(*args, **env):
    return args[0].close()

@staticmethod
def finalize_state(state, shard_dir, name="count", **env):
    (shard_dir / name).write_text(str(state))
    return [name]

@staticmethod
def item_length(key, **env):
    return 1.0

@staticmethod
@functools.wraps(BaseRunner.open_writers)
def open_writers(*args, **kwargs):
    return BaseRunner.open_writers(*args, **kwargs)

@staticmethod
def merge(shard_dirs, output_dir, **options):
    import shutil
    shutil.copy(shard_dirs[0] / "count", output_dir / "count")
    return BaseRunner.merge(shard_dirs, output_dir)

@classmethod
def report(cls, set_dir, name, path, dpi=100):
    pass
'''


def test_hooks_that_take_the_calls_pass_and_run(toy_workdir):
    """Every variant above passes the parse, and the stage runs and merges (each hook was called as checked)."""
    use_runner(toy_workdir, RIGHT)
    (toy_workdir / "hooks.py").write_text("import functools\n\nfrom snakeshard import BaseRunner\n"
                                          + (toy_workdir / "hooks.py").read_text())
    run = run_snakemake(toy_workdir)
    assert run.returncode == 0, run.stderr[-3000:]
    results = toy_workdir / "results/upper/toy"
    assert (results / "count").read_text() == "10"
    assert (results / "text").read_text().splitlines()[0] == "utt000 UTT000"


def test_shipped_runners_pass_the_hook_check():
    """Every class of the modules whose runners ship (snakeshard.stages.*, the demo's PocketSphinx runner) passes
    the parse checks, read from their source as a stage's runner is."""
    import ast
    import importlib.util

    from snakeshard.core.user_source import check_import_path, check_runner_source

    modules = ["snakeshard.demo.asr", *(f"snakeshard.stages.{name}" for name in
                                        ("collect_stats", "fbank", "scoring", "scoring_report", "vad"))]
    checked = []
    for module in modules:
        spec = importlib.util.find_spec(module)  # its source, not an import (as the parse reads it)
        for node in ast.parse(Path(spec.origin).read_text()).body:
            if isinstance(node, ast.ClassDef):
                path = f"{module}.{node.name}"
                check_runner_source(path, "stages.x.runner", *check_import_path(path, "stages.x.runner"))
                checked.append(node.name)
    assert {"CollectStatsRunner", "FbankRunner", "ScoringRunner", "SileroVadRunner", "PocketsphinxRunner"} <= set(checked)


def test_hook_without_env_that_the_env_does_not_fit_fails_the_job_with_one_line(toy_workdir):
    """A hook that names env entries instead of taking **env passes the parse (the env is the provider's, known
    only in the job); in the job, an env holding other names fails it with one line naming hook and names (before:
    `TypeError: ...close_writers() got an unexpected keyword argument 'dataset'`, a raw traceback)."""
    use_runner(toy_workdir, "@staticmethod\ndef close_writers(writers, state, *, suffix):\n    return writers.close()")
    assert run_snakemake(toy_workdir, "-n").returncode == 0
    run = run_snakemake(toy_workdir, "--config", "canary=2")
    assert run.returncode != 0
    log = (toy_workdir / "results/upper/logs/canary.log").read_text()
    assert log.strip().splitlines()[-1] == (
        f"{ERROR_PREFIX}canary of stage 'upper' failed, so none of its shard jobs was started; fix the stage, then "
        "rerun: hooks.Runner.close_writers takes no **env, and the env holds ['dataset', 'fail_on_keys', "
        "'item_delay'] besides the names it takes (['suffix']): shard jobs pass every env entry by name; define it "
        "as @staticmethod close_writers(writers, state, **env)"), log
    assert "Traceback" not in log


def test_hook_env_check_in_process():
    """The same check in-process: a required env name the env lacks; names that fit (defaults, classmethod, **env)."""
    from snakeshard import BaseRunner, EnvironmentProvider
    from snakeshard.errors import ContractError

    class Provider(EnvironmentProvider):
        def build_env_local(self):
            return dict(self.config)

    class NeedsModel(BaseRunner):
        @staticmethod
        def forward(key):
            return {"text": key}

        @staticmethod
        def init_state(*, model):
            return 0

    with pytest.raises(ContractError, match=r"NeedsModel.init_state needs env key 'model', but the provider gave "
                                            r"only \['scale'\]"):
        NeedsModel(Provider({"scale": 2}))(["a"])

    class Fits(NeedsModel):
        @staticmethod
        def init_state(*, model, **env):
            return 0

        @classmethod
        def reduce_state(cls, state, result, scale=1, model=None):
            return state + scale

        @staticmethod
        def item_length(key, *, model, scale, unused=None):
            return 1.0

    assert Fits(Provider({"model": "m", "scale": 2}))(["a", "b"]) == [{"text": "a", "key": "a"}, {"text": "b", "key": "b"}]
