"""``snakeshard`` command line: init, manifest, plan, status, continue, wer, run-shard(s), train, merge, report,
config-reference.

The Snakefile's rules call ``python -m snakeshard run-shard/train/merge``; people call
``snakeshard plan`` and ``snakeshard status``. Errors on bad input print one
message naming key, shard and file, and exit 1. ``python -m snakeshard`` (``__main__.py``) runs a shard job's line
without this module (see job.py) and hands the rest to ``main``, the ``snakeshard`` script.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from snakeshard.core.shard_files import read_spec
from snakeshard.errors import MAX_LISTED, naming_stage
from snakeshard.workflow.job import (CANARY, cmd_run_shard, cmd_run_shards, import_runner, parse_job_args,
                                     run_command, shard_id, shard_range)

__all__ = ["build_parser", "main"]  # main: the `snakeshard` script (pyproject.toml)


DEFAULT_CONFIG = "config/config.yaml"


def _config(paths: list[str]) -> dict:
    """The project's config from ``--config`` files: each later one overrides the keys it sets, nested keys one
    by one, as ``snakemake --configfile`` does (the digits recipe's held-out-speaker config over its config)."""
    from snakeshard.workflow.config_file import load_config, without_project_keys

    config = load_config(paths[0])
    for path in paths[1:]:
        from snakemake.utils import update_config

        update_config(config, load_config(path))
    return without_project_keys(config, " + ".join(paths))


def _workflow(config_paths: list[str]):
    from snakeshard.workflow.parse import Workflow, validate_config

    config = _config(config_paths)
    validate_config(config)
    return Workflow(config)


def cmd_plan(args) -> int:
    from snakeshard.core.plan import AUTO, format_plan_table, make_plan, shards_per_job
    from snakeshard.errors import ConfigError
    from snakeshard.workflow.parse import naming_dataset, planned_sets, run_spec, stage_sets, validate_config
    from snakeshard.workflow.train_config import is_training

    config = _config(args.config)
    validate_config(config)
    if args.stage and args.stage not in config["stages"]:
        raise ConfigError(f"--stage {args.stage}: no such stage in {' + '.join(args.config)} (its stages: "
                          f"{', '.join(config['stages'])})")
    # a training stage's sets are planned too (one shard each: its job reads every key), though not run as shards
    sets = planned_sets(config) if args.stage and is_training(config["stages"][args.stage]) else stage_sets(config)
    for stage, ds in sets:
        if args.stage and stage != args.stage:
            continue
        spec = run_spec(config, stage, ds)
        with naming_dataset(ds):  # in memory: writes nothing
            plan = make_plan(spec["dataset"], config["stages"][stage]["sharding"], forked=True)
        training = is_training(config["stages"][stage])
        kind = " (training: one job over every key of its sets)" if training else ""
        print(format_plan_table(plan, f"stage {stage}{kind}, dataset {ds}:"))
        setting = config["stages"][stage].get("shards_per_job", AUTO)
        k = 1 if training else shards_per_job(plan, setting)
        if k > 1:  # a user trial: the grouping showed only in snakemake -n's job count
            jobs = -(-plan["num_shards"] // k)
            print(f"{'jobs':>6} {jobs:>8}  of {k} consecutive shards each (shards_per_job: {setting}), run one after "
                  "the other in one process")
        for note in plan.get("notes", ()):
            print(f"note: {note}")
    return 0


def cmd_train(args) -> int:
    from snakeshard.train.stage import cmd_train as train

    return train(args)


def cmd_merge(args) -> int:
    from snakeshard.core.data import listing
    from snakeshard.core.merge import merge_set, remove_unplanned_shards, remove_unused_job_files
    from snakeshard.core.plan import shards_text
    from snakeshard.errors import MergeError
    from snakeshard.core.shard_files import read_fingerprints

    spec = read_spec(args.spec)
    plan = json.loads((Path(args.set_dir) / "plan.json").read_text())
    fingerprints = read_fingerprints(args.set_dir)
    if fingerprints is None or fingerprints["inputs"] != args.inputs:
        # Another parse (another config, or data changed since this run's DAG was built) rewrote the plan.
        raise MergeError(f"refusing to merge {args.set_dir}: its plan changed while this run was going "
                         "(another snakemake or snakeshard run with other data or config?); run snakemake again")
    runner_cls = import_runner(spec)
    with naming_stage(spec["stage"]):
        record = merge_set(Path(args.set_dir), plan, fingerprints, runner_cls)
    print(f"merged {shards_text(record['shards'])}, {record['items']} items into {args.set_dir}: "
          f"{', '.join(record['files'])}")
    removed = remove_unplanned_shards(Path(args.set_dir), record["shards"])
    if removed:
        print(f"removed split.{removed[0]}..split.{removed[-1]} ({len(removed)} directories an earlier plan of more "
              f"shards left): the plan has {shards_text(record['shards'])}")
    jobs = remove_unused_job_files(Path(args.set_dir), record["shards"], spec["shards_per_job"], spec["grouped"])
    if jobs:
        print(f"removed {len(jobs)} done and log file(s) of jobs the current grouping does not make "
              f"(shards_per_job {spec['shards_per_job']}): {listing(len(jobs), jobs[:MAX_LISTED])}")
    return 0


def cmd_report(args) -> int:
    """Draw one of a runner's report files (its ``reports``) from the current merged output."""
    from snakeshard.core.merge import require_current

    spec = read_spec(args.spec)
    require_current(args.set_dir, args.inputs)  # never draw a stale merge
    runner_cls = import_runner(spec)
    with naming_stage(spec["stage"]):
        runner_cls.report(Path(args.set_dir), Path(args.output).name, Path(args.output))
    print(f"wrote {args.output}")
    return 0


def cmd_status(args) -> int:
    from snakeshard.workflow.status import print_status

    print_status(_workflow(args.config))
    return 0


def cmd_continue(args) -> int:
    from snakeshard.errors import ConfigError
    from snakeshard.train.stage import continue_training

    wf = _workflow(args.config)
    if args.stage not in wf.trainings:
        raise ConfigError(f"snakeshard continue {args.stage}: no training stage of that name in the config "
                          f"(training stages: {', '.join(wf.trainings) or 'none'})")
    print(continue_training(args.stage, wf.trainings[args.stage]))
    return 0


def current_inputs(config_paths: list[str], set_dir: Path) -> str | None:
    """The inputs digest ``set_dir`` has under the project config (``config_paths``) now, from a parse as `status`
    makes (the data may have changed since the last one wrote fingerprints.json); None outside such a project."""
    from snakeshard.workflow.parse import set_dir as set_dir_of

    if not Path(config_paths[0]).is_file():
        return None
    wf = _workflow(config_paths)
    return next((inputs for (stage, ds), inputs in wf.inputs.items()
                 if Path(set_dir_of(wf.config, stage, ds)).resolve() == set_dir.resolve()), None)


def cmd_wer(args) -> int:
    from snakeshard.core.merge import require_current
    from snakeshard.stages.wer import error_rates
    from snakeshard.core.shard_files import read_fingerprints

    set_dir = Path(args.hyp).parent
    fingerprints = read_fingerprints(set_dir)
    if fingerprints is not None:  # a snakeshard set: read only a current merge (not one a failed rerun left)
        require_current(set_dir, current_inputs(args.config, set_dir) or fingerprints["inputs"])
    normalize = [n for n in (args.normalize or "").split(",") if n]
    # the normalization is on every line: two WERs of the same files differ by it (a user trial compared
    # this command's figure with jiwer's, each normalized its own way)
    said = f"normalize={','.join(normalize) or 'none'} hyp={args.hyp} ref={args.ref}"
    metrics = error_rates(args.ref, args.hyp, normalize, ("word", "char") if args.cer else ("word",))
    text = "\n".join(f"{metric.summary()} {said}" for metric in metrics)
    print(text)
    if args.out:
        from snakeshard.io.atomic import atomic_write_text

        atomic_write_text(args.out, text + "\n")
    return 0


def _cd(directory: str) -> str:
    """``cd <directory> && `` (quoted for a shell), or nothing when it is the working directory."""
    import shlex

    return "" if os.path.realpath(directory) == os.path.realpath(os.getcwd()) else f"cd {shlex.quote(directory)} && "


def cmd_init(args) -> int:
    if args.recipe:
        from snakeshard.recipes import init_recipe

        written = init_recipe(args.recipe, args.directory, args.data)
        print(f"wrote {', '.join(written)} in {args.directory}")
        print(f"next: {_cd(args.directory)}snakemake --profile profiles/local"
              + ("" if args.data else " (its data prep downloads FSDD first, 16 MB)"))
        return 0
    from snakeshard.workflow.project import init_project, manifest_fields_note, relative_audio_note

    written, said = init_project(args.directory, args.data)
    print(f"wrote {', '.join(written)} in {args.directory}")
    for line in said:
        print(line, file=sys.stderr if line.startswith("note: ") else sys.stdout)
    for note in (relative_audio_note(args.data, args.directory), manifest_fields_note(args.data, args.directory)) \
            if args.data else ():
        if note:
            print(note, file=sys.stderr)
    print(f"next: {_cd(args.directory)}snakemake -n && snakemake --profile profiles/local && snakeshard status")
    print('on SLURM: pip install "snakeshard[slurm]" (the executor plugin), then snakemake --profile profiles/slurm')
    return 0


def cmd_manifest(args) -> int:
    from snakeshard.io.audio_folder import write_manifest

    for line in write_manifest(args.folder, args.output):
        print(line, file=sys.stderr if line.startswith("note: ") else sys.stdout)
    return 0


def cmd_config_reference(args) -> int:
    from snakeshard.workflow.config_reference import render, write

    if args.output is None:
        print(render(), end="")
        return 0
    print(f"{'wrote' if write(args.output) else 'unchanged:'} {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``snakeshard`` script: a job's line as the rules write it (parsed without argparse), else this parser."""
    # The console script, unlike `python -m`, does not put the working directory on sys.path:
    # the project's own runner modules (my_stage.py beside the Snakefile) must import either way.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if argv is None:
        argv = sys.argv[1:]
    args = parse_job_args(argv)
    if args is None:
        args = build_parser().parse_args(argv)
        if getattr(args, "config", False) is None:  # no --config: append's default would stay in the list
            args.config = [DEFAULT_CONFIG]
    return run_command(args)


def build_parser():
    """The whole command line (argparse.ArgumentParser), imported here: a shard job parses its own line
    (job.JOB_COMMANDS), with the same options as the run-shard and run-shards parsers below."""
    import argparse

    from snakeshard.version import __version__

    summary = __doc__.split("\n\n")[0].replace("\n", " ").replace("``", "")  # the docstring's first paragraph
    p = argparse.ArgumentParser(prog="snakeshard", description=summary)
    p.add_argument("--version", action="version", version=f"snakeshard {__version__}",
                   help="print snakeshard's version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           help="one of the commands below; snakeshard COMMAND --help describes its options")

    def with_config(sp):
        sp.add_argument("--config", action="append", metavar="FILE",
                        help=f"workflow config (default: {DEFAULT_CONFIG}); given again, each later file overrides "
                             "the keys it sets, as snakemake's --configfile does")

    sp = sub.add_parser("init", help="write a new project (Snakefile using the shipped workflow as a module, "
                                     "config, an example stage, local and SLURM profiles) into DIR")
    sp.add_argument("directory", metavar="DIR", help="the project directory: created if missing; no file of the "
                                                     "project may exist there yet")
    sp.add_argument("--data", help="a Kaldi data dir (with wav.scp), a .jsonl manifest, or a folder of audio files "
                                    "(its manifest is written to data/<folder>.jsonl, with the columns of a "
                                    "metadata.csv beside the files); default: copy the demo speech. With --recipe "
                                    "digits: a directory of FSDD's WAVs; default: download them")
    from snakeshard.recipes import RECIPES

    sp.add_argument("--recipe", choices=sorted(RECIPES), help="write a complete recipe instead: digits (FSDD spoken "
                                                          "digits: data prep, fbank, stats, train, inference, scoring)")
    sp.set_defaults(func=cmd_init)

    sp = sub.add_parser("manifest", help="write a JSON Lines manifest of a folder of audio files (subfolders too): "
                                         "key, audio, duration, and the columns of a metadata.csv or "
                                         "metadata.jsonl at its top (file_name: the file's path under the folder)")
    sp.add_argument("folder", metavar="FOLDER", help="the folder of audio files")
    sp.add_argument("--output", "-o", required=True, metavar="FILE",
                    help="the manifest to write (e.g. data/mine.jsonl), the dataset's path with format: jsonl; "
                         "when it exists, its keys keep their lines' order and new files are appended")
    sp.set_defaults(func=cmd_manifest)

    sp = sub.add_parser("plan", help="print the shard plan (shard, items, seconds) without running anything")
    with_config(sp)
    sp.add_argument("--stage", help="only this stage's datasets (default: every shard stage's; a training stage's "
                                    "train and valid sets when named)")
    sp.set_defaults(func=cmd_plan)

    sp = sub.add_parser("run-shard", help="run one shard (called by the shard rule)")
    sp.add_argument("--spec", required=True, help="stage run spec: a JSON file (spec.json beside plan.json)")
    sp.add_argument("--shard", type=shard_id, required=True, help=f"shard number, or {CANARY!r} for the stage's canary job")
    sp.add_argument("--shard-dir", required=True, help="the shard's dir (split.N/, the canary's under _canary/): "
                                                       "its keys and items.json in, its fragments and done out")
    given = sp.add_mutually_exclusive_group(required=True)
    given.add_argument("--shard-inputs", help="a shard job: what its fingerprint digests (stage:keys:records:audio)")
    given.add_argument("--fingerprint", help="the canary: the stage fingerprint")
    sp.add_argument("--log", help="this job's log file, named in error messages")
    sp.add_argument("--feeds", help="the canary of another dataset of the stage: the stage whose canary reads it")
    sp.set_defaults(func=cmd_run_shard)

    sp = sub.add_parser("run-shards", help="run several shards in one job (called by the shard rule when the stage "
                                           "sets shards_per_job)")
    sp.add_argument("--spec", required=True, help="stage run spec: a JSON file (spec.json beside plan.json)")
    sp.add_argument("--shards", type=shard_range, required=True, help="FIRST-LAST shard numbers")
    sp.add_argument("--set-dir", required=True, help="the stage/dataset dir holding split.N/")
    sp.add_argument("--shard-inputs", required=True, help="per shard, what its fingerprint digests, comma-separated")
    sp.add_argument("--done", required=True, help="the job's own done, written when every shard has its done")
    sp.add_argument("--log", help="this job's log file, named in error messages")
    sp.set_defaults(func=cmd_run_shards)

    sp = sub.add_parser("train", help="run a training stage: resume from its latest checkpoint or start, then write "
                                      "model.pt, metrics.json, curve.png and done (called by the train rule)")
    sp.add_argument("--spec", required=True, help="the training stage's spec (train.json in its train set's dir)")
    sp.add_argument("--fingerprint", required=True, help="the fingerprint the run's DAG was built with")
    sp.add_argument("--log", help="this job's log file, named in error messages")
    sp.add_argument("--rank-worker", action="store_true",
                    help="run as one rank of a multi-rank job (the job's own launcher passes it; not for users)")
    sp.set_defaults(func=cmd_train)

    sp = sub.add_parser("merge", help="validate and merge all shards of a stage/dataset (called by the merge rule)")
    sp.add_argument("--spec", required=True, help="stage run spec: a JSON file")
    sp.add_argument("--set-dir", required=True, help="the stage/dataset dir (results/STAGE/DATASET) holding split.N/; "
                                                     "the merged files are written there")
    sp.add_argument("--inputs", required=True, help="digest of the shard fingerprints the run's DAG was built with")
    sp.add_argument("--log", help="the merge's log file")
    sp.set_defaults(func=cmd_merge)

    sp = sub.add_parser("report", help="draw a runner's report file (e.g. metrics.png) from a merged set (called by "
                                       "the report rule)")
    sp.add_argument("--spec", required=True, help="stage run spec: a JSON file")
    sp.add_argument("--set-dir", required=True, help="the merged stage/dataset dir (results/STAGE/DATASET) to draw from")
    sp.add_argument("--inputs", required=True, help="digest of the shard fingerprints the merge must have been made from")
    sp.add_argument("--output", required=True, help="the report file to write; its name is one of the runner's "
                                                    "reports (e.g. results/score/demo_asr/metrics.png)")
    sp.set_defaults(func=cmd_report)

    sp = sub.add_parser("status", help="list each shard as done, stale (with the cause), failed (with its log tail), "
                                       "unreadable, incomplete, pending, removed, or queued or running in SLURM, a failed canary, "
                                       "and whether the merge is current")
    with_config(sp)
    sp.set_defaults(func=cmd_status)

    sp = sub.add_parser("continue", help="let a training stage's unfinished run go on under the config and code as "
                                         "they are now: its next run resumes the newest checkpoint instead of "
                                         "refusing it (the change is kept in the run's metrics.json)")
    sp.add_argument("stage", help="the training stage (its name under stages:)")
    with_config(sp)
    sp.set_defaults(func=cmd_continue)

    sp = sub.add_parser("wer", help="word (--cer: and character) error rate of a hypothesis text file against a "
                                    "reference (jiwer)")
    sp.add_argument("--hyp", required=True, help="hypotheses: a 'key text' file (e.g. a merged results/asr/demo/text; "
                                                 "a snakeshard set's is read only when its merge is current)")
    sp.add_argument("--ref", required=True, help="references: a 'key text' file with the same keys (e.g. data/demo/text)")
    sp.add_argument("--normalize", help="jiwer transforms for both sides, comma-separated (e.g. lowercase,"
                                        "remove_punctuation); default: none, the text as written")
    sp.add_argument("--cer", action="store_true", help="also the character error rate, on a second line (as the "
                                                       "scoring stage's metrics.txt: spaces count as characters)")
    sp.add_argument("--out", help="also write the printed lines to this file (default: print only)")
    with_config(sp)  # the project whose set --hyp is: its merge must be current under the data and config as they are
    sp.set_defaults(func=cmd_wer)

    sp = sub.add_parser("config-reference", help="print every config key with its type, default and meaning, as "
                                                 "Markdown, from the config schema (docs/config.md is its output)")
    sp.add_argument("--output", metavar="FILE", help="write it to FILE (e.g. docs/config.md) instead of printing it")
    sp.set_defaults(func=cmd_config_reference)
    return p
