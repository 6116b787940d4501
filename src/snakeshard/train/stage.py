"""A training stage's job: ``python -m snakeshard train --spec <set>/train.json --fingerprint FP --log LOG``.

It reads the train and valid datasets (every planned key, in plan order), checks their ``labels``, builds the
provider's env once, and gives each split's steps its own ``dataset`` (and ``normalize``: the stats' GlobalMVN).
train() runs in the train set's dir (checkpoints/, steps.jsonl); then model.pt, metrics.json and curve.png are
written, each atomically, and ``done`` last. A signal (SIGTERM, SIGUSR1, SIGINT) ends the job with exit status 75 after a
checkpoint: Snakemake's retry, or a rerun, resumes from it. With ``ranks`` > 1 in its loop config the job launches
that many rank processes (ranks.py), each of which does all of the above on its own device; rank 0 alone prints
and writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from snakeshard.core.shard_files import read_spec
from snakeshard.errors import (MAX_LISTED, WARNING_PREFIX, ConfigError, ContractError, DataError, SnakeshardError,
                               naming_stage)
from snakeshard.train.outputs import DONE, MODEL

LOCK = "train.lock"  # held by the one process training in this dir (see one_trainer)
SPLIT_ENV = ("dataset", "normalize")  # env entries the stage gives the steps itself


def cmd_train(args) -> int:
    spec = read_spec(args.spec)
    if spec["fingerprint"] != args.fingerprint:
        raise SnakeshardError(f"{args.spec} was rewritten while this run was going (another snakemake with another "
                              "config or data?); run snakemake again")
    run_dir = Path(args.spec).parent
    ranks = int(spec["loop"].get("ranks") or 1)
    if getattr(args, "rank_worker", False):  # one of the processes the launcher below started: it holds the lock
        from snakeshard.train.ranks import run_rank

        def rank_body(world, device):
            with naming_stage(spec["stage"]), warnings_as_lines():
                return run_training(spec, run_dir, world=world, device=device)
        return run_rank(spec, run_dir, rank_body)
    with naming_stage(spec["stage"]), one_trainer(run_dir), warnings_as_lines():
        keep_attempt_log(getattr(args, "log", None))
        if ranks > 1:
            from snakeshard.train.ranks import launch

            return launch(spec, args, run_dir, ranks)
        return run_training(spec, run_dir)


def keep_attempt_log(log: str | None) -> None:
    """Snakemake deletes a rule's log before each attempt (a retry, a rerun), and a training job's earlier attempts
    say why it needed another (a time limit, a NaN): the job links its log (a hard link, no copy) as
    ``logs/attempts/<n>.log``, n one more than the newest there, so every attempt's lines stay."""
    if not log or not os.path.exists(log):  # no log, or it could not be opened (the output then goes to stderr)
        return
    attempts = Path(log).parent / "attempts"
    attempts.mkdir(exist_ok=True)
    n = 1 + max((int(p.stem) for p in attempts.glob("*.log") if p.stem.isdigit()), default=0)
    with contextlib.suppress(OSError):  # a filesystem without hard links: this attempt's log only
        os.link(log, attempts / f"{n}.log")


@contextlib.contextmanager
def warnings_as_lines():
    """snakeshard's own warnings (a CheckpointWarning: latest.pt unreadable, an older one used) as one line in the
    job's log: Python's format added snakeshard's file, line number and source line (a user trial)."""
    import warnings

    from snakeshard.train.checkpoint import CheckpointWarning

    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, CheckpointWarning):
                print(f"{WARNING_PREFIX}{message}", file=sys.stderr, flush=True)
            else:
                shown(message, category, filename, lineno, file, line)
        warnings.showwarning = show
        yield


