"""Parse-time helpers for the Snakefile and the CLI: config, stages, plans, fingerprints.

Everything here runs whenever Snakemake parses the Snakefile (on SLURM, in every
job), so it imports nothing heavy and never imports user runners or providers.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from snakeshard.core.data import JSONL_RECORD, KALDI_RECORD_FILES, STAGE_FORMAT
from snakeshard.core.devices import requested_gpus
from snakeshard.core.fingerprint import (UPSTREAM_PLAN, audio_identity, inputs_digest, keys_text, model_identities,
                                         records_digest, set_data_digest, shard_fingerprint, shard_inputs_text,
                                         stage_fingerprint, stage_payload, training_fingerprint)
from snakeshard.core.merge import UnreadableDone, read_done
from snakeshard.core.plan import (AUTO, DEFAULT_SHARDING, ensure_plan, overlapping_shards, read_audio_files,
                                  sharding_mode, shards_per_job)
from snakeshard.core.shard_files import (CANARY_SPEC, FINGERPRINTS_FILE, KEYS_FILE, SET_SPEC, SHARD_FINGERPRINT,
                                         SHARD_ITEMS, read_fingerprints, read_shard_keys, shard_job_files,
                                         shard_job_shards)
from snakeshard.core.user_source import (builtin_config_check, check_import_path, check_module_imports,
                                         check_runner_source, code_change, provider_config_keys,
                                         provider_merge_options, runner_default_sharding, source_digest)
from snakeshard.errors import ERROR_PREFIX, MAX_LISTED, NOTE_PREFIX, ConfigError, DataError, SnakeshardError
from snakeshard.io.atomic import atomic_write_text, write_if_changed
from snakeshard.io.writers import check_outputs_config
from snakeshard.version import __version__
from snakeshard.workflow.config_file import schema_messages
from snakeshard.workflow.train_config import (check_stage_kind, is_training, loop_config, model_config_keys,
                                              model_source, ranks as training_ranks, training_stages)

# The canary's shard dir, beside the stage's dataset dirs (dataset names cannot start with "_").
CANARY_DIR = "_canary"
# Keys of a stage's canary unless the config says otherwise, whatever the executor: a stage that cannot run (a
# provider lacking an env name forward asks for) then fails once, not in every shard job. A default here, not in a
# profile's `config:` list, which a `--config` on the command line replaces and a project's profile may lack.
# Its cost is small: the canary job runs with the canary off too (it then only writes its done).
DEFAULT_CANARY = 2
DEFAULT_RESOURCES = {"mem_mb": 2000, "runtime": 60, "cpus_per_task": 1}
# Resources handed to the executor as they are (snakemake-executor-plugin-slurm names); unset ones are omitted.
SLURM_PASSTHROUGH = ("slurm_partition", "slurm_account", "qos", "constraint", "slurm_extra", "gpu", "gres")
# sbatch options the SLURM plugin sets itself and refuses in slurm_extra, when it submits (a user trial's
# --qos=high, as the docs showed it, failed its first job): refused here, at the parse, naming the key to use.
SLURM_EXTRA_KEYS = {"--qos": "qos", "--account": "slurm_account", "-A": "slurm_account",
                    "--partition": "slurm_partition", "-p": "slurm_partition", "--mem": "mem_mb",
                    "--mem-per-cpu": "mem_mb", "--time": "runtime", "-t": "runtime", "--cpus-per-task": "cpus_per_task",
                    "-c": "cpus_per_task", "--constraint": "constraint", "-C": "constraint", "--gres": "gres",
                    "--gpus": "gpu", "--job-name": None, "-J": None, "--output": None, "-o": None, "--error": None,
                    "-e": None, "--ntasks": None, "-n": None, "--nodes": None, "-N": None, "--clusters": None,
                    "--workdir": None, "-D": None, "--export": None, "--comment": None, "--parsable": None}
# What a shard's fingerprint covers unless the stage's `fingerprint:` config says otherwise.
FINGERPRINT_DEFAULTS = {"records": [*KALDI_RECORD_FILES, JSONL_RECORD], "audio": True, "code": True}
STAGE_HISTORY = "stage_history.json"  # the stage fingerprints' payloads, newest last: what status diffs
STAGE_HISTORY_KEPT = 8
TRAIN_SPEC = "train.json"  # a training stage's spec, in its train set's dir (what its job reads)
SIGNAL_SECONDS = 120  # a training job's SIGTERM before its SLURM time limit: a checkpoint takes seconds, not minutes


def counted_records(selected: list[str]) -> set[str]:
    """The record files ``fingerprint.records`` counts. A JSON Lines record holds the key's audio path as well as
    its labels: it counts whole whenever ``wav.scp`` or ``segments`` (the audio) count, so that a stage which
    reads only the audio is rerun when a key's audio path changes, at the price of a rerun on a label edit."""
    counted = set(selected)
    if counted & {"wav.scp", "segments"}:
        counted.add(JSONL_RECORD)
    return counted


@contextlib.contextmanager
def naming_dataset(name: str, stage: str | None = None):
    """Bad data found while planning (its file, line and key named) names the config entry it came from too:
    ``datasets.<name>: <path>:<line>: ...``, and data the stage's sharding cannot cut (``sharding.keep_together``)
    the stage's key as well."""
    try:
        yield
    except DataError as e:
        if str(e).startswith(f"datasets.{name}"):
            raise
        stage_key = f"stages.{stage}." if stage and str(e).startswith("sharding.") else ""
        raise DataError(f"datasets.{name}: {stage_key}{e}") from e.__cause__


