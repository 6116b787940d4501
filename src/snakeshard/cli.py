"""``snakeshard`` command line: init, plan, run-shard, merge, report, status, wer.

The Snakefile's rules call ``python -m snakeshard run-shard/merge``; people call
``snakeshard plan`` and ``snakeshard status``. Errors on bad input print one
message naming key, shard and file, and exit 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

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
        plan, _, _ = make_plan(spec["dataset"], config["stages"][stage]["sharding"])  # in memory: writes nothing
        print(format_plan_table(plan, f"stage {stage}, dataset {ds}:"))
    return 0


def cmd_run_shard(args) -> int:
    from snakeshard.data import SHARD_ITEMS

    spec = json.loads(Path(args.spec).read_text())
    # The job's dataset is its slice (the canary's keys are the first of split.0): see plan.py
    slice_dir = Path(args.shard_dir) if args.shard != CANARY else Path(args.spec).parent / "split.0"
    if (slice_dir / SHARD_ITEMS).is_file():
        spec["dataset"] = {**spec["dataset"], "shard_items": str(slice_dir / SHARD_ITEMS)}
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
    for old in shard_dir.parent.iterdir():  # canaries of earlier stage fingerprints
        if old != shard_dir and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return 0


def _run_shard(args, spec: dict) -> int:
    from snakeshard.fingerprint import digest, parse_shard_inputs

    with _job_env(spec, f"shard {args.shard}" + (f" (log: {args.log})" if args.log else "")) as job:
        if args.shard_inputs is not None:  # a shard job: its fingerprint is the digest of what it was given
            fingerprint, inputs = digest(args.shard_inputs), parse_shard_inputs(args.shard_inputs)
        else:  # the canary: the stage fingerprint
            fingerprint, inputs = args.fingerprint, None
        _run_one(spec, job, args.shard, args.shard_dir, fingerprint, inputs, args.log)
    return 0


@contextlib.contextmanager
def _job_env(spec: dict, label: str):
    """What a job builds once, whatever number of shards it runs: (runner class, env, pool or None)."""
    from snakeshard.devices import job_devices
    from snakeshard.user_code import import_object

    where = f"stages.{spec['stage']}"
    runner_cls = import_object(spec["runner"], f"{where}.runner")
    provider_cls = import_object(spec["provider"], f"{where}.provider")
    devices = job_devices(spec.get("gpus", 0), spec["stage"])  # fail at job start, before loading anything
    # A pool is started first: its workers spawn and load their models while this process builds its own env.
    pool = _start_pool(spec, devices) if spec.get("pool") else None
    try:
        # the provider is kept for the whole job: it may hold what the env refers to (a model, a buffer)
        provider, env = _build_env(spec, provider_cls, devices, label, parent=pool is not None)
        yield runner_cls, env, pool
    finally:
        if pool is not None:
            pool.close()


def _run_one(spec: dict, job, shard, shard_dir, fingerprint, inputs, log) -> dict:
    """One shard over the job's env; its summary line in the log."""
    from snakeshard.shard import run_shard_dir

    runner_cls, env, pool = job
    done = run_shard_dir(runner_cls, env, shard_dir, shard_id=shard, fingerprint=fingerprint,
                         log_path=log, progress=True, inputs=inputs,
                         batch_size=spec.get("batch_size"), batch_seconds=spec.get("batch_seconds"),
                         sort_by_length=spec.get("sort_by_length", False), outputs=spec.get("outputs"),
                         allow_nonfinite=spec.get("allow_nonfinite") or (),
                         report_seconds=spec.get("report_seconds", False), pool=pool)
    took = done["end"] - done["start"]
    audio = ""
    if done.get("seconds") is not None:
        audio = f" ({done['seconds']:.1f} s of audio, {done['seconds'] / max(took, 1e-3):.0f}x real time)"
    print(f"shard {shard}: {done['items']} items{audio} in {took:.2f} s", file=sys.stderr)
    return done


