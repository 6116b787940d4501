"""The training loop: deterministic batch order, checkpoints at step boundaries, exact resume.

``train(runner_cls, env, train_keys, valid_keys, config, run_dir, fingerprint=..., restart=...,
batches=..., valid_batches=..., split_env=..., on_line=..., inputs=..., continues=...)``

``batches``: the train batches as lists of keys, fixed for the run (e.g. grouped by length); each epoch then
runs them in an order seeded by (seed, epoch); ``valid_batches`` likewise, run in their order. Without them,
each epoch permutes the keys and cuts them into ``batch_size`` batches. ``split_env``: env entries for one split only (``{"train": {...}, "valid": {...}}``,
e.g. each split's ``dataset``), given to that split's steps on top of ``env``. ``on_line``: called with each
line written to steps.jsonl (a job's log prints the epochs' lines), and on a resume first with the lines before it,
each with ``"replayed": True``. ``inputs``: what ``fingerprint`` digests, in
words (a stage's provider config, datasets, code digests): a refused resume names the entries that differ.
A checkpoint of a run that finished, under another config or fingerprint, is no run to resume: it is set aside in
``previous/`` (taken back when the config returns to it) and training starts over (the stage asked for a new model).

The config (every key optional)::

    seed: 0               # seeds python/numpy/torch once; batch order of epoch e: permutation seeded by (seed, e)
    epochs: 1             # or max_steps: N optimizer steps (then epochs bounds nothing unless also given)
    batch_size: 1         # keys per train_step call (a micro-batch)
    accum_steps: 1        # micro-batches per optimizer step (an epoch's last window may be shorter)
    clip_grad_norm: null  # max gradient norm, clipped before each optimizer step
    skip_nonfinite: false # a non-finite loss skips its micro-batch instead of stopping the run
    schedule: null        # {strategy, warmup_steps, cooldown_steps, final_lr_ratio, ...}: see schedule.py
    score: null           # {name, mode: max|min, patience, split: valid|train}: best.pt and early stopping
                          # (split: whose meters; default valid when there are valid keys)
    checkpoint: {interval: null, every_seconds: 300, keep_latest_k: 3}   # and at each epoch's end
    ranks: null           # the torch.distributed world size this runs in (null: whatever it is; 1 without one)

A step is one optimizer step. A checkpoint (``run_dir/checkpoints/latest.pt``) is written every
``interval`` steps, every ``every_seconds``, at each epoch's end (after evaluation), on SIGTERM/SIGUSR1/SIGINT and at
the end; it holds model, optimizer, scheduler, step/epoch/batch position, RNG states, meter states, best score
and patience count, torch/snakeshard versions, the config and the caller's ``fingerprint``. A rerun resumes
from it when config (less its ``checkpoint`` section, which changes no result) and fingerprint match, and
refuses otherwise naming what differs. Resuming reads no data to skip: the epoch's permutation is recomputed
and the loop starts at the saved batch position. ``run_dir/steps.jsonl`` (one line per step, one per
evaluation) is cut back to the checkpoint's length on resume, so it ends up byte-identical to an
uninterrupted run's.

On N > 1 ranks (torch.distributed initialized; ranks.py starts them): the model is wrapped in DDP for train_step
(evaluate_step gets the module). Each epoch's order of batches is cut to a multiple of N (its last ``len % N``
batches are dropped, other ones each epoch) and rank r takes positions r::N, so every rank runs the same steps;
the ranks' RNGs are seeded with seed + rank. Each step's meters, non-finite skips, signal and ``every_seconds``
flags are gathered from all ranks (one all_gather_object per step), so steps.jsonl holds the ranks' merged meters
and every rank saves at the same step boundaries. Rank r evaluates valid batches r::N, merged the same way. Only
rank 0 writes steps.jsonl and checkpoints; a checkpoint holds every rank's RNG states (a list indexed by rank) and
the world size, and a resume under another world size is refused. Rank 0 decides whether to resume, start over or
refuse; the other ranks follow.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import snakeshard.train.rng as rng
from snakeshard.core.fingerprint import differences
from snakeshard.core.hooks import runner_name
from snakeshard.core.user_source import code_change
from snakeshard.errors import STAGE_KEY, ContractError, SnakeshardError
from snakeshard.train.checkpoint import UNREADABLE, CheckpointManager, CheckpointWarning, read_checkpoint
from snakeshard.train.numerics import settle_vector_math
from snakeshard.train.ranks import RankLost, World, peer_gone
from snakeshard.train.runner import defines, step_kwargs
from snakeshard.train.schedule import make_scheduler

DEFAULTS = {"seed": 0, "epochs": None, "max_steps": None, "batch_size": 1, "accum_steps": 1,
            "clip_grad_norm": None, "skip_nonfinite": False, "schedule": None, "score": None,
            "checkpoint": {"interval": None, "every_seconds": 300, "keep_latest_k": 3}, "ranks": None}
RESULT_NEUTRAL = frozenset({"checkpoint"})  # config sections that change no result: not compared on resume
INTERRUPT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")  # SIGINT: a terminal's Ctrl-C reaches the job too
DIFF_NAMES = {"ranks": "ranks (the world size)"}  # how a refused resume names a key
MAX_KEYS_SHOWN = 64  # a failed step's message lists the batch's keys, up to this many
_RESTORE_RNG = True  # tests switch this off to prove the kill/resume test notices unrestored RNG


class TrainingInterrupted(SnakeshardError):
    """A signal asked the run to stop: a checkpoint was written at the step boundary; exit with ``exit_code``."""

    exit_code = 75  # EX_TEMPFAIL: try again later (a rerun resumes)

    def __init__(self, message: str, *, signal_name: str, step: int, checkpoint: Path):
        super().__init__(message)
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


class ResumeRefused(SnakeshardError):
    """The checkpoint in run_dir was written by a run with another config or other inputs; ``diff``: config_diff's
    lines of what differs (empty when only the fingerprint does)."""

    def __init__(self, message: str, diff: list[str] = ()):
        super().__init__(message)
        self.diff = list(diff)


class NonFiniteLoss(SnakeshardError):
    """train_step returned a NaN or infinite loss (and skip_nonfinite is off)."""


@dataclass
class TrainResult:
    step: int
    epoch: int                 # epochs completed
    stopped_early: bool
    best_score: float | None
    best_epoch: int | None     # the epoch (0-based) whose weights best.pt holds
    checkpoint: Path
    resumed_from: Path | None  # the checkpoint this call started from, None for a fresh start
    continued: list = field(default_factory=list)  # {step, reason} of each resume the user accepted across a change


def with_defaults(config: dict | None) -> dict:
    cfg = {**DEFAULTS, **(config or {})}
    unknown = sorted(set(cfg) - set(DEFAULTS))
    if unknown:
        raise SnakeshardError(f"training config: unknown key {unknown[0]!r}; known keys: {sorted(DEFAULTS)}")
    cfg["checkpoint"] = {**DEFAULTS["checkpoint"], **(cfg["checkpoint"] or {})}
    if cfg["epochs"] is None and cfg["max_steps"] is None:
        cfg["epochs"] = 1
    score = cfg["score"]
    if score is not None:
        if "name" not in score:
            raise SnakeshardError("training config: score needs a 'name' (a meter of evaluate_step)")
        score = cfg["score"] = {"mode": "max", "patience": None, "split": None, **score}
        if score["mode"] not in ("max", "min"):
            raise SnakeshardError(f"training config: score mode {score['mode']!r}: 'max' or 'min'")
        if score["split"] not in (None, "valid", "train"):
            raise SnakeshardError(f"training config: score split {score['split']!r}: 'valid' or 'train'")
    return cfg


def config_diff(old: dict, new: dict) -> list[str]:
    """``key: old -> new`` for each result-changing key that differs (dotted names where both sides are dicts:
    ``schedule.warmup_steps: 0 -> 100``; a dict set where there was none is shown whole)."""
    return [_diff_line(key, a, b)
            for key, a, b in differences({k: v for k, v in old.items() if k not in RESULT_NEUTRAL},
                                         {k: v for k, v in new.items() if k not in RESULT_NEUTRAL})]


def _diff_line(key: str, a, b) -> str:
    """A digest by what it covers, not its values (a researcher's trial: opaque hashes); a value with both sides."""
    if key.startswith("sets."):
        return f"{key} (that set's keys, records, audio or upstream merge)"
    if key.startswith("code."):
        return code_change(key)
    return f"{DIFF_NAMES.get(key, key)}: {_shown(a)} -> {_shown(b)}"


def _shown(value) -> str:
    """A config value as a diff line shows it: a key left out (or null) is "not set", not Python's None."""
    return "not set" if value is None else repr(value)


def batch_order(seed: int, epoch: int, n: int) -> list[int]:
    """Epoch ``epoch``'s order of the ``n`` train keys: a permutation seeded by (seed, epoch) alone."""
    import numpy as np

    return np.random.default_rng([seed, epoch]).permutation(n).tolist()


def _meters_from(state: dict | None):
    from snakeshard.metrics.meters import AverageMeters, _as_value

    meters = AverageMeters()
    for name, s in ((state or {}).get("meters") or {}).items():
        meter = meters[name]
        meter.sum, meter.count = _as_value(s["sum"]), s["count"]
    return meters


def _versions() -> dict:
    import torch

    from snakeshard.version import __version__

    return {"torch": torch.__version__, "snakeshard": __version__}


def _json_value(value):
    from snakeshard.metrics.meters import _as_value

    v = _as_value(value)
    return v.tolist() if hasattr(v, "tolist") else v


def train(runner_cls: type, env: dict, train_keys, valid_keys=(), config: dict | None = None,
          run_dir: str | os.PathLike = ".", *, fingerprint: str = "", restart: bool = False,
          batches: list[list[str]] | None = None, valid_batches: list[list[str]] | None = None,
          split_env: dict | None = None, on_line=None, inputs: dict | None = None,
          continues: dict[str, str] | None = None, accepted: dict[str, str] | None = None) -> TrainResult:
    """Train ``runner_cls``'s steps over ``train_keys`` in ``run_dir`` (checkpoints/, steps.jsonl), resuming from its
    latest checkpoint when that was written under ``fingerprint`` (this config and data), or under one of
    ``continues``' fingerprints: other configs whose steps are this one's, each with the reason (train.stage); or
    under one of ``accepted``'s: configs whose steps the user accepted as this one's though they differ (train.consent),
    each with the reason, which the run's progress then keeps (``TrainResult.continued``)."""
    import torch

    settle_vector_math()  # before the first step (a training job settles it before the provider's build_env too)

    cfg = with_defaults(config)
    world = World.current()
    if cfg["ranks"] is None:
        cfg["ranks"] = world.size
    elif int(cfg["ranks"]) != world.size:
        raise SnakeshardError(f"training config: ranks {cfg['ranks']}, and this process is one of {world.size} "
                              "torch.distributed ranks")
    first = world.rank == 0  # the one that writes steps.jsonl and checkpoints
    run_dir = Path(run_dir)
    ckdir = run_dir / "checkpoints"
    log_path = run_dir / "steps.jsonl"
    if restart and first:
        _start_over(ckdir, log_path)
    run_dir.mkdir(parents=True, exist_ok=True)
    name = runner_name(runner_cls)
    for needed in ("model", "optimizer"):
        if needed not in env:
            raise ContractError(f"training needs env key {needed!r} from the provider; it gave only {sorted(env)}")
    model, optimizer = env["model"], env["optimizer"]
    train_keys, valid_keys = list(train_keys), list(valid_keys or ())
    if not train_keys:
        raise SnakeshardError("training: no train keys")
    bs, accum = int(cfg["batch_size"] or 1), int(cfg["accum_steps"])
    n_batches = len(batches) if batches is not None else math.ceil(len(train_keys) / bs)
    if valid_batches is None:
        valid_batches = [valid_keys[start:start + bs] for start in range(0, len(valid_keys), bs)]
    n_local = _batches_per_rank(n_batches, world.size)
    steps_per_epoch = math.ceil(n_local / accum)
    max_steps = cfg["max_steps"]
    epochs = cfg["epochs"]
    total_steps = max_steps if max_steps is not None else epochs * steps_per_epoch
    scheduler = env.get("scheduler")
    if scheduler is None and cfg["schedule"] is not None:
        scheduler = make_scheduler(optimizer, total_steps, **cfg["schedule"])
    if valid_keys and not defines(runner_cls, "evaluate_step"):  # found out after a whole epoch otherwise
        raise ContractError(f"{name} defines no evaluate_step, and there are valid keys to evaluate after each epoch: "
                            "define @staticmethod evaluate_step(batch, *, model, ...) returning meter values, or "
                            "train without a valid set")
    split_env = split_env or {}
    train_kwargs = step_kwargs(runner_cls, "train_step", {**env, **split_env.get("train", {})})
    eval_kwargs = (step_kwargs(runner_cls, "evaluate_step", {**env, **split_env.get("valid", {})})
                   if valid_keys else None)
    score = cfg["score"]
    manager = CheckpointManager(ckdir, keep_latest_k=cfg["checkpoint"]["keep_latest_k"])

    rng.seed_all(int(cfg["seed"]) + world.rank)  # DanLing's per-rank bias: ranks draw different dropout and noise
    p = {"step": 0, "epoch": 0, "batch_pos": 0, "best_score": None, "best_epoch": None, "bad_epochs": 0,
         "finished": False, "stopped_early": False}
    meters_state, log_bytes, resumed_from = None, 0, None
    accepted = accepted or {}
    loaded = _resume_point(manager, cfg, fingerprint, inputs, run_dir, world, {**(continues or {}), **accepted})
    if loaded is not None:
        ck, resumed_from = loaded
        consented = ck.get("fingerprint") in accepted and ck.get("fingerprint") != fingerprint
        configured = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        _restore(ck, model, optimizer, scheduler, world.rank)
        p.update(ck["progress"])
        if consented:
            _configured_hyperparameters(optimizer, scheduler, configured)
            # the run's record (metrics.json) says from which step on it went on under another config or code
            p["continued"] = [*p.get("continued", []), {"step": p["step"], "reason": accepted[ck["fingerprint"]]}]
        meters_state, log_bytes = ck.get("meters"), ck["log_bytes"]
    ddp = None
    if world.size > 1:
        from torch.nn.parallel import DistributedDataParallel

        device = next(model.parameters()).device
        ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        if "model" in train_kwargs:
            train_kwargs["model"] = ddp  # evaluate_step keeps the module: no collective inside evaluation
    stepped = ddp if ddp is not None else model
    size = log_path.stat().st_size if first and log_path.exists() else 0
    if first and size < log_bytes:
        warnings.warn(f"{log_path} holds {size} bytes, the checkpoint {resumed_from} wrote at {log_bytes}: "
                      "its earlier lines are lost", CheckpointWarning, stacklevel=2)
    with open(log_path, "ab") if first else contextlib.nullcontext() as log:
        if first:
            log.truncate(min(size, log_bytes))
            log.seek(0, os.SEEK_END)
        if first and resumed_from is not None:
            # Said now, not when training ends; and the lines before it again, as the job log is a new file when
            # Snakemake retries a job (a user trial found a resumed run's log starting at its 29th epoch).
            print(f"resuming from {resumed_from}: step {p['step']}, epoch {p['epoch']}", file=sys.stderr, flush=True)
            if on_line is not None:
                with open(log_path, "rb") as before:
                    for text in before:
                        on_line({**json.loads(text), "replayed": True})  # said so (a trial: they read as new)
        meters = _meters_from(meters_state)
        if p["finished"]:
            return _result(p, manager, resumed_from)
        if resumed_from is None and p["step"] == 0:
            _check_evaluation(runner_cls, name, p, score, valid_batches, eval_kwargs, model, world)

        saved_step = None  # the step of the newest checkpoint this call wrote

        def save(best: bool = False) -> None:
            nonlocal saved_step
            states = world.gather(rng.capture())  # a collective: every rank saves at the same step
            if first:
                log.flush()
                os.fsync(log.fileno())
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict() if scheduler is not None else None,
                         "progress": dict(p), "rng": states if world.size > 1 else states[0],
                         "world_size": world.size, "meters": meters.state(),
                         "log_bytes": log.tell(), "config": cfg, "fingerprint": fingerprint, "inputs": inputs,
                         "versions": _versions(),
                         "runner": name}
                manager.save(state, step=p["step"], best=best)
            saved_step = p["step"]

        def write(line: dict) -> None:
            if not first:
                return
            log.write((json.dumps(line) + "\n").encode())
            log.flush()
            if on_line is not None:
                on_line(line)

        with _stop_flag() as stop:
            interval, every = cfg["checkpoint"]["interval"], cfg["checkpoint"]["every_seconds"]
            last_save = time.monotonic()
            while not p["finished"]:
                if (epochs is not None and p["epoch"] >= epochs) or (max_steps is not None and p["step"] >= max_steps):
                    p["finished"] = True
                    break
                order = batch_order(int(cfg["seed"]), p["epoch"], n_batches if batches is not None else len(train_keys))
                stepped.train()
                while p["batch_pos"] < n_local and (max_steps is None or p["step"] < max_steps):
                    window = range(p["batch_pos"], min(p["batch_pos"] + accum, n_local))
                    optimizer.zero_grad(set_to_none=True)
                    step_meters = _meters_from(None)
                    lr = optimizer.param_groups[0]["lr"]
                    skipped = []
                    for j in window:
                        b = j * world.size + world.rank  # the batch's position in the epoch's order
                        keys = (batches[order[b]] if batches is not None
                                else [train_keys[i] for i in order[b * bs:(b + 1) * bs]])
                        # DDP reduces gradients in the window's last backward only
                        with ddp.no_sync() if ddp is not None and j != window[-1] else contextlib.nullcontext():
                            values = _train_batch(runner_cls, name, keys, train_kwargs, p, b, len(window),
                                                  cfg["skip_nonfinite"], model if ddp is not None else None)
                        if values is None:  # a non-finite loss, skipped
                            skipped.append(keys)
                            continue
                        if ddp is None:
                            meters.update(values, n=len(keys))
                        step_meters.update(values, n=len(keys))
                    stopping = stop["signal"]
                    due = every is not None and time.monotonic() - last_save >= every
                    stepping = len(skipped) < len(window)
                    if ddp is not None:  # one collective: the step's meters, skips and save decisions, all ranks'
                        agreed = world.gather({"meters": step_meters.state(), "skipped": skipped, "window": len(window),
                                               "stop": stopping, "due": due})
                        step_meters = _merged([a["meters"] for a in agreed])
                        meters = _merged([meters.state(), step_meters.state()])
                        skipped = [keys for a in agreed for keys in a["skipped"]]
                        stepping = len(skipped) < sum(a["window"] for a in agreed)
                        stopping = next((a["stop"] for a in agreed if a["stop"]), None)
                        due = any(a["due"] for a in agreed)
                    if cfg["clip_grad_norm"] is not None:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip_grad_norm"])
                    if stepping:
                        optimizer.step()
                    if scheduler is not None:
                        scheduler.step()
                    p["step"] += 1
                    p["batch_pos"] = window.stop
                    line = {"step": p["step"], "epoch": p["epoch"], "lr": lr}
                    line.update({k: _json_value(v) for k, v in step_meters.avg.items()})
                    if skipped:
                        line["skipped_nonfinite"] = skipped
                    write(line)
                    if stopping or (interval and p["step"] % interval == 0) or due:
                        save()
                        last_save = time.monotonic()
                    if stopping:
                        world.barrier()  # no rank exits before rank 0's checkpoint is written
                        raise TrainingInterrupted(
                            f"{stopping}: stopped at step {p['step']} (epoch {p['epoch']}, {p['batch_pos']} of its "
                            f"{n_local} batches done), checkpoint {manager.latest}; rerun to resume",
                            signal_name=stopping, step=p["step"], checkpoint=manager.latest)
                if p["batch_pos"] < n_local:  # max_steps reached inside an epoch
                    p["finished"] = True
                    break
                best = _end_epoch(runner_cls, name, p, score, meters, valid_batches, eval_kwargs, stepped, write, world)
                meters = _meters_from(None)
                if (epochs is not None and p["epoch"] >= epochs) or (max_steps is not None and p["step"] >= max_steps):
                    p["finished"] = True  # this save is the last (bench/RESULTS.md 14: one save fewer per run)
                save(best=best)
                last_save = time.monotonic()
                stopping = stop["signal"]
                if ddp is not None:
                    stopping = next((s for s in world.gather(stopping) if s), None)
                if stopping and not p["finished"]:  # a signal during evaluation
                    world.barrier()
                    raise TrainingInterrupted(
                        f"{stopping}: stopped after epoch {p['epoch'] - 1} (step {p['step']}), checkpoint "
                        f"{manager.latest}; rerun to resume", signal_name=stopping, step=p["step"],
                        checkpoint=manager.latest)
            if not (p["finished"] and saved_step == p["step"]):
                save()
    return _result(p, manager, resumed_from)