@contextlib.contextmanager
def exit_on_user_error():
    """Around the Snakefile's parse-time calls: a bad config or bad data (a ``SnakeshardError``) ends the
    parse with its one ``snakeshard: error:`` line on stderr and exit status 1, as the CLI's errors do.

    Raised as it is, Snakemake prints it with the frames of snakeshard's own code that raised it (six for
    a misspelt runner module); as a WorkflowError, still with a frame of common.smk, whose path is inside
    the installed snakeshard package. A SystemExit is what Snakemake passes on without a word.
    """
    try:
        yield
    except SnakeshardError as e:
        print(ERROR_PREFIX + str(e), file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # Ctrl-C while the plan or a recipe's data prep runs: its files are written atomically
        print("snakeshard: interrupted (Ctrl-C) while snakemake read the workflow; nothing was run: run it again",
              file=sys.stderr, flush=True)
        raise SystemExit(130) from None


def validate_config(config: dict, schema_path: str | os.PathLike | None = None) -> None:
    """Check ``config`` against the JSON schema and the cross-references the schema cannot express, and complete
    it in place as the rest of the parse reads it: each stage's sharding (its runner's default_sharding, else
    DEFAULT_SHARDING), a training stage's datasets, an inference stage's runner and provider from its training
    stage (train_config.check_stage_kind). ``Workflow`` takes a config that went through here.

    ``schema_path`` defaults to the schema that ships with the workflow.
    """
    import jsonschema

    from snakeshard.resources import load_schema

    schema = load_schema(schema_path)
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"  {'.'.join(map(str, err.absolute_path)) or '(top level)'}: {message}"
                 for err, message in schema_messages(errors)[:MAX_LISTED]]
        raise ConfigError("config does not match snakeshard's config schema (workflow/schemas/config.schema.yaml):\n"
                          + "\n".join(lines))
    check_output_dir(output_dir(config))
    datasets = config.get("datasets", {})
    stages = config.get("stages", {})
    for name, stage in stages.items():  # first: a misspelt name here fails a from_stage dataset that reads it too
        for ds in stage.get("datasets", ()):
            if ds not in datasets:
                import difflib

                close = difflib.get_close_matches(ds, list(datasets), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"stages.{name}.datasets: {ds!r} is not defined under datasets ({sorted(datasets)})"
                                  + hint)
    for name, ds in datasets.items():
        check_dataset_source(name, ds, stages)
    for name, stage in stages.items():
        check_stage_kind(name, stage, datasets, stages)  # training stages, and inference from them
        if "sharding" not in stage:
            stage["sharding"] = runner_default_sharding(stage["runner"], f"stages.{name}") or dict(DEFAULT_SHARDING)
        sharding_mode(stage["sharding"], f"stages.{name}.sharding")
        if stage.get("sort_by_length") and not (stage.get("batch_size") or stage.get("batch_seconds")):
            raise ConfigError(f"stages.{name}.sort_by_length: sorting needs batches: set batch_size or batch_seconds")
        check_outputs_config(stage.get("outputs") or {}, f"stages.{name}.outputs")
        check_slurm_extra((stage.get("resources") or {}).get("slurm_extra"), f"stages.{name}.resources")
        check_pool_config(stage, f"stages.{name}")
        reserved = sorted({"dataset", "devices"} & set(stage.get("provider_config") or {}))
        if reserved:
            raise ConfigError(f"stages.{name}.provider_config.{reserved[0]}: this key is set by snakeshard "
                              "(the dataset spec / the job's devices); rename it")
        check_provider_config_keys(stage, f"stages.{name}")
        check = builtin_config_check(stage["provider"], f"stages.{name}.provider")
        if check is not None:
            check(stage.get("provider_config") or {}, f"stages.{name}.provider_config")
        for role in ("provider", "runner"):
            where = f"stages.{name}.{role}"
            source = check_import_path(stage[role], where)
            if source is not None:
                check_module_imports(stage[role], where, *source)
                if role == "runner":
                    check_runner_source(stage[role], where, *source)
    upstream_of(config)  # chained datasets form no loop


def check_slurm_extra(extra: str | None, where: str) -> None:
    """slurm_extra holds no sbatch option the SLURM plugin sets itself (SLURM_EXTRA_KEYS): each has its key."""
    import shlex

    for word in shlex.split(extra or ""):
        option = word.split("=", 1)[0]
        if option in SLURM_EXTRA_KEYS or (len(option) > 2 and option[:2] in SLURM_EXTRA_KEYS and option[1] != "-"):
            key = SLURM_EXTRA_KEYS.get(option, SLURM_EXTRA_KEYS.get(option[:2]))
            instead = f"set it with {where}.{key}" if key else "snakeshard and the SLURM plugin set it"
            raise ConfigError(f"{where}.slurm_extra: {word!r}: {instead} (the SLURM plugin refuses it in "
                              "slurm_extra, when it submits the first job)")


def check_provider_config_keys(stage: dict, where: str) -> None:
    """Every provider_config key the stage sets is one its provider takes, when the provider declares them
    (``config_keys``, as the built-in stages do): all the unknown ones named at once, each with the key it is
    close to, at parse rather than one per canary run."""
    import difflib

    keys = provider_config_keys(stage["provider"], f"{where}.provider")
    unknown = [key for key in stage.get("provider_config") or {} if keys is not None and key not in keys]
    if not unknown:
        return
    named = []
    for key in unknown:
        close = difflib.get_close_matches(key, keys, n=1)
        named.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    verb = "is not a key" if len(unknown) == 1 else "are not keys"
    raise ConfigError(f"{where}.provider_config: {', '.join(named)} {verb} that {stage['provider']} takes "
                      f"({', '.join(keys)})")