def cmd_run_shards(args) -> int:
    """Several shards in one job (``shards_per_job``): the env built once, every shard tried, each
    writing its own ``done``; the job's own done (the rule's output) only when all of them have one.

    A shard whose ``done`` already carries the fingerprint of its current inputs is not run again:
    that is how a rerun after one failed shard redoes that shard only, though Snakemake reruns the job.
    """
    from snakeshard.atomic import atomic_write_json
    from snakeshard.data import SHARD_ITEMS
    from snakeshard.errors import ShardError
    from snakeshard.fingerprint import digest, parse_shard_inputs

    spec = json.loads(Path(args.spec).read_text())
    first, last = args.shards
    texts = args.shard_inputs.split(",")
    if len(texts) != last - first + 1:
        raise ShardError(f"shards {first}-{last}: --shard-inputs gives {len(texts)} shards' inputs, "
                         f"expected {last - first + 1}")
    set_dir = Path(args.set_dir)
    wanted = {first + i: digest(text) for i, text in enumerate(texts)}
    todo = [n for n in wanted if _done_fingerprint(set_dir / f"split.{n}") != wanted[n]]
    print(f"shards {first}-{last}: {len(wanted) - len(todo)} already done with these inputs, "
          f"{len(todo)} to run", file=sys.stderr)
    failed = []
    if todo:
        slices = [str(set_dir / f"split.{n}" / SHARD_ITEMS) for n in todo]
        spec["dataset"] = {**spec["dataset"], "shard_items": slices}
        label = f"shards {first}-{last}" + (f" (log: {args.log})" if args.log else "")
        with _job_env(spec, label) as job:
            for n in todo:
                try:
                    _run_one(spec, job, n, set_dir / f"split.{n}", wanted[n],
                             parse_shard_inputs(texts[n - first]), args.log)
                except SnakeshardError as e:  # the next shards still run: a rerun then redoes this one only
                    _report(ERROR_PREFIX + str(e), e.__cause__, None)
                    failed.append(str(e))
    if failed:
        raise ShardError(f"shards {first}-{last}: {len(failed)} of {len(todo)} failed (the others are done and "
                         f"are not rerun): " + "; ".join(failed))
    atomic_write_json(args.done, {"shards": [first, last], "fingerprints": [wanted[n] for n in wanted]}, fsync=True)
    return 0


def _done_fingerprint(shard_dir: Path) -> str | None:
    """The fingerprint a shard's ``done`` records; None without a readable one (the shard is then run)."""
    from snakeshard.merge import UnreadableDone, read_done

    try:
        return (read_done(shard_dir) or {}).get("fingerprint")
    except UnreadableDone:
        return None


def _build_env(spec: dict, provider_cls, devices: list[str], shard: str, parent: bool) -> tuple:
    """(provider, env): the job's env, built once (with a pool: the env of this process's hooks; forward
    runs in the workers)."""
    from snakeshard.errors import ShardError

    try:
        provider = provider_cls({**spec["provider_config"], "dataset": spec["dataset"], "devices": devices})
        return provider, provider.build_parent_env() if parent else provider.build_worker_setup_fn()()
    except SnakeshardError as e:
        raise ShardError(f"{shard}: building the env failed: {e}") from e.__cause__
    except Exception as e:  # the provider's own code: its traceback goes to the log
        raise ShardError(f"{shard}: the provider {spec['provider']} failed to build the env: "
                         f"{type(e).__name__}: {e}") from e


def _start_pool(spec: dict, job_devices: list[str]):
    """The stage's pool (``workers: N``: N CPU processes; ``devices: all``: one per GPU of the job)."""
    from snakeshard.shard_pool import forward_pool

    pooled = spec["pool"]
    devices = job_devices if pooled.get("devices") == "all" else ["cpu"] * int(pooled.get("workers") or 1)
    print(f"shard pool: {len(devices)} worker(s) on {', '.join(devices)}, {pooled['order']}"
          + (f", item_timeout {pooled['item_timeout']:g} s" if pooled.get("item_timeout") else ""), file=sys.stderr)
    return forward_pool(devices, pooled["order"] == "ordered", spec["runner"], spec["provider"],
                        {**spec["provider_config"], "dataset": spec["dataset"]}, pooled.get("item_timeout"))


def cmd_merge(args) -> int:
    from snakeshard.errors import MergeError
    from snakeshard.merge import merge_set
    from snakeshard.plan import shards_text
    from snakeshard.user_code import import_object
    from snakeshard.workflow import read_fingerprints

    spec = json.loads(Path(args.spec).read_text())
    plan = json.loads((Path(args.set_dir) / "plan.json").read_text())
    fingerprints = read_fingerprints(args.set_dir)
    if fingerprints is None or fingerprints["inputs"] != args.inputs:
        # Another parse (another config, or data changed since this run's DAG was built) rewrote the plan.
        raise MergeError(f"refusing to merge {args.set_dir}: its plan changed while this run was going "
                         "(another snakemake or snakeshard run with other data or config?); run snakemake again")
    runner_cls = import_object(spec["runner"], f"stages.{spec['stage']}.runner")
    record = merge_set(Path(args.set_dir), plan, fingerprints, runner_cls)
    print(f"merged {shards_text(record['shards'])}, {record['items']} items into {args.set_dir}: "
          f"{', '.join(record['files'])}")
    return 0