def _batches_per_rank(n_batches: int, ranks: int) -> int:
    """A rank's batches per epoch: positions rank::ranks of the first (this many) * ranks of the epoch's order."""
    n_local = n_batches // ranks
    if n_local == 0:
        raise SnakeshardError(f"training: {n_batches} train batches per epoch, fewer than the {ranks} ranks; "
                              "use a smaller batch_size or fewer ranks")
    return n_local


def _restore(ck: dict, model, optimizer, scheduler, rank: int) -> None:
    """Model, optimizer, scheduler and this rank's random generators as the checkpoint ``ck`` holds them."""
    model.load_state_dict(ck["model"])
    optimizer.load_state_dict(ck["optimizer"])
    if scheduler is not None and ck.get("scheduler") is not None:
        scheduler.load_state_dict(ck["scheduler"])
    if _RESTORE_RNG:
        states = ck["rng"]  # one per rank of a run on several
        rng.restore(states[rank] if isinstance(states, list) else states)


def _configured_hyperparameters(optimizer, scheduler, configured: list[dict]) -> None:
    """A run going on under a changed config (snakeshard continue) takes its optimizer's hyperparameters (lr, weight
    decay, betas, ...) from the optimizer the provider built now, ``configured`` (its param groups less params),
    not from the checkpoint, which keeps the moments, step counts and the schedule's position (a trial's lower lr
    was silently the old one). A schedule's lr is base times a factor of the step: the base is the new one, the
    factor where the run was."""
    for group, new in zip(optimizer.param_groups, configured):
        old_base, old_lr = group.get("initial_lr"), group["lr"]
        group.update({k: v for k, v in new.items() if k not in ("lr", "initial_lr")})
        if scheduler is None or old_base is None or "initial_lr" not in new:
            group["lr"] = new["lr"]
        else:
            group["initial_lr"] = new["initial_lr"]
            group["lr"] = old_lr * new["initial_lr"] / old_base if old_base else new["lr"]
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]


