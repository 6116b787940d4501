"""A shard job: ``python -m snakeshard run-shard`` (and ``run-shards``), as the workflow's rules run it.

This is the entry of every job, so it imports only what a job needs before its first item (no
argparse: tests/test_job_overhead.py lists what stays out and why). Any other command line goes to
``cli``, which has the whole parser.
The error handling every command shares (the log, the one error line) lives here too.
"""

from __future__ import annotations

import contextlib
import os
import sys

from snakeshard.core.shard_files import CANARY_SPEC, SHARD_ITEMS, read_spec
from snakeshard.errors import ERROR_PREFIX, WARNING_PREFIX, ShardError, SnakeshardError, in_stage, naming_stage

CANARY = "canary"  # the --shard of a stage's canary job
INTERRUPTED = "interrupted (SIGINT)"  # a job's line on Ctrl-C, after the command: `snakeshard status` looks for it
STOPPED = "stopped by SIGTERM"  # a job's line on SIGTERM (scancel, a SLURM time limit, kill): status looks for it too
RERUN = "; rerun to go on"  # the end of both lines (status leaves it out: it says what the next run does)


class Terminated(BaseException):
    """SIGTERM in a job, raised where the job is (as Ctrl-C's KeyboardInterrupt), so that its ``finally`` blocks
    and its pool's shutdown run and its log ends with a line saying why it stopped: without it a job cancelled by
    SLURM died without a word, and status called its shard pending (a Kaldi user's trial)."""


def _raise_terminated(signum, frame):
    raise Terminated()


def slurm_job() -> str | None:
    """The SLURM job this process runs in (its id), or None outside SLURM."""
    return os.environ.get("SLURM_JOB_ID") or None


def started_line(what: str) -> str:
    """A job log's first line: when, where and as which process it started (run.pl's '# Started at' and host; a Kaldi
    user's trial missed them: its end, in seconds, is the job's last line)."""
    import time

    slurm = f", SLURM job {slurm_job()}" if slurm_job() else ""
    return f"{what}: started {time.strftime('%Y-%m-%d %H:%M:%S %z')} on {os.uname().nodename}, pid {os.getpid()}{slurm}"


def check_spec_current(spec: dict, path: str, stage_fingerprint: str) -> None:
    """The spec a job reads is rewritten by every parse (a ``snakemake -n`` or ``snakeshard status`` too): one
    made from another config while this run was going would have the job compute with that config under this
    run's fingerprint, and its ``done`` would then look current to both. The job refuses it instead."""
    if spec.get("stage_fingerprint", stage_fingerprint) != stage_fingerprint:
        raise ShardError(f"{path} was rewritten for another config while this run was going (stage fingerprint "
                         f"{spec['stage_fingerprint']}, this run's {stage_fingerprint}: a `snakemake -n` or "
                         "`snakeshard status` with another config?); nothing was computed: run snakemake again")


def cmd_run_shard(args) -> int:
    from snakeshard.core.fingerprint import parse_shard_inputs

    spec = read_spec(args.spec)
    check_spec_current(spec, args.spec, args.fingerprint if args.shard_inputs is None
                       else parse_shard_inputs(args.shard_inputs)["stage"])
    # The job's dataset is its slice (the canary's keys are the first of split.0, or for a chained dataset of the
    # upstream canary's, whose slice its spec names): see plan.py
    slice_dir = args.shard_dir if args.shard != CANARY else os.path.join(os.path.dirname(args.spec), "split.0")
    if os.path.isfile(os.path.join(slice_dir, SHARD_ITEMS)) and "shard_items" not in spec["dataset"]:
        spec["dataset"] = {**spec["dataset"], "shard_items": os.path.join(slice_dir, SHARD_ITEMS)}
    if args.shard != CANARY:
        return _run_shard(args, spec)
    return _run_canary(args, spec)


