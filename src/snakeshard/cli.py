"""``snakeshard`` command line: init, plan, run-shard, merge, status, wer.

The Snakefile's rules call ``python -m snakeshard run-shard/merge``; people call
``snakeshard plan`` and ``snakeshard status``. Errors on bad input print one
message naming key, shard and file, and exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

from snakeshard.errors import SnakeshardError

ERROR_PREFIX = "snakeshard: error: "
CANARY = "canary"  # the --shard of a stage's canary job


def _workflow(args):
    from snakeshard.workflow import Workflow, load_config, validate_config

    config = load_config(args.config)
    validate_config(config)
    return Workflow(config)


def cmd_plan(args) -> int:
    from snakeshard.plan import format_plan_table, make_plan
    from snakeshard.workflow import load_config, run_spec, stage_sets, validate_config

    config = load_config(args.config)
    validate_config(config)
    for stage, ds in stage_sets(config):
        if args.stage and stage != args.stage:
            continue
        spec = run_spec(config, stage, ds)
        plan, _ = make_plan(spec["dataset"], config["stages"][stage]["sharding"])  # in memory: writes nothing
        print(format_plan_table(plan, f"stage {stage}, dataset {ds}:"))
    return 0


def cmd_run_shard(args) -> int:
    spec = json.loads(Path(args.spec).read_text())
    if args.shard != CANARY:
        return _run_shard(args, spec)
    return _run_canary(args, spec)


def _run_canary(args, spec: dict) -> int:
    """A stage's canary job (see workflow/rules/canary.smk): the shard path over its few keys."""
    import shutil

    from snakeshard.atomic import atomic_write_json
    from snakeshard.plan import read_shard_keys
    from snakeshard.shard import clear_shard_dir

    shard_dir = Path(args.shard_dir)
    try:
        if read_shard_keys(shard_dir):
            _run_shard(args, spec)
        else:  # canary: 0 -- nothing to check, nothing to build
            clear_shard_dir(shard_dir)
            atomic_write_json(shard_dir / "done", {"shard": CANARY, "items": 0, "canary": "off",
                                                   "fingerprint": args.fingerprint}, fsync=False)
    except SnakeshardError as e:
        raise type(e)(f"canary of stage {spec['stage']!r} failed, so none of its shard jobs was started; "
                      f"fix the stage, then rerun: {e}") from e.__cause__
    except Exception as e:  # the provider's own code failed while building the env
        raise SnakeshardError(f"canary of stage {spec['stage']!r} failed while building the provider's env, "
                              f"so none of its shard jobs was started: {type(e).__name__}: {e}") from e
    for old in shard_dir.parent.iterdir():  # canaries of earlier stage fingerprints
        if old != shard_dir and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return 0


def _run_shard(args, spec: dict) -> int:
    from snakeshard.devices import job_devices
    from snakeshard.shard import run_shard_dir
    from snakeshard.workflow import import_object

    where = f"stages.{spec['stage']}"
    runner_cls = import_object(spec["runner"], f"{where}.runner")
    provider_cls = import_object(spec["provider"], f"{where}.provider")
    devices = job_devices(spec.get("gpus", 0), spec["stage"])  # fail at job start, before loading anything
    provider = provider_cls({**spec["provider_config"], "dataset": spec["dataset"], "devices": devices})
    env = provider.build_worker_setup_fn()()  # once per job
    done = run_shard_dir(runner_cls, env, args.shard_dir, shard_id=args.shard, fingerprint=args.fingerprint,
                         log_path=args.log, batch_size=spec.get("batch_size"), progress=True)
    print(f"shard {args.shard}: {done['items']} items in {done['end'] - done['start']:.2f} s", file=sys.stderr)
    return 0


def cmd_merge(args) -> int:
    from snakeshard.merge import merge_set
    from snakeshard.workflow import import_object

    spec = json.loads(Path(args.spec).read_text())
    plan = json.loads((Path(args.set_dir) / "plan.json").read_text())
    runner_cls = import_object(spec["runner"], f"stages.{spec['stage']}.runner")
    record = merge_set(Path(args.set_dir), plan, args.stage_fingerprint, runner_cls)
    print(f"merged {record['shards']} shards, {record['items']} items into {args.set_dir}: {', '.join(record['files'])}")
    return 0


def merged_state(set_dir: Path, plan: dict, stage_fp: str) -> str:
    """yes (current) / stale (made from another plan or fingerprint) / no."""
    try:
        record = json.loads((set_dir / "merged.json").read_text())
    except FileNotFoundError:
        return "no"
    if record.get("fingerprint") == stage_fp and record.get("items") == plan["num_items"]:
        return "yes"
    return "stale"


def shard_state(shard_dir: Path, log: Path, expected_fp: str) -> tuple[str, str]:
    """(state, detail): done, stale, failed (with log tail), incomplete (started, no result), pending."""
    from snakeshard.merge import read_done

    done = read_done(shard_dir)
    if done is not None:
        return ("done", "") if done.get("fingerprint") == expected_fp else ("stale", "done with another fingerprint")
    tail = log.read_text(errors="replace").splitlines()[-5:] if log.is_file() else []
    if any(line.startswith(ERROR_PREFIX) for line in tail) or any("Error" in line for line in tail[-1:]):
        return "failed", "\n".join("      | " + line for line in tail)
    if (shard_dir / ".attempt").exists():
        return "incomplete", "started, no done: running now, or killed"
    return "pending", ""