@contextlib.contextmanager
def _stop_flag():
    """A dict whose ``signal`` names the first of INTERRUPT_SIGNALS received (None until then), the handlers before
    restored on leaving. Only a flag: the loop saves at its next step boundary. A second Ctrl-C stops at once,
    unsaved, as Python does by default. Off the main thread (a caller's own thread) no handler can be set."""
    stop = {"signal": None}
    previous = {}
    if threading.current_thread() is threading.main_thread():
        def on_signal(signum, frame):
            name = signal.Signals(signum).name
            if name == "SIGINT" and stop["signal"] == "SIGINT":
                raise KeyboardInterrupt
            stop["signal"] = name
        for sig_name in INTERRUPT_SIGNALS:
            sig = getattr(signal, sig_name, None)
            if sig is not None:
                previous[sig] = signal.signal(sig, on_signal)
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _resume_point(manager, cfg, fingerprint, inputs, run_dir: Path, world, continues: dict[str, str]):
    """(checkpoint, path) to resume from, or None to start at step 0. Rank 0 decides (and is the one that starts over,
    sets a run aside, takes one back or refuses); the other ranks read the file it chose after it decided."""
    if world.rank != 0:
        chosen = world.broadcast()
        if chosen["refused"]:
            raise RankLost("rank 0 refused to resume or start (its error is in the log)")
        return None if chosen["path"] is None else (read_checkpoint(chosen["path"]), Path(chosen["path"]))
    try:
        loaded = manager.load_latest()
        if loaded is not None:
            ck, path = loaded
            continued = continues.get(ck.get("fingerprint")) or unscored_change(ck, cfg, inputs)
            if continued:  # that fingerprint covers all but the keys the reason names: nothing else to compare
                print(f"{path}: written under another config, resumed as this one's: {continued}", file=sys.stderr,
                      flush=True)
            elif (what := what_differs(ck, cfg, fingerprint, inputs)) is not None:
                loaded = _leave_other_run(ck, path, what, cfg, fingerprint, inputs, run_dir)
        else:
            loaded = _take_back(run_dir, cfg, fingerprint, inputs)
    except SnakeshardError as e:
        world.broadcast({"refused": str(e), "path": None})
        raise
    world.broadcast({"refused": None, "path": None if loaded is None else str(loaded[1])})
    return loaded