def check_output_dir(out: str) -> None:
    """Every path of every rule starts with ``output_dir``; the rules quote it for the shell (``{...:q}``), so
    spaces, quotes, ``$()`` and ``;`` are just characters of a directory name. Two things are not: Snakemake
    reads braces in a rule's path as a wildcard, and a command reads a word starting with '-' as an option."""
    if "{" in out or "}" in out:
        raise ConfigError(f"output_dir: {out!r} holds a brace: Snakemake reads {{...}} in a path as a wildcard; "
                          "choose a directory name without braces")
    if out.startswith("-"):
        raise ConfigError(f"output_dir: {out!r} starts with '-': the jobs' command lines would take its paths "
                          f"for options; write './{out}'")


def check_dataset_source(name: str, ds: dict, stages: dict) -> None:
    """A dataset is a path, or another stage's output over one of that stage's datasets."""
    where = f"datasets.{name}"
    if ("path" in ds) == ("from_stage" in ds):
        raise ConfigError(f"{where}: give either path (a Kaldi data dir or .jsonl) or from_stage + dataset "
                          "(another stage's merged output)")
    if "from_stage" not in ds:
        if "dataset" in ds:
            raise ConfigError(f"{where}.dataset: only a from_stage dataset names an upstream dataset")
        return
    stage = ds["from_stage"]
    if stage not in stages:
        raise ConfigError(f"{where}.from_stage: {stage!r} is not a stage ({sorted(stages)})")
    if ds.get("dataset") not in stages[stage]["datasets"]:
        raise ConfigError(f"{where}.dataset: stage {stage!r} runs over {stages[stage]['datasets']}, "
                          f"not {ds.get('dataset')!r}")
    extra = sorted(set(ds) - {"from_stage", "dataset"})
    if extra:
        raise ConfigError(f"{where}.{extra[0]}: a from_stage dataset takes its data from the upstream dataset")


def reads_upstream_merge(stage: dict, where: str) -> bool:
    """Whether a stage's provider reads its chained datasets' whole merged output, not only the upstream shards over
    a shard's keys: the provider declares an option for it (EnvironmentProvider.reads_upstream_merge, e.g. fbank's
    global_mvn) and the stage's provider_config sets it. Its shard jobs then wait for the upstream merge."""
    options = stage.get("provider_config") or {}
    provider = stage.get("provider")
    return bool(options and provider) and any(options.get(name)
                                              for name in provider_merge_options(provider, f"{where}.provider"))


def upstream_of(config: dict) -> dict[tuple[str, str], tuple[str, str]]:
    """(stage, dataset) -> the (stage, dataset) whose merged output it reads, for chained datasets;
    a chain that loops back on itself is an error naming it."""
    datasets = config.get("datasets", {})
    links = {}
    for stage, ds in planned_sets(config):
        source = datasets[ds]
        if "from_stage" in source:
            links[stage, ds] = (source["from_stage"], source["dataset"])
    for start in links:
        if links[start] == start:
            raise ConfigError(f"datasets: stage {start[0]!r} reads its own output ({start[1]})")
        seen, node = [start], links[start]
        while node in links:
            if node in seen:
                chain = " -> ".join(f"{s}/{d}" for s, d in [*seen, node])
                raise ConfigError(f"datasets: chained stages form a loop: {chain}")
            seen.append(node)
            node = links[node]
    return links


def check_pool_config(stage: dict, where: str) -> None:
    """``workers``/``devices`` against the job's resources: the CPUs or GPUs each shard job asks for."""
    resources = stage.get("resources") or {}
    if "workers" in stage and "devices" in stage:
        raise ConfigError(f"{where}: set workers (CPU processes) or devices: all (one per GPU), not both")
    if stage.get("devices") == "all" and not requested_gpus(resources):
        raise ConfigError(f"{where}.devices: 'all' starts one worker per GPU of the job, but "
                          f"{where}.resources asks for none: set resources.gpu (or a gres with gpu)")
    cpus = resources.get("cpus_per_task")
    if "workers" in stage and cpus is not None and cpus < stage["workers"]:
        raise ConfigError(f"{where}.workers: {stage['workers']} worker processes, but {where}.resources.cpus_per_task "
                          f"is {cpus}: each shard job would get fewer CPUs (SLURM, local cores) than it runs "
                          "workers; raise cpus_per_task or leave it out (it then follows workers)")
    if "worker_order" in stage and not ("workers" in stage or "devices" in stage):
        raise ConfigError(f"{where}.worker_order: only for a pool (set workers or devices)")
    # without a pool the env is built in the job's own process, where nothing watches it; item_timeout alone
    # makes a pool of one worker, whose start-up this can limit
    if "worker_init_timeout" in stage and pool_spec(stage) is None:
        raise ConfigError(f"{where}.worker_init_timeout: only for a pool (set workers, devices or item_timeout)")


def pool_spec(stage: dict) -> dict | None:
    """What a shard job's pool is (None: forward runs in the job's own process)."""
    if not any(k in stage for k in ("workers", "devices", "item_timeout")):
        return None
    # worker_init_timeout has no default, and item_timeout does not imply one: how long a worker may take
    # to build its env depends on the model and on what is cached (a first run downloads it), which
    # snakeshard cannot know; a guessed limit would fail a cold start after it had spent that time, and a
    # start-up that hangs on SLURM is ended by the stage's runtime
    return {"workers": stage.get("workers", 1), "devices": stage.get("devices"),
            "order": stage.get("worker_order", "ordered"), "item_timeout": stage.get("item_timeout"),
            "worker_init_timeout": stage.get("worker_init_timeout")}