def cmd_status(args) -> int:
    wf = _workflow(args)
    counts: dict[str, int] = {}
    for (stage, ds), plan in wf.plans.items():
        base = Path(wf.out) / stage / ds
        merged = merged_state(base, plan, wf.stage_fps[stage, ds])
        print(f"stage {stage}, dataset {ds}: {plan['num_shards']} shards")
        for shard, fp in zip(plan["shards"], wf.shard_fps[stage, ds]):
            n = shard["shard"]
            shard_dir, log = base / f"split.{n}", base / "logs" / f"split.{n}.log"
            state, detail = shard_state(shard_dir, log, fp)
            if state in ("pending", "incomplete") and merged == "yes":
                # Snakemake does not rerun a removed intermediate under an up-to-date merge.
                state, detail = "removed", f"done deleted after the merge; `snakemake {shard_dir}/done` redoes it"
            counts[state] = counts.get(state, 0) + 1
            print(f"  split.{n:<5} {state:<10} {shard['items']:>7} items  {detail if state != 'failed' else ''}".rstrip())
            if state == "failed":
                print(f"      log {log}:\n{detail}")
        print("  merged: " + {
            "yes": "yes, current" + (" (the merged output does not need the removed shards' done files)"
                                     if counts.get("removed") else ""),
            "stale": "stale (made from another plan or fingerprint; the next snakemake run redoes it)",
            "no": "no",
        }[merged])
    print("summary: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return 0


def cmd_wer(args) -> int:
    from snakeshard.wer import format_wer, word_error_rate

    result = word_error_rate(args.ref, args.hyp)
    text = format_wer(result, args.hyp, args.ref)
    print(text)
    if args.out:
        from snakeshard.atomic import atomic_write_text

        atomic_write_text(args.out, text + "\n")
    return 0


def _shard_id(text: str) -> int | str:
    if text == CANARY:
        return text
    return int(text)


def cmd_init(args) -> int:
    from snakeshard.project import init_project

    written = init_project(args.directory, args.data)
    print(f"wrote {', '.join(written)} in {args.directory}")
    print(f"next: cd {args.directory} && snakemake -n && snakemake --profile profiles/local && snakeshard status")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="snakeshard", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp):
        sp.add_argument("--config", default="config/config.yaml", help="workflow config (default: %(default)s)")

    sp = sub.add_parser("init", help="write a new project (Snakefile using the shipped workflow as a module, "
                                     "config, an example stage, local and SLURM profiles) into DIR")
    sp.add_argument("directory", metavar="DIR")
    sp.add_argument("--data", help="a Kaldi data dir (with wav.scp) or a .jsonl manifest; default: copy the demo speech")
    sp.set_defaults(func=cmd_init)

    sp = sub.add_parser("plan", help="print the shard plan (shard, items, seconds) without running anything")
    with_config(sp)
    sp.add_argument("--stage")
    sp.set_defaults(func=cmd_plan)

    sp = sub.add_parser("run-shard", help="run one shard (called by the shard rule)")
    sp.add_argument("--spec", required=True, help="stage run spec: a JSON file (spec.json beside plan.json)")
    sp.add_argument("--shard", type=_shard_id, required=True, help=f"shard number, or {CANARY!r} for the stage's canary job")
    sp.add_argument("--shard-dir", required=True)
    sp.add_argument("--fingerprint", required=True)
    sp.add_argument("--log", help="this job's log file, named in error messages")
    sp.set_defaults(func=cmd_run_shard)

    sp = sub.add_parser("merge", help="validate and merge all shards of a stage/dataset (called by the merge rule)")
    sp.add_argument("--spec", required=True, help="stage run spec: a JSON file")
    sp.add_argument("--set-dir", required=True)
    sp.add_argument("--stage-fingerprint", required=True)
    sp.set_defaults(func=cmd_merge)

    sp = sub.add_parser("status", help="list each shard as done, failed (with its log tail), incomplete or pending")
    with_config(sp)
    sp.set_defaults(func=cmd_status)

    sp = sub.add_parser("wer", help="word error rate of a hypothesis text file against a reference (jiwer)")
    sp.add_argument("--hyp", required=True)
    sp.add_argument("--ref", required=True)
    sp.add_argument("--out")
    sp.set_defaults(func=cmd_wer)
    return p


def main(argv: list[str] | None = None) -> int:
    # The console script, unlike `python -m`, does not put the working directory on sys.path:
    # the project's own runner modules (my_stage.py beside the Snakefile) must import either way.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here, inside the handler below, not at exit
        return status
    except BrokenPipeError:
        # `snakeshard status | head`: the reader is gone; stop quietly, as a SIGPIPE'd tool does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    except SnakeshardError as e:
        if e.__cause__ is not None:  # the user's own exception: its traceback belongs in the log
            traceback.print_exception(e.__cause__, file=sys.stderr)
        print(ERROR_PREFIX + str(e), file=sys.stderr)
        return 1