def _leave_other_run(ck: dict, path: Path, what: str, cfg: dict, fingerprint: str, inputs: dict | None,
                     run_dir: Path) -> tuple[dict, Path] | None:
    """Checkpoint ``ck`` (at ``path``) is another config's or data's (``what`` differs). A finished run's is set aside
    (see PREVIOUS) and training starts over (None), or goes on with this config's run set aside before, taken back
    (its checkpoint); an unfinished run's is refused, naming what differs and the rm -r that starts over."""
    if ck["progress"]["finished"]:
        print(f"{path}: a finished run of another config or data ({what}); it is set aside in {run_dir / PREVIOUS}",
              file=sys.stderr, flush=True)
        return _set_aside(run_dir, cfg, fingerprint, inputs)
    raise ResumeRefused(f"{path} {REFUSED}: {what}. " + _refusal_fix(run_dir, cfg, fingerprint, inputs),
                        checkpoint_diff(ck, cfg, inputs))


# A training run's dir holds one run of another config or data besides its own: the last finished one that a config
# change replaced (its checkpoints/ less history, and steps.jsonl), so that going back to that config (a reverted
# edit, a bug fixed) takes it back instead of training it again (a user trial retrained after each). 2 checkpoints'
# room on disk (latest.pt, best.pt); `rm -r <run dir>/previous` frees it.
PREVIOUS = "previous"