def ignored_key_notes(config: dict) -> list[str]:
    """A line for each ``fingerprint_ignore`` key that is not in its stage's provider_config while a key close to it
    is: a misspelt name, under which the key meant still reruns every shard when it changes (a user trial). Not an
    error: a key ignored while absent is usual (a debugging option, set now and then)."""
    import difflib

    notes = []
    for name, stage in config["stages"].items():
        keys = list(stage.get("provider_config") or {})
        for key in stage.get("fingerprint_ignore") or ():
            close = difflib.get_close_matches(key, keys, n=1) if key not in keys else []
            if close:
                notes.append(f"{NOTE_PREFIX}stages.{name}.fingerprint_ignore: {key!r} is not in its "
                             f"provider_config, which has {close[0]!r}: a change of {close[0]!r} still reruns every "
                             "shard")
    return notes


def output_dir(config: dict) -> str:
    return config.get("output_dir", "results")


def stage_sets(config: dict) -> list[tuple[str, str]]:
    """Every (stage, dataset) pair that is sharded and merged, in config order (a training stage's are not)."""
    return [(s, d) for s, stage in config["stages"].items() if not is_training(stage) for d in stage["datasets"]]


def planned_sets(config: dict) -> list[tuple[str, str]]:
    """Every (stage, dataset) pair planned at parse: the sharded ones and the training stages' train/valid sets."""
    return [(s, d) for s, stage in config["stages"].items() for d in stage["datasets"]]


def shard_stages(config: dict) -> list[str]:
    """The stages whose datasets run as shard jobs (every stage but the training ones)."""
    return [name for name, stage in config["stages"].items() if not is_training(stage)]


def set_dir(config: dict, stage: str, dataset: str) -> str:
    return f"{output_dir(config)}/{stage}/{dataset}"


def run_spec(config: dict, stage: str, dataset: str) -> dict:
    """What one shard job needs to run: passed to it as JSON on its command line.

    The dataset spec carries the stage's ``sample_rate``, so ``load_audio`` refuses other rates.
    """
    s = config["stages"][stage]
    rate = {"sample_rate": s["sample_rate"]} if s.get("sample_rate") else {}
    dataset = {"name": dataset, **config["datasets"][dataset], **rate}
    if "from_stage" in dataset:  # a chained dataset: the upstream's merged output over its own dataset
        up_stage, up_ds = dataset["from_stage"], dataset["dataset"]
        dataset.update(format=STAGE_FORMAT, path=set_dir(config, up_stage, up_ds),
                       source=run_spec(config, up_stage, up_ds)["dataset"])
    return {
        "stage": stage,
        "runner": s["runner"],
        "provider": s["provider"],
        "provider_config": s.get("provider_config") or {},
        "fingerprint_ignore": s.get("fingerprint_ignore") or [],
        "fingerprint": {**FINGERPRINT_DEFAULTS, **(s.get("fingerprint") or {})},
        "allow_nonfinite": s.get("allow_nonfinite") or [],
        "batch_size": s.get("batch_size"),
        "batch_seconds": s.get("batch_seconds"),
        "sort_by_length": bool(s.get("sort_by_length")),
        "outputs": s.get("outputs") or {},
        "report_seconds": "shard_seconds" in (s.get("sharding") or {}),  # progress in audio seconds too
        "gpus": requested_gpus(s.get("resources") or {}),
        "pool": pool_spec(s),  # not in the fingerprint: a pool gives the same results
        # nor these: how shards are grouped into jobs (set once the set is planned: Workflow._group)
        "shards_per_job": 1, "grouped": False,
        "dataset": dataset,
    }


def rule_safe(name: str) -> str:
    """A dataset's ``name`` (schema: letters, digits, ``_.-``) as a part of a Snakemake rule name."""
    return name.replace("-", "_").replace(".", "_")


def canary_items(config: dict, stage: str) -> int:
    """Keys the stage's canary job runs before its shard jobs: ``stages.<stage>.canary``, else the top-level ``canary``,
    else ``DEFAULT_CANARY``."""
    return int(config["stages"][stage].get("canary", config.get("canary", DEFAULT_CANARY)))


def stage_resources(config: dict, stage: str) -> dict:
    """A stage's job resources with defaults filled in, plus its ``retries``.

    ``mem_mb`` and ``runtime`` are the first attempt's; the shard rule multiplies them by the attempt number.
    """
    s = config["stages"][stage]
    resources = {**DEFAULT_RESOURCES, **(s.get("resources") or {}), "retries": s.get("retries", 0)}
    if "cpus_per_task" not in (s.get("resources") or {}):
        if "workers" in s:
            resources["cpus_per_task"] = s["workers"]  # a job running N workers asks for N CPUs (and N local cores)
        elif is_training(s) and training_ranks(s) > 1:
            resources["cpus_per_task"] = training_ranks(s)  # likewise a training job running N rank processes
    return resources


def write_shard_fingerprint(shard_dir: str, fingerprint: str) -> None:
    """``shard_dir/.fingerprint``: the shard's current fingerprint, an input of its rule. Rewritten when it changes,
    it is newer than the shard's done, and Snakemake reruns the shard by mtime. Snakemake's params trigger alone
    (the rule's ``inputs``) needs its record of the done, which a done lacks when a ``shards_per_job`` job wrote it,
    after ``--cleanup-metadata`` or with .snakemake removed: such a stale shard was left to the merge, which refused
    it at every run (a user trial, 2026-11-27). A file written for a done that has this fingerprint already (a
    config changed and changed back, a file deleted) takes the done's mtime: nothing reruns."""
    path = f"{shard_dir}/{SHARD_FINGERPRINT}"
    if not write_if_changed(path, fingerprint + "\n"):
        return
    try:
        done = read_done(shard_dir)
    except UnreadableDone:
        return
    if done is not None and done.get("fingerprint") == fingerprint:
        done_mtime = os.stat(f"{shard_dir}/done").st_mtime_ns
        os.utime(path, ns=(done_mtime, done_mtime))