def _run_canary(args, spec: dict) -> int:
    """A stage's canary job (see workflow/rules/canary.smk): the shard path over its few keys."""
    import shutil

    from snakeshard.core.shard import clear_shard_dir
    from snakeshard.core.shard_files import read_shard_keys
    from snakeshard.io.atomic import atomic_write_json

    shard_dir = args.shard_dir
    # The log's first line names the canary's fingerprint: `snakeshard status` reads a failure from the log
    # only when it is the current fingerprint's (the log's path is the stage's, whatever its fingerprint).
    print(canary_log_head(spec["stage"], args.fingerprint), file=sys.stderr, flush=True)
    keys = read_shard_keys(shard_dir)
    # the canary's dataset holds its own keys, as a shard job's holds the shard's: a chained canary's upstream (the
    # upstream canary) wrote only those, and a forward that read the others failed in the canary alone (a trial)
    spec["dataset"] = {**spec["dataset"], "only_keys": keys}
    try:
        if keys:
            _run_shard(args, spec)
        else:  # canary: 0 -- nothing to check, nothing to build
            clear_shard_dir(shard_dir)
            atomic_write_json(os.path.join(shard_dir, "done"), {"shard": CANARY, "items": 0, "canary": "off",
                                                               "fingerprint": args.fingerprint}, fsync=False)
    except SnakeshardError as e:
        if args.feeds:  # a canary over another dataset of the stage, which a chained stage's canary reads
            blocked = (f"over dataset {spec['dataset'].get('name', '?')!r} failed, so stage {args.feeds!r}'s canary, "
                       "which reads its output, was not started")
        else:
            blocked = "failed, so none of its shard jobs was started"
        raise type(e)(f"canary of stage {spec['stage']!r} {blocked}; fix the stage, then rerun: {e}") from e.__cause__
    here = os.path.realpath(shard_dir)
    for old in os.scandir(os.path.dirname(here)):  # canaries (and specs) of earlier stage fingerprints
        if old.is_dir() and old.path != here:
            shutil.rmtree(old.path, ignore_errors=True)
        elif old.name.endswith(CANARY_SPEC) and old.path != here + CANARY_SPEC:
            os.unlink(old.path)
    return 0


def canary_log_head(stage: str, fingerprint: str) -> str:
    """The first line of a canary's log (see _run_canary)."""
    return f"canary of stage {stage!r}, stage fingerprint {fingerprint}"


def _run_shard(args, spec: dict) -> int:
    from snakeshard.core.fingerprint import digest, parse_shard_inputs

    print(started_line(f"shard {args.shard}"), file=sys.stderr, flush=True)
    label = f"shard {args.shard}" + (f" (log: {args.log})" if args.log else "")
    if args.shard_inputs is not None:  # a shard job: its fingerprint is the digest of what it was given
        fingerprint, inputs = digest(args.shard_inputs), parse_shard_inputs(args.shard_inputs)
    else:  # the canary: the stage fingerprint
        fingerprint, inputs = args.fingerprint, None
    with naming_stage(spec["stage"]):
        if inputs is not None:
            read_upstream_shards(spec, {int(args.shard): inputs})
        with _job_env(spec, label) as job:
            _run_one(spec, job, args.shard, args.shard_dir, fingerprint, inputs, args.log)
    return 0


def read_upstream_shards(spec: dict, inputs: dict[int, dict]) -> None:
    """A chained set's shard job (``inputs``: shard -> its fingerprint's parts) reads its keys' upstream output from
    the upstream shards that hold them (the plan's ``upstream_shards``), once each is checked to be the one its
    fingerprint was made from; its dataset is told where they are (``upstream_dirs``)."""
    dataset = spec["dataset"]
    ranges = dataset.get("upstream_shards")
    if ranges is None:  # not a chained set
        return
    from snakeshard.core.merge import require_current_shards

    dirs: list[str] = []
    for shard, parts in inputs.items():
        first, last = ranges[shard]
        for d in require_current_shards(dataset["path"], range(first, last + 1), parts.get("upstream", "")):
            if d not in dirs:
                dirs.append(d)
    spec["dataset"] = {**dataset, "upstream_dirs": dirs}


@contextlib.contextmanager
def _job_env(spec: dict, label: str):
    """What a job builds once, whatever number of shards it runs: (runner class, env, pool or None)."""
    from snakeshard.core.devices import job_devices
    from snakeshard.core.user_code import import_object

    where = f"stages.{spec['stage']}"
    runner_cls = import_runner(spec)
    provider_cls = import_object(spec["provider"], f"{where}.provider")
    devices = job_devices(spec.get("gpus", 0), spec["stage"])  # fail at job start, before loading anything
    if devices != ["cpu"]:
        print(f"{where}: devices {devices} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})",
              file=sys.stderr, flush=True)
    # A pool is started first: its workers spawn and load their models while this process builds its own env.
    pool = _start_pool(spec, devices) if spec.get("pool") else None
    try:
        # the provider is kept for the whole job: it may hold what the env refers to (a model, a buffer)
        provider, env = _build_env(spec, provider_cls, devices, label, parent=pool is not None)
        yield runner_cls, env, pool
    finally:
        if pool is not None:
            pool.close()