def _set_aside(run_dir: Path, cfg: dict, fingerprint: str, inputs: dict | None) -> tuple[dict, Path] | None:
    """Move the finished run in ``run_dir`` (checkpoints/, steps.jsonl) to ``previous/``, taking back the run there
    first when it is this config's (returned, as _take_back does), else replacing it. A kill in between leaves
    ``previous.new/`` (removed at the next set-aside) and no checkpoints/: a fresh start."""
    staged, aside = run_dir / (PREVIOUS + ".new"), run_dir / PREVIOUS
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir()
    for name in ("steps.jsonl", "checkpoints"):
        if (run_dir / name).exists():
            os.replace(run_dir / name, staged / name)
    shutil.rmtree(staged / "checkpoints" / "history", ignore_errors=True)  # latest.pt and best.pt restore it
    back = _take_back(run_dir, cfg, fingerprint, inputs)
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(staged, aside)
    return back


def _previous_run(run_dir: Path, cfg: dict, fingerprint: str, inputs: dict | None) -> tuple[dict, Path] | None:
    """The finished run set aside in ``run_dir/previous`` when it is this config's and data's, else None."""
    manager = CheckpointManager(run_dir / PREVIOUS / "checkpoints")
    if not manager.latest.exists():
        return None
    try:
        ck = read_checkpoint(manager.latest)
    except UNREADABLE:
        return None
    if not ck["progress"]["finished"] or what_differs(ck, cfg, fingerprint, inputs) is not None:
        return None
    return ck, manager.latest