def remember_stage_payload(set_dir: Path, fp: str, payload: dict) -> None:
    """Keep what the stage fingerprint ``fp`` covers in the set's STAGE_HISTORY (the last STAGE_HISTORY_KEPT),
    so that `snakeshard status` can say what changed for a shard done under an earlier one."""
    path = set_dir / STAGE_HISTORY
    try:
        history = json.loads(path.read_text())
    except (OSError, ValueError):
        history = {}
    if fp in history:
        return
    history[fp] = payload
    write_if_changed(path, json.dumps(dict(list(history.items())[-STAGE_HISTORY_KEPT:]), indent=1) + "\n")


def stage_changes(set_dir: Path, old: str, new: str) -> list[str] | None:
    """``key: old -> new`` for what differs between two stage fingerprints of a set, from its STAGE_HISTORY;
    None when either is not there."""
    from snakeshard.core.fingerprint import differences

    try:
        history = json.loads((set_dir / STAGE_HISTORY).read_text())
    except (OSError, ValueError):
        return None
    if old not in history or new not in history:
        return None
    named = []
    for key, a, b in differences(history[old], history[new]):
        part = key.partition(".")[0]
        if part == "code":  # a digest: what it covers, not its values (code.runner, code.provider apart)
            named.append(code_change(key))
        elif part in STAGE_DIGESTS:
            named.append(f"{part} ({STAGE_DIGESTS[part]})")
        else:
            named.append(f"{key}: {a!r} -> {b!r}")
    return list(dict.fromkeys(named))


# the digests in a stage's payload, in words
STAGE_DIGESTS = {"trained_model": "its training stage's config, code or data changed: another model",
                 "model_files": "a model file named in provider_config: size or mtime"}


def _listed_audio(base: str, shard: int, path: str) -> str:
    """A missing audio file named with its key and the line that lists it (the shard's items.json holds both: a
    user trial got the path alone, where a plan made afresh names key and line)."""
    try:
        items = json.loads(Path(base, f"split.{shard}", SHARD_ITEMS).read_text())["items"]
        key, source = next((key, source) for key, source, audio, *_ in items if audio == path)
    except (OSError, ValueError, KeyError, StopIteration):
        return f"audio file {path}"
    return f"audio file {path} of key {key!r} ({source})"


