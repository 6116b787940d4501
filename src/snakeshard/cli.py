"""``snakeshard`` command line: init, plan, status, wer, run-shard(s), train, merge, report, config-reference.

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

from snakeshard.core.shard_files import MERGE_LOG, read_spec
from snakeshard.errors import ERROR_PREFIX, naming_stage
from snakeshard.workflow.job import (CANARY, INTERRUPTED, canary_log_head, cmd_run_shard, cmd_run_shards,
                                     import_runner, parse_job_args, run_command, shard_id, shard_range)

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
    from snakeshard.core.plan import format_plan_table, make_plan
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
        kind = " (training: one job over every key of its sets)" if is_training(config["stages"][stage]) else ""
        print(format_plan_table(plan, f"stage {stage}{kind}, dataset {ds}:"))
    return 0


def cmd_train(args) -> int:
    from snakeshard.train.stage import cmd_train as train

    return train(args)


def cmd_merge(args) -> int:
    from snakeshard.core.merge import merge_set, remove_unplanned_shards
    from snakeshard.core.plan import shards_text
    from snakeshard.errors import MergeError
    from snakeshard.workflow.parse import read_fingerprints

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


def merged_state(set_dir: Path, inputs: str) -> str:
    """yes (made from the current plan's inputs, here) / stale (from other inputs) / moved (its scp files point
    into the directory it was made in) / missing (a file its merged.json lists is gone) / no."""
    from snakeshard.core.merge import merged_record, missing_merged_files, moved_from

    record = merged_record(set_dir)
    if record is None:
        return "no"
    if record.get("inputs") != inputs:
        return "stale"
    if moved_from(set_dir, record):
        return "moved"
    return "missing" if missing_merged_files(set_dir, record) else "yes"


# What a stale shard's done differs in, in the words status uses.
STALE_CAUSES = {"keys": "its keys (the plan was cut anew)",
                "records": "its keys' records (wav.scp, segments, text, utt2spk or jsonl)",
                "audio": "its audio files (size or mtime)", "stage": "the stage's config, model files or code",
                "upstream": "the upstream stage's output for its keys"}


def shard_state(shard_dir: Path, log: Path, expected: dict, shard: int) -> tuple[str, str]:
    """(state, detail): done, stale (with what changed), unreadable, failed (with log tail),
    incomplete (started, no result), pending. ``expected``: the shard's entry in the current fingerprints.
    ``log`` may be a job's of several shards (``shards_per_job``): the error line naming ``shard`` counts."""
    from snakeshard.core.merge import UnreadableDone, done_moved, moved_fix, read_done

    try:
        done = read_done(shard_dir)
    except UnreadableDone as e:
        return "unreadable", str(e)
    if done is not None:
        if done.get("fingerprint") == expected["fingerprint"]:
            if done_moved(done, shard_dir):
                return "moved", (f"computed in {done['shard_dir']}: its scp files point there; "
                                 + moved_fix(shard_dir.parent.parent.name))
            return "done", ""
        had = done.get("inputs") or {}
        changed = [part for part in STALE_CAUSES if part in had and had[part] != expected[part]]
        if "keys" in changed:  # a plan cut anew: other keys come with other records and audio, nothing to tell
            changed = [part for part in changed if part not in ("records", "audio")]
        causes = [STALE_CAUSES[part] for part in changed]
        if "stage" in changed:  # what in the stage, when its history still holds the fingerprint the shard ran with
            from snakeshard.workflow.parse import stage_changes

            what = stage_changes(shard_dir.parent, had["stage"], expected["stage"])
            if what:
                causes[changed.index("stage")] = "the stage: " + "; ".join(what[:5])
        return "stale", "changed since it ran: " + (", ".join(causes) or "its inputs, config or code")
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    own = [n for n, line in enumerate(lines) if line.startswith((f"{ERROR_PREFIX}shard {shard} ",
                                                                   f"{ERROR_PREFIX}shard {shard}:"))]
    if own:  # this shard's error line and the end of its traceback above it (a job's log may hold several shards)
        return "failed", "\n".join("      | " + line for line in lines[max(0, own[-1] - 3):own[-1] + 1])
    tail = lines[-5:]
    if any(line.startswith(ERROR_PREFIX) for line in tail) or any("Error" in line for line in tail[-1:]):
        return "failed", "\n".join("      | " + line for line in tail)
    if (shard_dir / ".attempt").exists():
        if any(f": {INTERRUPTED};" in line for line in tail):  # the job's own line on Ctrl-C (workflow.job)
            return "incomplete", "interrupted (SIGINT, Ctrl-C): the next run runs it again"
        return "incomplete", ("started, no done: running now, or killed (if its log has no error, the "
                              "cause may be in snakemake's own output)")
    return "pending", ""