def _take_back(run_dir: Path, cfg: dict, fingerprint: str, inputs: dict | None) -> tuple[dict, Path] | None:
    """When ``previous/`` holds this config's finished run (and checkpoints/ none: it was set aside or never there),
    move it back into place, and return its checkpoint as the one to resume (finished: nothing is trained)."""
    found = _previous_run(run_dir, cfg, fingerprint, inputs)
    if found is None:
        return None
    aside = run_dir / PREVIOUS
    for name in ("steps.jsonl", "checkpoints"):
        if (aside / name).exists():
            os.replace(aside / name, run_dir / name)
    shutil.rmtree(aside, ignore_errors=True)
    print(f"{run_dir / 'checkpoints'}: this config's finished run, set aside when the config changed, taken back "
          "from " + str(aside), file=sys.stderr, flush=True)
    return found[0], run_dir / "checkpoints" / "latest.pt"  # read once, where it was


def checkpoint_diff(ck: dict, cfg: dict, inputs: dict | None) -> list[str]:
    """config_diff's lines between checkpoint ``ck``'s config and inputs and these."""
    # keys a checkpoint from before they existed lacks: what they meant then
    old = {"ranks": ck.get("world_size", 1), **ck.get("config", {})}
    return config_diff(old, cfg) + config_diff(ck.get("inputs") or {}, inputs or {})


def what_differs(ck: dict, cfg: dict, fingerprint: str, inputs: dict | None) -> str | None:
    """None when checkpoint ``ck`` was written under this config and data, else what differs, key by key."""
    diff = checkpoint_diff(ck, cfg, inputs)
    if not diff and ck.get("fingerprint") == fingerprint:
        return None
    return (f"{_what_kinds(diff)} ({'; '.join(diff)})" if diff else
            f"the inputs differ (fingerprint {ck.get('fingerprint')!r} in the checkpoint, {fingerprint!r} now)")


def _what_kinds(diff: list[str]) -> str:
    """What config_diff's lines are about, in words: "the config differs", "the code differs", "the config and
    data differ" (a researcher's trial: a code change was said to be the config's)."""
    kinds = [kind for kind, found in (("config", any(not d.startswith(("code.", "sets.")) for d in diff)),
                                      ("code", any(d.startswith("code.") for d in diff)),
                                      ("data", any(d.startswith("sets.") for d in diff))) if found]
    return f"the {' and '.join(kinds)} differ{'s' if len(kinds) == 1 else ''}"


def unscored_change(ck: dict, cfg: dict, inputs: dict | None) -> str | None:
    """Why checkpoint ``ck`` resumes under ``cfg`` though its ``score`` config differs, or None. The score is taken
    at an epoch's end only (it picks best.pt and stops early); a run stopped before its first epoch ended (a
    misspelt score.name fails there, a user trial) took none, so each of its steps is this config's too. Data, code,
    every other key and snakeshard's version must be the checkpoint's."""
    old = {"ranks": ck.get("world_size", 1), **ck.get("config", {})}
    if (ck["progress"]["epoch"] != 0 or ck["progress"]["finished"] or old.get("score") == cfg["score"]
            or config_diff({**old, "score": None}, {**cfg, "score": None})
            or config_diff(ck.get("inputs") or {}, inputs or {})
            or (ck.get("versions") or {}).get("snakeshard") != _versions()["snakeshard"]):
        return None
    changed = "; ".join(config_diff({"score": old.get("score")}, {"score": cfg["score"]}))
    return f"only its score differs ({changed}), and no epoch had ended, so no score had been taken"


def _refusal_fix(run_dir: Path, cfg: dict, fingerprint: str, inputs: dict | None) -> str:
    ckdir, log_path = run_dir / "checkpoints", run_dir / "steps.jsonl"
    if _previous_run(run_dir, cfg, fingerprint, inputs):
        start = (f"A finished run of this config is set aside in {run_dir / PREVIOUS}: to take it back (training "
                 "nothing), delete that run's checkpoints")
    else:
        start = "To train with this config from step 0 (that run's steps are then lost), delete its checkpoints"
    return (f"{start}: rm -r {shlex.quote(str(ckdir))} {shlex.quote(str(log_path))}; to resume that run instead, go "
            "back to its config, code and data")


REFUSED = "was written by an unfinished run of another config or data"  # in the refusal, which status looks for