class Workflow:
    """Per-parse view of a config: plans and fingerprints for every stage/dataset, computed once.

    ``reuse_audio_identity``: take each shard's audio identity from the fingerprints the main
    Snakemake process wrote, instead of stat'ing every audio file again (a SLURM job parses the
    Snakefile once more, only to run its one shard).
    """

    def __init__(self, config: dict, *, reuse_audio_identity: bool = False):
        self.config = config
        self.out = output_dir(config)
        self.plans: dict[tuple[str, str], dict] = {}
        self.stage_fps: dict[tuple[str, str], str] = {}
        self.shard_inputs: dict[tuple[str, str], list[dict]] = {}
        self.inputs: dict[tuple[str, str], str] = {}
        self.data_digests: dict[tuple[str, str], str] = {}  # set -> what its shards read, less the stage (training)
        self.code: dict[str, dict | None] = {}  # stage -> its runner and provider source digests (None: not counted)
        self.canaries: dict[str, dict] = {}  # stage -> its canary, which its shard jobs wait for
        # (stage, dataset) -> a canary over another dataset of the stage than its canary's, which a chained stage's
        # canary reads (see _prepare_canary)
        self.feeder_canaries: dict[tuple[str, str], dict] = {}
        self.specs: dict[tuple[str, str], dict] = {}
        self.trainings: dict[str, dict] = {}  # training stage -> what its rule and the stages using its model need
        self.upstream = upstream_of(config)  # chained (stage, dataset) -> the (stage, dataset) it reads
        self.merge_readers = {stage for stage, _ in self.upstream  # stages whose shard jobs read the upstream merge
                              if reads_upstream_merge(config["stages"][stage], f"stages.{stage}")}
        self.overlaps: dict[tuple[str, str], list[list[int]]] = {}  # chained set: per shard, the upstream shards
        self.jobs_k: dict[tuple[str, str], int] = {}  # set -> shards per job (plan.shards_per_job)
        stat_cache: dict[str, str] = {}  # audio file -> identity, shared by stages over the same data
        try:
            for node in self._in_dependency_order():
                if node[0] == "train":
                    self._prepare_training(node[1])
                else:
                    self._prepare_set(node[1], node[2], stat_cache, reuse_audio_identity)
            self._write_specs()
            for stage in shard_stages(config):
                self._prepare_canary(stage)
        except OSError as e:  # a read-only or full output_dir, an unreadable data file: name the path
            path = str(e.filename or self.out)  # a write to a full disk names no file
            if path.startswith(self.out):
                raise ConfigError(f"output_dir: cannot write {path}: {e.strerror} (output_dir is {self.out!r})") from None
            raise DataError(f"cannot read {path}: {e.strerror}") from None

    def data_notes(self) -> list[str]:
        """What the planned datasets hold that is let pass but worth a look (a Kaldi dir's text keys with no
        recording, ...), each once however many stages read its dataset."""
        return list(dict.fromkeys(NOTE_PREFIX + note for plan in self.plans.values()
                                  for note in plan.get("notes", ())))

    def _in_dependency_order(self) -> list[tuple]:
        """Every set to plan, ``("set", stage, dataset)``, and training stage, ``("train", stage)``, each after
        what its fingerprint takes in: the merged set a chained dataset reads, the training stage whose model an
        inference stage uses, a training stage's own sets and its stats (config order otherwise)."""
        stages = self.config["stages"]
        ordered: list[tuple] = []
        visiting: list[tuple] = []

        def needs(node) -> list[tuple]:
            if node[0] == "train":
                stats = stages[node[1]].get("stats")
                found = [("set", node[1], ds) for ds in stages[node[1]]["datasets"]]
                return found + ([("set", stats["from_stage"], stats["dataset"])] if stats else [])
            _, stage, ds = node
            found = [("set", *self.upstream[stage, ds])] if (stage, ds) in self.upstream else []
            source = model_source(self.config, stage)
            return found + ([("train", source)] if source else [])

        def visit(node):
            if node in ordered:
                return
            if node in visiting:
                chain = " -> ".join("/".join(n[1:]) for n in [*visiting[visiting.index(node):], node])
                raise ConfigError(f"stages: a stage needs its own output: {chain}")
            visiting.append(node)
            for dep in needs(node):
                visit(dep)
            visiting.pop()
            ordered.append(node)

        for stage, ds in planned_sets(self.config):
            visit(("set", stage, ds))
        for stage in training_stages(self.config):
            visit(("train", stage))
        return ordered

    def _prepare_set(self, stage: str, ds: str, stat_cache: dict, reuse_audio_identity: bool) -> None:
        """Plan one stage/dataset, write its spec.json, compute and write its fingerprints.json."""
        base = set_dir(self.config, stage, ds)
        spec = run_spec(self.config, stage, ds)
        options = spec["fingerprint"]
        with naming_dataset(ds, stage):
            plan = ensure_plan(base, spec["dataset"], self.config["stages"][stage]["sharding"])
        up = self.upstream.get((stage, ds))
        if up:
            # A chained set's shard job reads the upstream shards that hold its keys (checked current by the job);
            # a reader of the whole set (merge_readers) reads the upstream merge, which must be the current one.
            self.overlaps[stage, ds] = overlapping_shards(self.plans[up], plan)
            if stage not in self.merge_readers:
                spec["dataset"]["upstream_shards"] = [[js[0], js[-1]] for js in self.overlaps[stage, ds]]
            spec["dataset"]["upstream_inputs"] = self.inputs[up]
        source = model_source(self.config, stage)
        if source:  # inference with a trained model: its fingerprint is the stage's (retraining reruns the shards)
            spec["model"] = self.trainings[source]["model"]
        self.specs[stage, ds] = spec  # written to spec.json once every set is planned (_write_specs)
        self.jobs_k[stage, ds] = shards_per_job(plan, self.config["stages"][stage].get("shards_per_job", AUTO))
        code = None
        if options["code"]:
            code = {role: source_digest(spec[role], f"stages.{stage}.{role}") for role in ("runner", "provider")}
        self.code[stage] = code
        payload = stage_payload(spec, __version__, code, from_model=tuple(model_config_keys(self.config, stage)))
        fp = stage_fingerprint(payload)
        remember_stage_payload(Path(base), fp, payload)
        audio = self._audio_digests(base, plan, options, stat_cache, reuse_audio_identity)
        upstream = self._upstream_digests(stage, ds) if up else [""] * plan["num_shards"]
        counted = counted_records(options["records"])
        inputs = [{"keys": s["keys_digest"], "records": records_digest(s["records"], counted),
                   "audio": a, "upstream": u} for s, a, u in zip(plan["shards"], audio, upstream)]
        for entry in inputs:
            entry["fingerprint"] = shard_fingerprint(fp, entry["keys"], entry["records"], entry["audio"],
                                                     entry["upstream"])
        self.plans[stage, ds] = plan
        self.stage_fps[stage, ds] = fp
        self.shard_inputs[stage, ds] = inputs
        self.inputs[stage, ds] = inputs_digest([entry["fingerprint"] for entry in inputs])
        self.data_digests[stage, ds] = set_data_digest(inputs)
        record = json.dumps({"stage": fp, "inputs": self.inputs[stage, ds], "shards": inputs}, indent=0) + "\n"
        try:  # unchanged since the last parse: the shards' fingerprint files are as it left them (if there)
            unchanged = (Path(base) / FINGERPRINTS_FILE).read_text(encoding="utf-8") == record
        except FileNotFoundError:
            unchanged = False
        for n, entry in enumerate(inputs):  # before fingerprints.json: a parse killed in between redoes them
            shard_dir = f"{base}/split.{n}"
            if not unchanged or not os.path.isfile(f"{shard_dir}/{SHARD_FINGERPRINT}"):
                write_shard_fingerprint(shard_dir, entry["fingerprint"])
        if not unchanged:
            atomic_write_text(Path(base) / FINGERPRINTS_FILE, record, fsync=False)

    def _write_specs(self) -> None:
        """Each set's spec.json, with how its shards are grouped into jobs (known once every set of its stage is
        planned). Jobs read the spec from this file, not from a rule param: options listed in fingerprint_ignore
        may change without rerunning shards, so they must not be params."""
        for (stage, ds), spec in self.specs.items():
            # stage_fingerprint: what the jobs check the spec against (job.check_spec_current)
            spec.update(shards_per_job=self.jobs_k[stage, ds], grouped=self.grouped(stage),
                        stage_fingerprint=self.stage_fps[stage, ds])
            write_if_changed(Path(set_dir(self.config, stage, ds)) / SET_SPEC,
                             json.dumps(spec, indent=1, sort_keys=True) + "\n")

    def _upstream_digests(self, stage: str, ds: str) -> list[str]:
        """Per shard of a chained set, the digest of the fingerprints of the upstream shards that hold its keys
        (what its job reads): a change upstream reruns only the shards over the keys it touched. A reader of the
        upstream merge depends on all of them: any change upstream reruns each of its shards."""
        up = self.upstream[stage, ds]
        if stage in self.merge_readers:
            return [self.inputs[up]] * len(self.overlaps[stage, ds])
        fingerprints = [entry["fingerprint"] for entry in self.shard_inputs[up]]
        return [inputs_digest([fingerprints[j] for j in js]) for js in self.overlaps[stage, ds]]

    @staticmethod
    def _audio_digests(base: str, plan: dict, options: dict, stat_cache: dict, reuse: bool) -> list[str]:
        """Per shard, the identity digest of its audio files ("" when the stage opts out)."""
        n = plan["num_shards"]
        if not options["audio"]:
            return [""] * n
        if reuse:
            previous = read_fingerprints(base)
            if previous and len(previous["shards"]) == n:
                return [entry["audio"] for entry in previous["shards"]]
        digests = []
        for shard, paths in enumerate(read_audio_files(base)):
            try:
                digests.append(audio_identity(paths, stat_cache))
            except FileNotFoundError as e:
                raise DataError(f"{_listed_audio(base, shard, e.filename)} no longer exists (shard {shard}, "
                                f"{base}/split.{shard}); it is still listed in the dataset") from None
        return digests

    def _prepare_training(self, stage: str) -> None:
        """A training stage's spec (``train.json`` in its train set's dir, what its job reads) and fingerprint: its
        sets' data (keys, records, audio, upstream merges), its runner's and provider's code, the model files its
        provider config names, its stats' merged output and every training key but ``checkpoint`` (which changes no
        result). Each is its own entry, so that a refused resume names the one that changed."""
        s = self.config["stages"][stage]
        out = set_dir(self.config, stage, s["train"])
        stats = s.get("stats")
        stats_ref = None
        if stats:
            key = stats["from_stage"], stats["dataset"]
            stats_ref = {"path": set_dir(self.config, *key), "inputs": self.inputs[key]}
        provider_config = s.get("provider_config") or {}
        ignored = set(s.get("fingerprint_ignore") or ())
        spec = {"stage": stage, "runner": s["runner"], "provider": s["provider"], "code": self.code[stage],
                "model_files": model_identities({k: v for k, v in provider_config.items() if k not in ignored}),
                "provider_config": provider_config, "fingerprint_ignore": s.get("fingerprint_ignore") or [],
                "train": self.specs[stage, s["train"]]["dataset"],
                "valid": self.specs[stage, s["valid"]]["dataset"] if "valid" in s else None,
                "stats": stats_ref, "labels": s.get("labels") or [], "loop": loop_config(s),
                "batch_size": s.get("batch_size"), "batch_seconds": s.get("batch_seconds"),
                "sort_by_length": bool(s.get("sort_by_length")), "gpus": requested_gpus(s.get("resources") or {}),
                # each set's data: its keys, records, audio and upstream merge (the stage's config and code above)
                "sets": {ds: self.data_digests[stage, ds] for ds in s["datasets"]}}
        spec["fingerprint"] = training_fingerprint(spec, __version__)
        write_if_changed(Path(out) / TRAIN_SPEC, json.dumps(spec, indent=1, sort_keys=True) + "\n")
        upstream = [f"{set_dir(self.config, *self.upstream[stage, ds])}/merged.json"
                    for ds in s["datasets"] if (stage, ds) in self.upstream]
        self.trainings[stage] = {
            "dir": out, "spec": f"{out}/{TRAIN_SPEC}", "fingerprint": spec["fingerprint"],
            "keys": [f"{set_dir(self.config, stage, ds)}/split.0/{KEYS_FILE}" for ds in s["datasets"]],
            "upstream": upstream + ([f"{stats_ref['path']}/merged.json"] if stats_ref else []),
            "model": {"stage": stage, "path": f"{out}/model.pt", "done": f"{out}/done", "stats": stats_ref,
                      "fingerprint": spec["fingerprint"]},
        }

    def _prepare_canary(self, stage: str, ds: str | None = None, feeds: str | None = None) -> dict:
        """The canary's dir (under the stage fingerprint, see canary.smk) and its keys: the first N of the stage's
        first dataset read from disk, rewritten only when they change.

        A stage over chained datasets only runs its canary over the upstream stage's canary output (its first N
        keys of those): the canary then waits for the upstream canary alone, which reruns only when every upstream
        shard does. (Waiting for the upstream merge instead would put every shard of this stage behind a job that
        reruns whenever any upstream shard does: Snakemake then skips its own rerun checks of these shards.) Its
        spec is the stage's with that dataset (``<dir>.spec.json``, shard_files.CANARY_SPEC).

        The upstream canary must be over the dataset the chain reads: an inference stage over the fbank of test
        checked on the fbank of train ran on train's keys, and a scoring stage whose reference only test's records
        hold failed (a user trial). When that is not the upstream stage's own canary's dataset, a canary of the
        upstream stage over that dataset (``ds``, for the stage ``feeds``) is made for it: its own rule, dir
        (``_canary.<dataset>/``) and log; the upstream's shard jobs do not wait for it."""
        datasets = self.config["stages"][stage]["datasets"]
        first = next((d for d in datasets if (stage, d) not in self.upstream), datasets[0])
        feeder = ds is not None and ds != first
        ds = ds if feeder else first
        known = self.feeder_canaries.get((stage, ds)) if feeder else self.canaries.get(stage)
        if known is not None:
            return known
        base = set_dir(self.config, stage, ds)
        n = canary_items(self.config, stage)
        stage_fp = self.stage_fps[stage, ds]
        where = f"{CANARY_DIR}.{ds}" if feeder else CANARY_DIR  # a canary job removes other fingerprints' dirs there
        canary_dir = f"{self.out}/{stage}/{where}/{stage_fp}"
        canary = {"stage": stage, "dir": canary_dir, "spec": f"{base}/{SET_SPEC}",
                  "items_file": f"{base}/split.0/{SHARD_ITEMS}", "dataset": self.specs[stage, ds]["dataset"],
                  "fingerprint": stage_fp,
                  "log": f"{self.out}/{stage}/logs/canary{'.' + ds if feeder else ''}.log", "upstream": [],
                  "rule": f"canary_{stage}" + (f"_over_{rule_safe(ds)}" if feeder else ""),
                  "feeds": feeds if feeder else None}
        up = self.upstream.get((stage, ds))
        if up is None:
            keys = read_shard_keys(f"{base}/split.0")[:n] if n else []  # off: read nothing at parse
        elif up[0] in self.config["stages"] and up[0] in shard_stages(self.config):
            upstream = self._prepare_canary(up[0], up[1], feeds=stage)
            keys = read_shard_keys(upstream["dir"])[:n] if n else []
            dataset = {**{k: v for k, v in canary["dataset"].items() if k not in UPSTREAM_PLAN},
                       "path": upstream["dir"], "source": upstream["dataset"], "upstream_dirs": [upstream["dir"]]}
            spec = {**self.specs[stage, ds], "dataset": dataset}
            canary.update(spec=canary_dir + CANARY_SPEC, items_file=upstream["items_file"], dataset=dataset,
                          upstream=[f"{upstream['dir']}/done"])
            write_if_changed(canary["spec"], json.dumps(spec, indent=1, sort_keys=True) + "\n")
        else:
            keys = []
        source = model_source(self.config, stage)
        if source:  # an inference stage: the trained model
            canary["upstream"].append(self.trainings[source]["model"]["done"])
        write_if_changed(f"{canary_dir}/{KEYS_FILE}", keys_text(keys))
        canary["items"] = len(keys)
        if feeder:
            self.feeder_canaries[stage, ds] = canary
        else:
            self.canaries[stage] = canary
        return canary

    def shard_inputs_arg(self, stage: str, dataset: str, shard: int) -> str:
        """The shard job's ``--inputs``: the text its fingerprint digests (see fingerprint.shard_inputs_text)."""
        entry = self.shard_inputs[stage, dataset][shard]
        return shard_inputs_text(self.stage_fps[stage, dataset], entry["keys"], entry["records"], entry["audio"],
                                 entry["upstream"])

    def signal_seconds(self, stage: str) -> int:
        """How long before a training job's SLURM time limit it gets SIGTERM (``checkpoint.signal_seconds``)."""
        return int((self.config["stages"][stage].get("checkpoint") or {}).get("signal_seconds", SIGNAL_SECONDS))

    def shard_upstream(self, stage: str, dataset: str, shards: range) -> list[str]:
        """What the job of a chained set's ``shards`` waits for: the upstream jobs' outputs (split.N/done, or
        with ``shards_per_job`` a group's) for the shards holding their keys, so that it reruns when one of those
        does, and not when another does; a reader of the upstream merge waits for it; an inference stage's trained
        model's done."""
        up = self.upstream.get((stage, dataset))
        files = []
        if up and stage in self.merge_readers:
            files = [f"{set_dir(self.config, *up)}/merged.json"]
        elif up:
            upstream_shards = sorted({j for n in shards for j in self.overlaps[stage, dataset][n]})
            files = list(dict.fromkeys(self.shard_job_files(*up, j)[1] for j in upstream_shards))
        source = model_source(self.config, stage)
        return files + ([self.trainings[source]["model"]["done"]] if source else [])

    def waits_upstream(self, stage: str) -> bool:
        """Whether a stage's shard jobs wait for another stage's jobs (``shard_upstream`` can be non-empty)."""
        return (any((stage, ds) in self.upstream for ds in self.config["stages"][stage]["datasets"])
                or model_source(self.config, stage) is not None)

    def num_shards(self, stage: str, dataset: str) -> int:
        return self.plans[stage, dataset]["num_shards"]

    def grouped(self, stage: str) -> bool:
        """Whether a stage's shards run in jobs of several (``shards_per_job``; its rule is then the group rule,
        for every dataset of the stage: those whose shards stand alone get jobs of one shard)."""
        return any(self.jobs_k[stage, ds] > 1 for ds in self.config["stages"][stage]["datasets"])

    def job_done_files(self, stage: str, dataset: str) -> list[str]:
        """What the merge waits for: each shard job's output (with ``shards_per_job``, one per K shards)."""
        if (stage, dataset) not in self.plans:  # a rule of the user's asks for a set the config does not plan
            with exit_on_user_error():
                raise ConfigError(f"{set_dir(self.config, stage, dataset)}/merged.json is asked for, but no stage "
                                  f"{stage!r} runs over a dataset {dataset!r}: the config plans "
                                  + ", ".join(f"{s}/{d}" for s, d in self.plans))
        shards = range(self.num_shards(stage, dataset))
        return list(dict.fromkeys(self.shard_job_files(stage, dataset, n)[1] for n in shards))

    def shard_job_files(self, stage: str, dataset: str, shard: int) -> tuple[str, str]:
        """(log, output) of the job that runs ``shard``: its own, or its group's with ``shards_per_job``."""
        return shard_job_files(set_dir(self.config, stage, dataset), shard, self.jobs_k[stage, dataset],
                               self.num_shards(stage, dataset), self.grouped(stage))

    def shard_job_shards(self, stage: str, dataset: str, shard: int) -> tuple[int, ...]:
        """The shard wildcards of the job that runs ``shard``: ``(shard,)``, or its group's ``(first, last)``."""
        return shard_job_shards(shard, self.jobs_k[stage, dataset], self.num_shards(stage, dataset),
                                self.grouped(stage))