def canary_failure(stage: str, canary: dict, log: Path) -> str | None:
    """The error line of the stage's canary when the current fingerprint's canary has no done and its log (the
    stage's, written by its last canary job) is that fingerprint's and ends in an error; None otherwise (canary
    off, done, not run yet, running, or the log of an earlier fingerprint)."""
    if Path(canary["dir"], "done").exists() or not log.is_file():
        return None
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    if not lines or lines[0] != canary_log_head(stage, canary["fingerprint"]) or not lines[-1].startswith(ERROR_PREFIX):
        return None
    return lines[-1]


def merge_failure(set_dir: Path, log: Path) -> str | None:
    """The error line of the set's last merge when it failed with its shards as they are now (its log ends in an
    error and is newer than every shard's done); None otherwise (not run, succeeded, or shards ran again since)."""
    if not log.is_file():
        return None
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    if not lines or not lines[-1].startswith(ERROR_PREFIX):
        return None
    dones = [done.stat().st_mtime_ns for done in set_dir.glob("split.*/done")]
    return None if dones and max(dones) > log.stat().st_mtime_ns else lines[-1]


def merged_line(merged: str, set_dir: Path, stage: str, removed: bool) -> str:
    """What status says of a set's merge (see merged_state)."""
    from snakeshard.core.merge import MAX_LISTED, merged_record, missing_merged_files, moved_fix, remerge_fix

    if merged == "yes":
        return "yes, current" + (" (the merged output does not need the removed shards' done files)" if removed else "")
    if merged == "stale":
        return ("stale (made from other data, config or code than the current plan; snakeshard refuses to read it, "
                "the next successful snakemake run replaces it)")
    if merged == "missing":
        missing = missing_merged_files(set_dir, merged_record(set_dir))
        return (f"missing {', '.join(missing[:MAX_LISTED])} (its merged.json lists it; snakeshard refuses to read the "
                f"set): {remerge_fix(set_dir)}")
    if merged == "moved":
        return (f"moved (made in {merged_record(set_dir)['set_dir']}, and its scp files point there; snakeshard "
                f"refuses to read it): {moved_fix(stage)}")
    return "no"


def remade_because(wf, stage: str, ds: str, trainings: dict, memo: dict) -> str | None:
    """Why snakemake makes a set's merge again though its shards' fingerprints are current, or None: the model it
    infers with is not the current one, or the set it reads from is not (Snakemake reruns what follows an input it
    makes again; the fingerprints cannot tell while the old model or upstream output is still on disk)."""
    from snakeshard.workflow.train_config import model_source

    if (stage, ds) not in memo:
        memo[stage, ds] = None
        source = model_source(wf.config, stage)
        up = wf.upstream.get((stage, ds))
        newer = newer_than_merge(Path(wf.out) / stage / ds, wf.job_done_files(stage, ds))
        if newer:  # Snakemake's mtime trigger: a merge input newer than its output
            memo[stage, ds] = f"{newer} is newer than its merged.json: a shard job ran since the merge"
        elif source and trainings[source][0] != "done":
            memo[stage, ds] = f"its model, training stage {source}, is {trainings[source][0]}"
        elif up and (_upstream_rerun(wf, stage, up) or remade_because(wf, *up, trainings, memo)):
            memo[stage, ds] = f"it reads stage {up[0]}, dataset {up[1]}, which is made again"
    return memo[stage, ds]


def _upstream_rerun(wf, stage: str, up: tuple[str, str]) -> bool:
    """Whether Snakemake reruns what a chained set's jobs read of its upstream set ``up``: its merge, for a stage
    that reads the whole merged output; else its shards, one of which is not current. A merge made again over
    current shards (a merged file deleted) remakes no reader of the shards (a user trial: status said it did)."""
    merged = merged_state(Path(wf.out) / up[0] / up[1], wf.inputs[up])
    if stage in wf.merge_readers:
        return merged != "yes"
    # a done deleted under a current merge is not rerun, nor a moved project's shard
    return any(state not in ("done", "moved") and not deleted
               for _, state, _, deleted in set_shard_states(wf, *up, merged))