@dataclass
class NextRun:
    """What the next run of a training does with the newest checkpoint in its dir (``next_run``): ``sentence``, the
    decision (resume, start, start over, refuse) as status words it after "the next run "; ``differs``, what differs
    between the checkpoint's config and data and the current ones (None: nothing); ``takes_back``, the part of the
    sentence that says the run set aside in previous/ is taken back (None: it is not)."""

    sentence: str
    differs: str | None = None
    takes_back: str | None = None
    refused_diff: list[str] | None = None  # when refused: config_diff's lines of what differs
    refused_checkpoint: dict | None = None  # when refused: the checkpoint's fingerprint and step (train.consent)


def next_run(run_dir: str | os.PathLike, config: dict, fingerprint: str, inputs: dict | None,
             continues: dict[str, str]) -> NextRun:
    """For ``snakeshard status``: the decision ``train`` makes on ``run_dir``'s newest checkpoint (resume, start
    over, refuse), without its effects. Loads the checkpoint (torch: a second or two), so status asks only for an
    interrupted or stale stage."""
    cfg = with_defaults(config)
    if cfg["ranks"] is None:  # as train() sets it in a job of one process
        cfg["ranks"] = 1
    run_dir = Path(run_dir)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointWarning)  # an unreadable latest.pt: the next newest is named
            loaded = CheckpointManager(run_dir / "checkpoints").read_newest()
    except SnakeshardError as e:
        return NextRun(f"fails: {e}")
    def take_back() -> str | None:  # asked only where the job would take a run back: it loads a checkpoint
        aside = _previous_run(run_dir, cfg, fingerprint, inputs)
        return (f"takes back this config's finished run set aside in {run_dir / PREVIOUS} (step "
                f"{aside[0]['progress']['step']}), training nothing") if aside else None

    if loaded is None:
        back = take_back()
        return NextRun(back or "starts at step 0 (no checkpoint)", takes_back=back)
    ck, path = loaded
    continued = ck.get("fingerprint") in continues or unscored_change(ck, cfg, inputs)
    what = None if continued else what_differs(ck, cfg, fingerprint, inputs)
    if what is None:
        return NextRun(f"resumes from {path} (step {ck['progress']['step']})")
    if ck["progress"]["finished"]:
        back = take_back()
        return NextRun(f"{back or 'starts over'}: {path} is a finished run's of another config or data ({what}), "
                       f"set aside in {run_dir / PREVIOUS}", what, back)
    return NextRun(f"is refused: {path} {REFUSED}: {what}. " + _refusal_fix(run_dir, cfg, fingerprint, inputs), what,
                   refused_diff=checkpoint_diff(ck, cfg, inputs),
                   refused_checkpoint={"fingerprint": ck.get("fingerprint"), "step": ck["progress"]["step"],
                                       "path": str(path)})


def _merged(states: list[dict]):
    """The ranks' meter states as one AverageMeters (sums and counts added; the same on every rank)."""
    from snakeshard.metrics.meters import AverageMeters

    return AverageMeters.merge(states)


def _zero_backward(model) -> None:
    """A backward that adds zero to every gradient: a rank that skips a non-finite batch still joins DDP's gradient
    reduction (the skipped batch counts in the average as zero, as it does in a 1-rank window)."""
    params = [p for p in model.parameters() if p.requires_grad]
    sum((p * 0).sum() for p in params).backward()


def _start_over(ckdir: Path, log_path: Path) -> None:
    """Remove a run's checkpoints and its steps.jsonl: the next step is the first."""
    shutil.rmtree(ckdir, ignore_errors=True)
    log_path.unlink(missing_ok=True)


def _train_batch(runner_cls, name: str, keys: list, train_kwargs: dict, p: dict, b: int, window: int,
                 skip_nonfinite: bool, ddp_module) -> dict | None:
    """train_step on one batch, then the backward of its loss over the ``window`` batches of the step: the step's
    values for the meters (detached), or None when the loss is not finite and ``skip_nonfinite`` says skip it.
    ``ddp_module``: the model under DDP, whose skipped batch still takes part in the gradients' all-reduce."""
    import torch

    with _step_context(name, "train_step", p, b, keys):
        out = runner_cls.train_step(keys, **train_kwargs)
    if not isinstance(out, dict) or "loss" not in out:
        raise ContractError(f"{name}.train_step returned {sorted(out) if isinstance(out, dict) else type(out).__name__}"
                            ": it must return a dict with 'loss' (a tensor)")
    loss = out["loss"]
    if not torch.isfinite(loss.detach()).all():
        if skip_nonfinite:
            if ddp_module is not None:  # the other ranks' backward waits for this one's gradients
                _zero_backward(ddp_module)
            return None
        raise NonFiniteLoss(f"{name}.train_step: loss {loss.detach().tolist()} at step {p['step'] + 1} (epoch "
                            f"{p['epoch']}, batch {b}) on keys {keys}; set skip_nonfinite: true to skip such batches "
                            "(a training stage's rerun resumes from this run's newest checkpoint, or starts at step 0 "
                            "without one)")
    with _step_context(name, "backward of train_step's loss", p, b, keys):
        (loss / window).backward()
    return {k: (v.detach() if hasattr(v, "detach") else v) for k, v in out.items()}