def import_runner(spec: dict) -> type:
    """The runner class a stage's jobs call: the configured one, or for an inference stage from a training stage
    (``from_stage``), one whose forward is the trained runner's infer_step (train/inference.py)."""
    from snakeshard.core.user_code import import_object

    runner_cls = import_object(spec["runner"], f"stages.{spec['stage']}.runner")
    if spec.get("model"):
        from snakeshard.train.inference import model_runner

        return model_runner(runner_cls, spec["stage"])
    return runner_cls


def _run_one(spec: dict, job, shard, shard_dir: str, fingerprint, inputs, log) -> dict:
    """One shard over the job's env; its summary line in the log."""
    from snakeshard.core.shard import run_shard_dir

    runner_cls, env, pool = job
    # the stage's batching, else the runner's own (its class attributes), as an in-process runner(keys) has it
    batching = {name: spec.get(name) if spec.get(name) is not None else getattr(runner_cls, name)
                for name in ("batch_size", "batch_seconds", "sort_by_length")}
    done = run_shard_dir(runner_cls, env, shard_dir, shard_id=shard, fingerprint=fingerprint,
                         log_path=log, progress=True, inputs=inputs, **batching, outputs=spec.get("outputs"),
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
    from snakeshard.core.fingerprint import digest, parse_shard_inputs
    from snakeshard.io.atomic import atomic_write_json

    spec = read_spec(args.spec)
    first, last = args.shards
    texts = args.shard_inputs.split(",")
    check_spec_current(spec, args.spec, parse_shard_inputs(texts[0])["stage"])
    if len(texts) != last - first + 1:
        raise ShardError(f"shards {first}-{last}: --shard-inputs gives {len(texts)} shards' inputs, "
                         f"expected {last - first + 1}")
    set_dir = args.set_dir
    wanted = {first + i: digest(text) for i, text in enumerate(texts)}
    todo = [n for n in wanted if _done_fingerprint(os.path.join(set_dir, f"split.{n}")) != wanted[n]]
    print(started_line(f"shards {first}-{last}"), file=sys.stderr)
    print(f"shards {first}-{last}: {len(wanted) - len(todo)} already done with these inputs, "
          f"{len(todo)} to run", file=sys.stderr)
    failed = []
    if todo:
        slices = [os.path.join(set_dir, f"split.{n}", SHARD_ITEMS) for n in todo]
        spec["dataset"] = {**spec["dataset"], "shard_items": slices}
        label = f"shards {first}-{last}" + (f" (log: {args.log})" if args.log else "")
        with naming_stage(spec["stage"]):
            read_upstream_shards(spec, {n: parse_shard_inputs(texts[n - first]) for n in todo})
        with naming_stage(spec["stage"]), _job_env(spec, label) as job:
            for n in todo:
                try:
                    _run_one(spec, job, n, os.path.join(set_dir, f"split.{n}"), wanted[n],
                             parse_shard_inputs(texts[n - first]), args.log)
                except SnakeshardError as e:  # the next shards still run: a rerun then redoes this one only
                    message = in_stage(str(e), spec["stage"])
                    _report(ERROR_PREFIX + message, e.__cause__, None)
                    failed.append(message)
    if failed:
        raise ShardError(f"shards {first}-{last}: {len(failed)} of {len(todo)} failed (the others are done and "
                         f"are not rerun): " + "; ".join(failed))
    atomic_write_json(args.done, {"shards": [first, last], "fingerprints": [wanted[n] for n in wanted]}, fsync=True)
    return 0


def _done_fingerprint(shard_dir: str) -> str | None:
    """The fingerprint a shard's ``done`` records; None without a readable one (the shard is then run)."""
    from snakeshard.core.merge import UnreadableDone, read_done

    try:
        return (read_done(shard_dir) or {}).get("fingerprint")
    except UnreadableDone:
        return None


def _build_env(spec: dict, provider_cls, devices: list[str], shard: str, parent: bool) -> tuple:
    """(provider, env): the job's env, built once (with a pool: the env of this process's hooks; forward
    runs in the workers)."""
    try:
        provider = provider_cls({**spec["provider_config"], "dataset": spec["dataset"], "devices": devices})
        env = provider.build_parent_env() if parent else provider.build_worker_setup_fn()()
        if spec.get("model"):  # an inference stage from a training stage: its trained weights (no pool, see config)
            from snakeshard.train.inference import with_trained_model

            env = with_trained_model(env, spec)
        return provider, env
    except SnakeshardError as e:
        raise ShardError(f"{shard}: building the env failed: {e}") from e.__cause__
    except Exception as e:  # the provider's own code: its traceback goes to the log
        raise ShardError(f"{shard}: the provider {spec['provider']} failed to build the env: "
                         f"{type(e).__name__}: {e}") from e


def _start_pool(spec: dict, job_devices: list[str]):
    """The stage's pool (``workers: N``: N CPU processes; ``devices: all``: one per GPU of the job)."""
    from snakeshard.core.shard_pool import forward_pool

    pooled = spec["pool"]
    devices = job_devices if pooled.get("devices") == "all" else ["cpu"] * int(pooled.get("workers") or 1)
    limits = "".join(f", {name} {pooled[name]:g} s" for name in ("item_timeout", "worker_init_timeout")
                     if pooled.get(name))
    print(f"shard pool: {len(devices)} worker(s) on {', '.join(devices)}, {pooled['order']}{limits}", file=sys.stderr)
    return forward_pool(devices, pooled["order"] == "ordered", spec["runner"], spec["provider"],
                        {**spec["provider_config"], "dataset": spec["dataset"]}, pooled.get("item_timeout"),
                        pooled.get("worker_init_timeout"))


def shard_id(text: str) -> int | str:
    if text == CANARY:
        return text
    return int(text)


def shard_range(text: str) -> tuple[int, int]:
    first, sep, last = text.partition("-")
    if not sep or int(last) < int(first):
        import argparse

        raise argparse.ArgumentTypeError(f"{text!r}: expected FIRST-LAST, e.g. 0-15")
    return int(first), int(last)


# The commands the workflow's rules run once per job, with their options as the rules write them:
# (function, required, optional, exactly one of (when not empty), converters). A job parses these itself
# (parse_job_args): building the argparse parser costs every shard job ~5 ms (gettext, locale, shutil).
# Anything else, a typo or --help included, goes through argparse (cli.build_parser), which holds the
# same options and gives the messages.
JOB_COMMANDS = {
    "run-shard": (cmd_run_shard, {"--spec", "--shard", "--shard-dir"},
                  {"--shard-inputs", "--fingerprint", "--log", "--feeds"},
                  {"--shard-inputs", "--fingerprint"}, {"--shard": shard_id}),
    "run-shards": (cmd_run_shards, {"--spec", "--shards", "--set-dir", "--shard-inputs", "--done"}, {"--log"}, set(),
                   {"--shards": shard_range}),
}


def parse_job_args(argv: list[str]):
    """The arguments of a job command written as the rules write it (only ``--option value`` pairs, each
    known, the required ones there): what argparse would give. None for anything else."""
    from types import SimpleNamespace

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


def run_command(args) -> int:
    """Run a parsed command; a user's error becomes one line (and its traceback, in the log), exit 1."""
    # A job (run-shard, merge) writes its own log, keeping a handle on the stderr it was started
    # with: Snakemake's own output, where its error line is echoed (a full disk can swallow the log).
    if getattr(args, "log", None):  # a job: SIGTERM says so in its log (a training loop sets its own while it runs)
        import signal

        signal.signal(signal.SIGTERM, _raise_terminated)
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
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (which checkpoints on it): one line, no traceback
        _report(f"snakeshard: {args.command}: {INTERRUPTED}{RERUN}", None, console)
        return 128 + 2
    except Terminated:
        _report(f"snakeshard: {args.command}: {stopped_line()}{RERUN}", None, console)
        return 128 + 15
    except OSError as e:  # outside the user's code: a full disk, a read-only or vanished directory
        where = f" ({args.shard_dir})" if getattr(args, "shard_dir", None) else ""
        what = f"shard {args.shard}{where}" if getattr(args, "shard", None) is not None else args.command
        _report(f"{ERROR_PREFIX}{what}: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""), e, console)
        return 1


def stopped_line() -> str:
    """What a job's log says when SIGTERM stopped it, with who may have sent it."""
    import time

    when = time.strftime('%Y-%m-%d %H:%M:%S %z')
    if slurm_job():
        return (f"{STOPPED} at {when} in SLURM job {slurm_job()} (scancel, or its time limit: "
                f"`sacct -j {slurm_job()}` says which)")
    return f"{STOPPED} at {when} (a kill, or the scheduler that started it)"


def _log_to(path: str) -> int | None:
    """Point stdout and stderr at the log file ``path``; return a descriptor of the original stderr.

    None, with a warning on stderr, when the log cannot be opened: output then stays on stderr.
    """
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    except OSError as e:
        print(f"{WARNING_PREFIX}cannot write the log {path} ({e.strerror}): output goes here", file=sys.stderr)
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