def set_shard_states(wf, stage: str, ds: str, merged: str):
    """Per shard of a set: its plan entry, its state and detail (from its dir, its log and the fingerprints it must
    have now), and whether its done was deleted under a current merge (``merged``, the set's merged_state, "yes")."""
    base = Path(wf.out) / stage / ds
    for shard, expected in zip(wf.plans[stage, ds]["shards"], wf.shard_inputs[stage, ds]):
        n = shard["shard"]
        state, detail = shard_state(base / f"split.{n}", Path(wf.shard_job_files(stage, ds, n)[0]),
                                    {**expected, "stage": wf.stage_fps[stage, ds]}, n)
        yield shard, state, detail, state in ("pending", "incomplete") and merged == "yes"


def newer_than_merge(set_dir: Path, job_outputs: list[str]) -> str | None:
    """The first of a set's shard job outputs (the merge rule's inputs) modified after its merged.json, or None."""
    try:
        merged = (set_dir / "merged.json").stat().st_mtime_ns
    except OSError:
        return None
    for path in job_outputs:
        try:
            if os.stat(path).st_mtime_ns > merged:
                return path
        except OSError:
            continue
    return None


def snakemake_command() -> str:
    """``snakemake`` with this project's local profile (``snakeshard init`` writes profiles/local; this
    repository keeps config/profiles/local), as a command status prints should be run."""
    for profile in ("profiles/local", "config/profiles/local"):
        if Path(profile, "config.yaml").is_file():
            return f"snakemake --profile {profile}"
    return "snakemake --cores 1"