def cmd_report(args) -> int:
    """Draw one of a runner's report files (its ``reports``) from the current merged output."""
    from snakeshard.merge import require_current
    from snakeshard.user_code import import_object

    spec = json.loads(Path(args.spec).read_text())
    require_current(args.set_dir, args.inputs)  # never draw a stale merge
    runner_cls = import_object(spec["runner"], f"stages.{spec['stage']}.runner")
    runner_cls.report(Path(args.set_dir), Path(args.output).name, Path(args.output))
    print(f"wrote {args.output}")
    return 0


def merged_state(set_dir: Path, inputs: str) -> str:
    """yes (made from the current plan's inputs) / stale (from other inputs) / no."""
    from snakeshard.merge import merged_record

    record = merged_record(set_dir)
    if record is None:
        return "no"
    return "yes" if record.get("inputs") == inputs else "stale"


# What a stale shard's done differs in, in the words status uses.
STALE_CAUSES = {"keys": "its keys", "records": "its keys' records (wav.scp, segments, text, utt2spk or jsonl)",
                "audio": "its audio files (size or mtime)", "stage": "the stage's config, model files or code",
                "upstream": "the upstream stage's merged output"}


def shard_state(shard_dir: Path, log: Path, expected: dict, shard: int) -> tuple[str, str]:
    """(state, detail): done, stale (with what changed), unreadable, failed (with log tail),
    incomplete (started, no result), pending. ``expected``: the shard's entry in the current fingerprints.
    ``log`` may be a job's of several shards (``shards_per_job``): the error line naming ``shard`` counts."""
    from snakeshard.merge import UnreadableDone, read_done

    try:
        done = read_done(shard_dir)
    except UnreadableDone as e:
        return "unreadable", str(e)
    if done is not None:
        if done.get("fingerprint") == expected["fingerprint"]:
            return "done", ""
        had = done.get("inputs") or {}
        changed = [what for part, what in STALE_CAUSES.items() if part in had and had[part] != expected[part]]
        return "stale", "changed since it ran: " + (", ".join(changed) if changed else "its inputs, config or code")
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    own = [line for line in lines if line.startswith((f"{ERROR_PREFIX}shard {shard} ", f"{ERROR_PREFIX}shard {shard}:"))]
    if own:  # a job's log of several shards: this shard's error line
        return "failed", "\n".join("      | " + line for line in own)
    tail = lines[-5:]
    if any(line.startswith(ERROR_PREFIX) for line in tail) or any("Error" in line for line in tail[-1:]):
        return "failed", "\n".join("      | " + line for line in tail)
    if (shard_dir / ".attempt").exists():
        return "incomplete", ("started, no done: running now, or killed (if its log has no error, the "
                              "cause may be in snakemake's own output)")
    return "pending", ""