@contextlib.contextmanager
def one_trainer(run_dir: Path):
    """Hold ``run_dir/train.lock`` (flock) while training. A driver killed by -9 leaves its jobs running: the
    rerun's training job then waits here for that orphan instead of writing the same checkpoints and steps.jsonl
    beside it, and resumes from (or finishes with) what it left. The kernel drops the lock when its holder dies."""
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LOCK, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            print(f"waiting for the training process that holds {run_dir / LOCK} (pid {holder}; an earlier run's "
                  "job, still going after its snakemake was killed?) to end", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        yield


def run_training(spec: dict, run_dir: Path, *, world=None, device: str | None = None) -> int:
    """Train in this process: the whole job, or rank ``world.rank`` of a multi-rank one on ``device`` (only rank 0
    prints and writes the outputs)."""
    from snakeshard.core.devices import job_devices
    from snakeshard.core.fingerprint import result_inputs
    from snakeshard.core.user_code import import_object
    from snakeshard.train.consent import consented
    from snakeshard.train.loop import ResumeRefused, TrainingInterrupted, train
    from snakeshard.train.numerics import settle_vector_math

    settle_vector_math()  # before the provider's build_env can run torch on several threads
    stage, where = spec["stage"], f"stages.{spec['stage']}"
    first = world is None or world.rank == 0
    runner_cls = import_object(spec["runner"], f"{where}.runner")
    provider_cls = import_object(spec["provider"], f"{where}.provider")
    devices = job_devices(spec.get("gpus", 0), stage) if world is None else [device]
    train_set, train_keys = _split(spec, "train", where)
    valid_set, valid_keys = _split(spec, "valid", where) if spec["valid"] else (None, [])
    split_env = {"train": {"dataset": train_set}, "valid": {"dataset": valid_set}}
    _check_normalize(runner_cls, spec, where)
    env = _build_env(spec, provider_cls, devices, where)
    if spec["stats"]:
        env["normalize"] = global_mvn(spec["stats"])
    batches = _batches(spec, train_set, train_keys)
    valid_batches = _batches(spec, valid_set, valid_keys) if valid_set is not None else None
    if first:
        print(f"training stage {stage!r}: {len(train_keys)} train keys"
              + (f" in {len(batches)} fixed batches" if batches is not None else "")
              + (f", {len(valid_keys)} valid keys" if valid_keys else "")
              + (f", devices {devices}" if world is None else ""), file=sys.stderr, flush=True)
    try:
        result = train(runner_cls, env, train_keys, valid_keys, spec["loop"], run_dir, fingerprint=spec["fingerprint"],
                       batches=batches, valid_batches=valid_batches, split_env=split_env, on_line=_print_epoch,
                       inputs=result_inputs(spec), continues=continued_configs(spec),
                       accepted=consented(run_dir, spec["fingerprint"]))
    except ResumeRefused as e:
        raise ResumeRefused(f"{e}{consent_hint(stage, e.diff)}", e.diff) from None
    except TrainingInterrupted as e:
        if first:
            print(f"training stage {stage!r}: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    if not first:
        return 0
    if result.resumed_from is not None:
        print(f"resumed from {result.resumed_from}", file=sys.stderr)
    from snakeshard.train.outputs import write_outputs

    write_outputs(run_dir, spec, result)
    print(f"training stage {stage!r}: {result.step} steps, {result.epoch} epochs"
          + (f", best {spec['loop']['score']['name']} {result.best_score:.6g} at epoch {result.best_epoch}"
             if result.best_score is not None else "")
          + (" (stopped early)" if result.stopped_early else "") + f"; wrote {run_dir / MODEL}", file=sys.stderr)
    return 0


def continued_configs(spec: dict) -> dict[str, str]:
    """The fingerprints of other configs whose checkpoints this stage's config resumes as its own, with the reason.

    With ``skip_nonfinite: true``: the same config with it off (or unset). Off, the first non-finite loss stops
    the run, so every step such a run checkpointed had finite losses and is what skip_nonfinite: true computes:
    a run stopped by a NaN resumes after the user turns it on, as the stop's hint says, instead of starting over."""
    from snakeshard.core.fingerprint import training_fingerprint
    from snakeshard.version import __version__

    loop = spec["loop"]
    if not loop.get("skip_nonfinite"):
        return {}
    unset = {k: v for k, v in loop.items() if k != "skip_nonfinite"}
    reason = ("skip_nonfinite was off, which stops at the first non-finite loss, so each of its steps is what "
              "skip_nonfinite: true computes")
    return {training_fingerprint({**spec, "loop": off}, __version__): reason
            for off in (unset, {**unset, "skip_nonfinite": False})}


def consent_hint(stage: str, diff: list[str]) -> str:
    """The refusal's last clause when ``snakeshard continue`` can accept what differs (config_diff's lines)."""
    from snakeshard.train.consent import refusal_of_consent

    if refusal_of_consent(diff):
        return ""
    return f"; or, to go on with that run's steps under this config and code: snakeshard continue {stage}"


def _check_normalize(runner_cls, spec: dict, where: str) -> None:
    """A step that takes ``normalize`` in a stage without ``stats:``: the config is what lacks it (the generic
    "needs env key" error would blame the provider, after the model was built)."""
    from snakeshard.core.hooks import forward_parameters, runner_name

    if spec["stats"]:
        return
    for method in ("train_step", "evaluate_step"):
        step = getattr(runner_cls, method, None)
        if step is not None and "normalize" in forward_parameters(step)[2]:
            raise ConfigError(f"{where}.stats: {runner_name(runner_cls)}.{method} takes 'normalize' (the GlobalMVN of "
                              "a collect-stats stage's output, which the stage gives its steps), and the stage sets no "
                              "stats: add stats: {from_stage: <a collect-stats stage>, dataset: <its dataset>}")


def _split(spec: dict, split: str, where: str):
    """(dataset, keys in plan order) of the ``train`` or ``valid`` split; refused when empty or missing labels."""
    from snakeshard.core.data import load_dataset

    dataset = load_dataset(spec[split])
    keys = list(dataset)
    name = spec[split]["name"]
    if not keys:
        raise DataError(f"{where}.{split}: dataset {name!r} holds no keys")
    for field in spec["labels"]:
        upstream = getattr(dataset, "fields", {})  # a chained dataset's merged fields hold every key
        missing = [] if field in upstream else [k for k in keys if dataset[k].get(field) in (None, "")]
        if missing:
            shown = ", ".join(repr(k) for k in missing[:MAX_LISTED])
            raise DataError(f"{where}.labels: {len(missing)} of {len(keys)} keys of dataset {name!r} "
                            f"({_source_path(spec[split])}) have no {field!r}: {shown}"
                            + (" ..." if len(missing) > MAX_LISTED else ""))
    return dataset, keys


def _source_path(dataset_spec: dict) -> str:
    while "source" in dataset_spec:
        dataset_spec = dataset_spec["source"]
    return dataset_spec.get("path", "?")


def _build_env(spec: dict, provider_cls, devices: list[str], where: str) -> dict:
    config = {**spec["provider_config"], "dataset": spec["train"], "valid_dataset": spec["valid"], "devices": devices}
    try:
        env = provider_cls(config).build_worker_setup_fn()()
    except SnakeshardError:
        raise
    except Exception as e:  # the provider's own code: its traceback goes to the log
        raise ConfigError(f"{where}.provider: {spec['provider']} failed to build the env: {type(e).__name__}: {e}") from e
    if not isinstance(env, dict):
        raise ContractError(f"{where}.provider: {spec['provider']} built a {type(env).__name__}, not a dict")
    clash = [name for name in SPLIT_ENV if name in env]
    if clash:
        raise ContractError(f"{where}.provider: the env holds {clash[0]!r}, which a training stage gives its steps "
                            "itself (each split's dataset; normalize from stats:); leave it out of build_env()")
    return env


def global_mvn(stats: dict):
    """The stats stage's GlobalMVN, from its current merged output only (a stale one is refused)."""
    from snakeshard.core.merge import require_current
    from snakeshard.stages.global_mvn import GlobalMVN

    require_current(Path(stats["path"]), stats["inputs"])
    return GlobalMVN(stats["path"])


def _batches(spec: dict, dataset, keys: list[str]) -> list[list[str]] | None:
    """Batches fixed for the whole run when they depend on lengths (batch_seconds, sort_by_length); else None
    (the loop then cuts each epoch's permutation of the keys into batch_size batches)."""
    if not (spec.get("batch_seconds") or spec.get("sort_by_length")):
        return None
    from snakeshard.io.batch import plan_batches

    lengths = [dataset.duration(k) for k in keys]
    return [[keys[i] for i in b] for b in plan_batches(lengths, batch_size=spec.get("batch_size"),
                                                      batch_seconds=spec.get("batch_seconds"),
                                                      sort_by_length=spec.get("sort_by_length", False))]


def _print_epoch(line: dict) -> None:
    """An epoch's line of steps.jsonl, as the log shows it, and a step's skipped batches (``skip_nonfinite``);
    ``replayed``: a line of the run before a resume, printed again after its ``resuming from`` line."""
    for keys in line.get("skipped_nonfinite", ()):
        print(f"step {line['step']} (epoch {line['epoch']}): skipped a batch with a non-finite loss, keys {keys}",
              file=sys.stderr, flush=True)
    if "train" not in line:
        return
    parts = [f"epoch {line['epoch']} (step {line['step']}): train " + _values(line["train"])]
    if "valid" in line:
        parts.append("valid " + _values(line["valid"]))
    if "score" in line:
        parts.append(f"score {line['score']:.6g}")
    print("; ".join(parts) + (" (logged before the resume)" if line.get("replayed") else ""), file=sys.stderr,
          flush=True)


def _values(values: dict) -> str:
    return " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {json.dumps(v)}" for k, v in values.items())


def training_state(training: dict) -> tuple[str, str]:
    """(state, detail) of a training stage for ``snakeshard status``: done, stale, failed, running, interrupted or
    pending, read from its done, log, steps.jsonl, checkpoint names and lock (no checkpoint is loaded)."""
    run_dir = Path(training["dir"])
    try:
        done = json.loads((run_dir / DONE).read_text())
    except (OSError, ValueError):
        done = None
    if done is not None and done.get("fingerprint") == training["fingerprint"]:
        best = f", best score {done['best_score']:.6g} (epoch {done['best_epoch']})" if done.get("best_score") is not None else ""
        # a trial: a run that stopped early read like one that ran its epochs
        early = " (stopped early by score.patience)" if done.get("stopped_early") else ""
        went_on = "".join(f"; went on under a changed config or code at step {step} (snakeshard continue)"
                          for step in done.get("continued_at", ()))
        return "done", f"{done['steps']} steps, {done['epochs']} epochs{early}{best}{went_on}"
    steps_log = run_dir / "steps.jsonl"
    steps = sum(1 for line in steps_log.read_text().splitlines() if '"lr"' in line) if steps_log.exists() else 0
    history = sorted((int(p.stem.partition("-")[2]) for p in (run_dir / "checkpoints/history").glob("step-*.pt")),
                     reverse=True) if (run_dir / "checkpoints/history").is_dir() else []
    where = f"{steps} steps logged" + (f", newest checkpoint at step {history[0]}" if history else "")
    holder = lock_holder(run_dir)
    if holder:
        return "running", f"{where} (pid {holder} holds {run_dir / LOCK})"
    from snakeshard.train.loop import PREVIOUS, REFUSED

    log = run_dir / "logs/train.log"
    errors = [line for line in log.read_text(errors="replace").splitlines()
              if line.startswith("snakeshard: error:")] if log.exists() else []
    # A refused resume is no failure once the config is back to the checkpoint's (a user trial: status still said
    # "failed" with the rm -r of the refusal): what the next run does is said below, from the checkpoint.
    aside = (run_dir / PREVIOUS).is_dir()  # a finished run set aside, which the next run may take back
    if errors and REFUSED not in errors[-1]:
        # and what the next run does with the config and code as they are now (a researcher's trial fixed the bug,
        # and status still showed the failure alone: the next run was refused, another code)
        return "failed", f"{where} (log {log}): {errors[-1]}; the next run {next_run_of(training).sentence}"
    if done is not None:
        after = next_run_of(training) if steps or aside else None
        what = f" ({after.differs})" if after is not None and after.differs else ""
        then = "snakemake trains again"
        if after is not None and after.takes_back:
            then = f"the next run {after.takes_back}"
        return "stale", f"trained with another config or data{what}; {then}" + (f" ({where})" if steps else "")
    if steps:
        return "interrupted", f"{where}; the next run {next_run_of(training).sentence}"
    if aside and (after := next_run_of(training)).takes_back:
        return "pending", f"the next run {after.sentence}"
    return "pending", ""


def next_run_of(training: dict):
    """What the next run does with the training's newest checkpoint under the stage's config now (its spec, which
    status's parse wrote): the training job's own decision (a user trial: status said it resumes while the config
    had changed, and the run was refused)."""
    from snakeshard.core.fingerprint import result_inputs
    from snakeshard.train.consent import consented
    from snakeshard.train.loop import next_run

    spec = read_spec(training["spec"])
    after = next_run(training["dir"], spec["loop"], spec["fingerprint"], result_inputs(spec),
                     {**continued_configs(spec), **consented(training["dir"], spec["fingerprint"])})
    if after.refused_diff is not None:
        after.sentence += consent_hint(spec["stage"], after.refused_diff)
    return after


def continue_training(stage: str, training: dict) -> str:
    """``snakeshard continue STAGE``: when the next run would refuse the newest checkpoint (another config or code),
    record the user's consent to resume it as this config's (train.consent); else say what the next run does."""
    from snakeshard.train.consent import record_consent

    after = next_run_of(training)
    if after.refused_diff is None:
        return f"stage {stage}: nothing to accept: the next run {after.sentence}"
    return record_consent(training["dir"], stage, training["fingerprint"], after)


def lock_holder(run_dir: Path) -> str | None:
    """The pid written in ``run_dir/train.lock`` while a process holds it (see one_trainer), else None."""
    import fcntl

    try:
        with open(run_dir / LOCK) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return lock.read().strip() or "?"
    except FileNotFoundError:
        pass
    return None
