"""``snakeshard`` command line: plan, run-shard, merge, status, wer.

The Snakefile's rules call ``python -m snakeshard run-shard/merge``; people call
``snakeshard plan`` and ``snakeshard status``. Errors on bad input print one
message naming key, shard and file, and exit 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from snakeshard.errors import SnakeshardError

ERROR_PREFIX = "snakeshard: error: "


def _workflow(args):
    from snakeshard.workflow import SCHEMA, Workflow, load_config, validate_config

    config = load_config(args.config)
    validate_config(config, Path(args.workflow_dir) / SCHEMA)
    return Workflow(config)


def cmd_plan(args) -> int:
    from snakeshard.plan import format_plan_table, make_plan
    from snakeshard.workflow import SCHEMA, load_config, run_spec, stage_sets, validate_config

    config = load_config(args.config)
    validate_config(config, Path(args.workflow_dir) / SCHEMA)
    for stage, ds in stage_sets(config):
        if args.stage and stage != args.stage:
            continue
        spec = run_spec(config, stage, ds)
        plan, _ = make_plan(spec["dataset"], config["stages"][stage]["sharding"])  # in memory: writes nothing
        print(format_plan_table(plan, f"stage {stage}, dataset {ds}:"))
    return 0


def cmd_run_shard(args) -> int:
    from snakeshard.devices import job_devices
    from snakeshard.shard import run_shard_dir
    from snakeshard.workflow import import_object

    spec = json.loads(Path(args.spec).read_text())
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
        print(f"stage {stage}, dataset {ds}: {plan['num_shards']} shards")
        for shard, fp in zip(plan["shards"], wf.shard_fps[stage, ds]):
            n = shard["shard"]
            state, detail = shard_state(base / f"split.{n}", base / "logs" / f"split.{n}.log", fp)
            counts[state] = counts.get(state, 0) + 1
            print(f"  split.{n:<5} {state:<10} {shard['items']:>7} items  {detail if state != 'failed' else ''}")
            if state == "failed":
                print(f"      log {base / 'logs' / f'split.{n}.log'}:\n{detail}")
        merged = (base / "merged.json").is_file()
        print(f"  merged: {'yes' if merged else 'no'}")
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="snakeshard", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(sp):
        sp.add_argument("--config", default="config/config.yaml", help="workflow config (default: %(default)s)")
        sp.add_argument("--workflow-dir", default=".", help="directory holding workflow/schemas (default: .)")

    sp = sub.add_parser("plan", help="print the shard plan (shard, items, seconds) without running anything")
    with_config(sp)
    sp.add_argument("--stage")
    sp.set_defaults(func=cmd_plan)

    sp = sub.add_parser("run-shard", help="run one shard (called by the shard rule)")
    sp.add_argument("--spec", required=True, help="stage run spec: a JSON file (spec.json beside plan.json)")
    sp.add_argument("--shard", type=int, required=True)
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
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SnakeshardError as e:
        if e.__cause__ is not None:  # the user's own exception: its traceback belongs in the log
            traceback.print_exception(e.__cause__, file=sys.stderr)
        print(ERROR_PREFIX + str(e), file=sys.stderr)
        return 1