def _end_epoch(runner_cls, name, p, score, meters, valid_batches, eval_kwargs, model, write, world) -> bool:
    """Evaluate, log the epoch, update best score and patience, move to the next epoch; True if it is the best.
    On several ranks, rank r evaluates valid batches r::size and their meters are merged."""
    import torch

    valid = None
    if valid_batches:
        valid = _meters_from(None)
        model.eval()
        # rank 0's buffers (batch-norm statistics: what its checkpoint holds) on every rank
        world.broadcast_tensors(list(model.buffers()))
        with torch.no_grad():
            for b in range(world.rank, len(valid_batches), world.size):
                valid.update(_evaluate(runner_cls, name, p, b, valid_batches[b], eval_kwargs),
                             n=len(valid_batches[b]))
        if world.size > 1:
            valid = _merged(world.gather(valid.state()))
        model.train()
    # values, and the meters' states (sums and counts): what AverageMeters.merge combines exactly (ranks, epochs)
    line = {"epoch": p["epoch"], "step": p["step"], "train": {k: _json_value(v) for k, v in meters.avg.items()},
            "train_state": meters.state()}
    if valid is not None:
        line["valid"] = {k: _json_value(v) for k, v in valid.avg.items()}
        line["valid_state"] = valid.state()
    best = False
    if score is not None:
        split = score["split"] or ("valid" if valid is not None else "train")
        if split == "valid" and valid is None:
            raise SnakeshardError(f"{STAGE_KEY}score.split: 'valid' needs valid keys; there are none")
        source = valid if split == "valid" else meters
        _check_score_name(score, name, split, source)
        value = float(source[score["name"]].avg)
        old = p["best_score"]
        if old is None or (value > old if score["mode"] == "max" else value < old):
            p["best_score"], p["best_epoch"], p["bad_epochs"], best = value, p["epoch"], 0, True
        else:
            p["bad_epochs"] += 1
        line["score"] = value
        if score["patience"] is not None and p["bad_epochs"] >= score["patience"]:
            p["stopped_early"] = p["finished"] = True
    write(line)
    p["epoch"] += 1
    p["batch_pos"] = 0
    return best


def _check_evaluation(runner_cls, name, p, score, valid_batches, eval_kwargs, model, world) -> None:
    """evaluate_step on this rank's first valid batch before the first step, the RNG states put back after it (a
    model in eval mode under no_grad changes nothing else): a bug in it, or a ``score.name`` it gives no meter of,
    fails the run before any training, not after a whole epoch (a researcher's trial lost its first epoch so, and
    the fixed code could not resume it: another code)."""
    import torch

    if not valid_batches or world.rank >= len(valid_batches):
        return
    states = rng.capture()
    model.eval()
    try:
        with torch.no_grad():
            out = _evaluate(runner_cls, name, p, world.rank, valid_batches[world.rank], eval_kwargs)
    finally:
        model.train()
        rng.restore(states)
    if score is not None and (score["split"] or "valid") == "valid":
        _check_score_name(score, name, "valid", out)


def _evaluate(runner_cls, name: str, p: dict, b: int, keys: list, eval_kwargs: dict) -> dict:
    """The meter values of evaluate_step over valid batch ``b``."""
    with _step_context(name, "evaluate_step", p, b, keys):
        out = runner_cls.evaluate_step(keys, **eval_kwargs)
    if not isinstance(out, dict):
        raise ContractError(f"{name}.evaluate_step returned a {type(out).__name__}; a dict of meter values")
    return out


def _check_score_name(score: dict, name: str, split: str, meters) -> None:
    if score["name"] not in meters:
        raise ContractError(f"{STAGE_KEY}score.name {score['name']!r} is no meter of {name}."
                            f"{'evaluate_step' if split == 'valid' else 'train_step'}: it gave {sorted(meters)}")


class StepFailed(SnakeshardError):
    """A step method of the user's runner raised: named with step, epoch, batch and keys."""


@contextlib.contextmanager
def _step_context(name: str, method: str, p: dict, batch: int, keys: list) -> None:
    """An exception of the user's step, raised again naming where it happened (the last checkpoint is kept:
    nothing computed before it is lost). Its traceback stays the cause, so the job's log shows it."""
    try:
        yield
    except SnakeshardError:
        raise
    except Exception as e:
        if peer_gone(e):  # DDP's gradient all-reduce in backward (or a synced layer's) lost another rank
            first = str(e).splitlines()[0].split(". ")[0][:200]
            raise RankLost(f"{method} at step {p['step'] + 1} (epoch {p['epoch']}, batch {batch}): a collective "
                           f"failed ({first}): another rank is gone; the log has its own error") from e
        # every key of the batch (a user trial's bad label was among "3 more"), up to a batch no one reads whole
        more = len(keys) - MAX_KEYS_SHOWN
        shown = keys[:MAX_KEYS_SHOWN] + ([f"... {more} more"] if more > 0 else [])
        # evaluation runs between steps: "after step 38", not the step that has not run yet
        when = f"after step {p['step']}" if method == "evaluate_step" else f"at step {p['step'] + 1}"
        if method == "evaluate_step" and p["step"] == 0:
            when = "before step 1 (one valid batch is evaluated before training, so that a bug there costs no epoch)"
        which = "valid batch" if method == "evaluate_step" else "batch"
        raise StepFailed(f"{name}.{method} failed {when} (epoch {p['epoch']}, {which} {batch}) on "
                         f"keys {shown}: {type(e).__name__}: {e}") from e


def _result(p: dict, manager: CheckpointManager, resumed_from) -> TrainResult:
    return TrainResult(step=p["step"], epoch=p["epoch"], stopped_early=p["stopped_early"],
                       best_score=p["best_score"], best_epoch=p["best_epoch"], checkpoint=manager.latest,
                       resumed_from=resumed_from, continued=p.get("continued", []))