def cmd_status(args) -> int:
    from snakeshard.core.plan import shards_text
    from snakeshard.train.stage import training_state
    from snakeshard.workflow.parse import DEAD_RUN_LOCK, dead_run_lock, stage_sets

    wf = _workflow(args.config)
    trainings = {stage: training_state(training) for stage, training in wf.trainings.items()}
    remade: dict = {}
    counts: dict[str, int] = {}
    canaries_told: set[str] = set()
    for stage, ds in stage_sets(wf.config):  # config order, as `snakeshard plan` lists them
        plan = wf.plans[stage, ds]
        base = Path(wf.out) / stage / ds
        merged = merged_state(base, wf.inputs[stage, ds])
        because = remade_because(wf, stage, ds, trainings, remade) if merged == "yes" else None
        removed = 0
        print(f"stage {stage}, dataset {ds}: {shards_text(plan['num_shards'])}")
        if stage not in canaries_told:  # the stage's canary, under the stage's first set
            canaries_told.add(stage)
            log = wf.canaries[stage]["log"]
            failure = canary_failure(stage, wf.canaries[stage], Path(log))
            if failure and merged != "yes":  # merged and current: the failure blocks nothing (a canary forced later)
                print(f"  canary: failed (log {log}): {failure}")
        for shard, state, detail, deleted in set_shard_states(wf, stage, ds, merged):
            n = shard["shard"]
            shard_dir = base / f"split.{n}"
            log, output = wf.shard_job_files(stage, ds, n)
            if deleted and not because:
                # Snakemake does not rerun a removed intermediate under an up-to-date merge.
                force = "" if output.endswith(f"split.{n}/done") else "--force "
                state, detail = "removed", (f"done deleted after the merge; `{snakemake_command()} {force}{output}` "
                                            "redoes it")
                removed += 1
            elif deleted and newer_than_merge(base, [str(shard_dir / ".attempt")]) is None:  # not started since
                state, detail = "pending", ("done deleted after the merge; the next run redoes it, as it makes the "
                                            "merge again")
            counts[state] = counts.get(state, 0) + 1
            items = f"{shard['items']:>7} item{'s' if shard['items'] != 1 else ' '}"
            print(f"  split.{n:<5} {state:<10} {items}  {detail if state != 'failed' else ''}".rstrip())
            if state == "failed":
                print(f"      log {log}:\n{detail}")
        merge_log = base / MERGE_LOG
        failure = merge_failure(base, merge_log) if merged != "yes" else None
        print("  merged: " + (f"failed (log {merge_log}): {failure}" if failure
                              else f"yes, not current: snakemake makes it again ({because})" if because
                              else merged_line(merged, base, stage, bool(removed))))
    for stage, (state, detail) in trainings.items():
        counts[state] = counts.get(state, 0) + 1
        print(f"stage {stage} (training), dataset {wf.config['stages'][stage]['train']}: {state}  {detail}".rstrip())
    print("summary: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    if dead_run_lock(os.getcwd(), os.getpid()):  # a trial: status said the run resumes, and it stopped on the lock
        print(f"note: {DEAD_RUN_LOCK}: the next run stops with Snakemake's LockException. If none runs here on "
              f"another machine either: {snakemake_command()} --unlock")
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
    from snakeshard.stages.wer import word_error_rate
    from snakeshard.workflow.parse import read_fingerprints

    set_dir = Path(args.hyp).parent
    fingerprints = read_fingerprints(set_dir)
    if fingerprints is not None:  # a snakeshard set: read only a current merge (not one a failed rerun left)
        require_current(set_dir, current_inputs(args.config, set_dir) or fingerprints["inputs"])
    normalize = [n for n in (args.normalize or "").split(",") if n]
    text = f"{word_error_rate(args.ref, args.hyp, normalize).summary()} hyp={args.hyp} ref={args.ref}"
    print(text)
    if args.out:
        from snakeshard.io.atomic import atomic_write_text

        atomic_write_text(args.out, text + "\n")
    return 0


def cmd_init(args) -> int:
    if args.recipe:
        from snakeshard.recipes import init_recipe

        written = init_recipe(args.recipe, args.directory, args.data)
        print(f"wrote {', '.join(written)} in {args.directory}")
        print(f"next: cd {args.directory} && snakemake --profile profiles/local"
              + ("" if args.data else " (its data prep downloads FSDD first, 16 MB)"))
        return 0
    from snakeshard.workflow.project import init_project, manifest_fields_note, relative_audio_note

    written = init_project(args.directory, args.data)
    print(f"wrote {', '.join(written)} in {args.directory}")
    for note in (relative_audio_note(args.data, args.directory), manifest_fields_note(args.data, args.directory)) \
            if args.data else ():
        if note:
            print(note, file=sys.stderr)
    print(f"next: cd {args.directory} && snakemake -n && snakemake --profile profiles/local && snakeshard status")
    print('on SLURM: pip install "snakeshard[slurm]" (the executor plugin), then snakemake --profile profiles/slurm')
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

    p = argparse.ArgumentParser(prog="snakeshard", description=__doc__.split("\n")[0].replace("``", ""))
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
    sp.add_argument("--data", help="a Kaldi data dir (with wav.scp) or a .jsonl manifest; default: copy the demo "
                                    "speech. With --recipe digits: a directory of FSDD's WAVs; default: download them")
    from snakeshard.recipes import RECIPES

    sp.add_argument("--recipe", choices=sorted(RECIPES), help="write a complete recipe instead: digits (FSDD spoken "
                                                          "digits: data prep, fbank, stats, train, inference, scoring)")
    sp.set_defaults(func=cmd_init)

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
                                       "unreadable, incomplete, pending or removed, a failed canary, and whether the merge is current")
    with_config(sp)
    sp.set_defaults(func=cmd_status)

    sp = sub.add_parser("wer", help="word error rate of a hypothesis text file against a reference (jiwer)")
    sp.add_argument("--hyp", required=True, help="hypotheses: a 'key text' file (e.g. a merged results/asr/demo/text; "
                                                 "a snakeshard set's is read only when its merge is current)")
    sp.add_argument("--ref", required=True, help="references: a 'key text' file with the same keys (e.g. data/demo/text)")
    sp.add_argument("--normalize", help="jiwer transforms for both sides, comma-separated (e.g. lowercase,"
                                        "remove_punctuation); default: none, the text as written")
    sp.add_argument("--out", help="also write the printed line to this file (default: print only)")
    with_config(sp)  # the project whose set --hyp is: its merge must be current under the data and config as they are
    sp.set_defaults(func=cmd_wer)

    sp = sub.add_parser("config-reference", help="print every config key with its type, default and meaning, as "
                                                 "Markdown, from the config schema (docs/config.md is its output)")
    sp.add_argument("--output", metavar="FILE", help="write it to FILE (e.g. docs/config.md) instead of printing it")
    sp.set_defaults(func=cmd_config_reference)
    return p