def cmd_status(args) -> int:
    from snakeshard.plan import shards_text
    from snakeshard.workflow import stage_sets

    wf = _workflow(args)
    counts: dict[str, int] = {}
    for stage, ds in stage_sets(wf.config):  # config order, as `snakeshard plan` lists them
        plan = wf.plans[stage, ds]
        base = Path(wf.out) / stage / ds
        merged = merged_state(base, wf.inputs[stage, ds])
        print(f"stage {stage}, dataset {ds}: {shards_text(plan['num_shards'])}")
        for shard, expected in zip(plan["shards"], wf.shard_inputs[stage, ds]):
            n = shard["shard"]
            shard_dir = base / f"split.{n}"
            log, output = wf.shard_job_files(stage, ds, n)
            state, detail = shard_state(shard_dir, Path(log), {**expected, "stage": wf.stage_fps[stage, ds]}, n)
            if state in ("pending", "incomplete") and merged == "yes":
                # Snakemake does not rerun a removed intermediate under an up-to-date merge.
                redo = f"snakemake {output}" if output.endswith(f"split.{n}/done") else f"snakemake --force {output}"
                state, detail = "removed", f"done deleted after the merge; `{redo}` redoes it"
            counts[state] = counts.get(state, 0) + 1
            print(f"  split.{n:<5} {state:<10} {shard['items']:>7} items  {detail if state != 'failed' else ''}".rstrip())
            if state == "failed":
                print(f"      log {log}:\n{detail}")
        print("  merged: " + {
            "yes": "yes, current" + (" (the merged output does not need the removed shards' done files)"
                                     if counts.get("removed") else ""),
            "stale": "stale (made from other data, config or code than the current plan; snakeshard refuses to "
                     "read it, the next successful snakemake run replaces it)",
            "no": "no",
        }[merged])
    print("summary: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return 0


def cmd_wer(args) -> int:
    from snakeshard.merge import merged_record, require_current
    from snakeshard.wer import word_error_rate
    from snakeshard.workflow import read_fingerprints

    set_dir = Path(args.hyp).parent
    fingerprints = read_fingerprints(set_dir)
    if fingerprints is not None and merged_record(set_dir) is not None:  # a snakeshard merged output
        require_current(set_dir, fingerprints["inputs"])
    normalize = [n for n in (args.normalize or "").split(",") if n]
    text = f"{word_error_rate(args.ref, args.hyp, normalize).summary()} hyp={args.hyp} ref={args.ref}"
    print(text)
    if args.out:
        from snakeshard.atomic import atomic_write_text

        atomic_write_text(args.out, text + "\n")
    return 0


def _shard_id(text: str) -> int | str:
    if text == CANARY:
        return text
    return int(text)


def _shard_range(text: str) -> tuple[int, int]:
    first, sep, last = text.partition("-")
    if not sep or int(last) < int(first):
        import argparse

        raise argparse.ArgumentTypeError(f"{text!r}: expected FIRST-LAST, e.g. 0-15")
    return int(first), int(last)


def cmd_init(args) -> int:
    from snakeshard.project import init_project

    written = init_project(args.directory, args.data)
    print(f"wrote {', '.join(written)} in {args.directory}")
    print(f"next: cd {args.directory} && snakemake -n && snakemake --profile profiles/local && snakeshard status")
    print('on SLURM: pip install "snakeshard[slurm]" (the executor plugin), then snakemake --profile profiles/slurm')
    return 0


# The commands the workflow's rules run once per job, with their options as the rules write them:
# (function, required, optional, exactly one of (when not empty), converters). A job parses these itself
# (_job_args): building the argparse parser costs every shard job ~5 ms (gettext, locale, shutil).
# Anything else, a typo or --help included, goes through argparse (build_parser), which holds the
# same options and gives the messages.
JOB_COMMANDS = {
    "run-shard": (cmd_run_shard, {"--spec", "--shard", "--shard-dir"}, {"--shard-inputs", "--fingerprint", "--log"},
                  {"--shard-inputs", "--fingerprint"}, {"--shard": _shard_id}),
    "run-shards": (cmd_run_shards, {"--spec", "--shards", "--set-dir", "--shard-inputs", "--done"}, {"--log"}, set(),
                   {"--shards": _shard_range}),
}


def _job_args(argv: list[str]):
    """The arguments of a job command written as the rules write it (only ``--option value`` pairs, each
    known, the required ones there): what argparse would give. None for anything else."""
    if not argv or argv[0] not in JOB_COMMANDS or len(argv) % 2 != 1:
        return None
    func, required, optional, one_of, convert = JOB_COMMANDS[argv[0]]
    given = dict(zip(argv[1::2], argv[2::2]))
    if (len(given) != len(argv) // 2 or not required <= given.keys() <= required | optional
            or (one_of and len(one_of & given.keys()) != 1)):
        return None
    values = {}
    for option in sorted(required | optional):
        value = given.get(option)
        if value is not None and option in convert:
            try:
                value = convert[option](value)
            except Exception:  # argparse words the error
                return None
        values[option[2:].replace("-", "_")] = value
    return SimpleNamespace(command=argv[0], func=func, **values)


def build_parser():
    """The whole command line (argparse.ArgumentParser), imported here: see JOB_COMMANDS."""
    import argparse

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
    given = sp.add_mutually_exclusive_group(required=True)
    given.add_argument("--shard-inputs", help="a shard job: what its fingerprint digests (stage:keys:records:audio)")
    given.add_argument("--fingerprint", help="the canary: the stage fingerprint")
    sp.add_argument("--log", help="this job's log file, named in error messages")
    sp.set_defaults(func=cmd_run_shard)

    sp = sub.add_parser("run-shards", help="run several shards in one job (called by the shard rule when the stage "
                                           "sets shards_per_job)")
    sp.add_argument("--spec", required=True, help="stage run spec: a JSON file (spec.json beside plan.json)")
    sp.add_argument("--shards", type=_shard_range, required=True, help="FIRST-LAST shard numbers")
    sp.add_argument("--set-dir", required=True, help="the stage/dataset dir holding split.N/")
    sp.add_argument("--shard-inputs", required=True, help="per shard, what its fingerprint digests, comma-separated")
    sp.add_argument("--done", required=True, help="the job's own done, written when every shard has its done")
    sp.add_argument("--log", help="this job's log file, named in error messages")
    sp.set_defaults(func=cmd_run_shards)

    sp = sub.add_parser("merge", help="validate and merge all shards of a stage/dataset (called by the merge rule)")
    sp.add_argument("--spec", required=True, help="stage run spec: a JSON file")
    sp.add_argument("--set-dir", required=True)
    sp.add_argument("--inputs", required=True, help="digest of the shard fingerprints the run's DAG was built with")
    sp.add_argument("--log", help="the merge's log file")
    sp.set_defaults(func=cmd_merge)

    sp = sub.add_parser("report", help="draw a runner's report file (e.g. metrics.png) from a merged set (called by "
                                       "the report rule)")
    sp.add_argument("--spec", required=True, help="stage run spec: a JSON file")
    sp.add_argument("--set-dir", required=True)
    sp.add_argument("--inputs", required=True, help="digest of the shard fingerprints the merge must have been made from")
    sp.add_argument("--output", required=True)
    sp.set_defaults(func=cmd_report)

    sp = sub.add_parser("status", help="list each shard as done, stale (with the cause), failed (with its log tail), "
                                       "unreadable, incomplete, pending or removed, and whether the merge is current")
    with_config(sp)
    sp.set_defaults(func=cmd_status)

    sp = sub.add_parser("wer", help="word error rate of a hypothesis text file against a reference (jiwer)")
    sp.add_argument("--hyp", required=True)
    sp.add_argument("--ref", required=True)
    sp.add_argument("--normalize", help="jiwer transforms for both sides, comma-separated (e.g. lowercase,"
                                        "remove_punctuation); default: none, the text as written")
    sp.add_argument("--out")
    sp.set_defaults(func=cmd_wer)
    return p


def main(argv: list[str] | None = None) -> int:
    # The console script, unlike `python -m`, does not put the working directory on sys.path:
    # the project's own runner modules (my_stage.py beside the Snakefile) must import either way.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if argv is None:
        argv = sys.argv[1:]
    args = _job_args(argv) or build_parser().parse_args(argv)
    # A job (run-shard, merge) writes its own log, keeping a handle on the stderr it was started
    # with: Snakemake's own output, where its error line is echoed (a full disk can swallow the log).
    console = _log_to(args.log) if getattr(args, "log", None) else None
    try:
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here, inside the handler below, not at exit
        return status
    except BrokenPipeError:
        # `snakeshard status | head`: the reader is gone; stop quietly, as a SIGPIPE'd tool does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    except SnakeshardError as e:
        _report(ERROR_PREFIX + str(e), e.__cause__, console)
        return 1
    except OSError as e:  # outside the user's code: a full disk, a read-only or vanished directory
        where = f" ({args.shard_dir})" if getattr(args, "shard_dir", None) else ""
        what = f"shard {args.shard}{where}" if getattr(args, "shard", None) is not None else args.command
        _report(f"{ERROR_PREFIX}{what}: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""), e, console)
        return 1


def _log_to(path: str) -> int | None:
    """Point stdout and stderr at the log file ``path``; return a descriptor of the original stderr.

    None, with a warning on stderr, when the log cannot be opened: output then stays on stderr.
    """
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    except OSError as e:
        print(f"snakeshard: warning: cannot write the log {path} ({e.strerror}): output goes here", file=sys.stderr)
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    console = os.dup(2)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return console


def _report(line: str, cause: BaseException | None, console: int | None) -> None:
    """The error's traceback (the user's own exception) and its one line to the log; the line also to
    ``console``, whether or not the log could take it."""
    try:
        if cause is not None:
            import traceback  # only on failure: its imports cost every job ~3 ms

            traceback.print_exception(cause, file=sys.stderr)
        print(line, file=sys.stderr, flush=True)
    except OSError:  # the log's disk is full: the console line below still carries the cause
        pass
    if console is not None:
        os.write(console, (line + "\n").encode("utf-8", "replace"))
