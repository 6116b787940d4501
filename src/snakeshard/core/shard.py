"""One shard's work: build nothing, just run the runner over keys and write ``done`` last.

The same function serves a Snakemake shard job (``snakeshard run-shard``) and the
in-process call ``MyRunner(provider, output_dir=...)(keys)``.

Crash safety: an attempt holds ``.attempt`` (flock) from start to end, so a retry waits for an orphaned
attempt (a driver killed with -9 leaves its jobs running) instead of emptying the dir under it; the shard dir
is then emptied (all but what the parse wrote there), so nothing from a killed attempt survives into
this one, and the set's merged output goes first when that removes files it may point into;
``done`` is written last, by rename, and only if this attempt still owns the directory.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time

from snakeshard.core.fingerprint import digest_bytes
from snakeshard.core.fingerprint import keys_digest as digest_keys
from snakeshard.core.hooks import check_hook_env, injected_kwargs, overrides, runner_name
from snakeshard.core.progress import ProgressLog
from snakeshard.core.shard_files import KEYS_FILE, SHARD_FINGERPRINT, SHARD_ITEMS, read_keys_file
from snakeshard.errors import MAX_LISTED, AudioError, ContractError, ShardError, SnakeshardError
from snakeshard.io.atomic import atomic_write_json
from snakeshard.io.writers import FieldWriters
from snakeshard.version import __version__

ATTEMPT_FILE = ".attempt"
# Written at parse: the plan reuses itself only if keys and items.json are there; the fingerprint is a rule input.
KEEP_ON_CLEAR = {KEYS_FILE, SHARD_ITEMS, SHARD_FINGERPRINT}


@contextlib.contextmanager
def claimed_shard_dir(shard_dir: str):
    """Hold ``shard_dir/.attempt`` (flock) for this attempt, empty the dir (``clear_shard_dir``) and write this
    attempt's token into it; yields the token. An orphaned attempt of the same shard (its snakemake killed with -9)
    writes its files by path: a retry that emptied the dir under it would end with the orphan's ark in place of its
    own, so the retry waits here for it to end (the kernel drops the lock when its holder dies)."""
    import fcntl

    os.makedirs(shard_dir, exist_ok=True)
    with open(os.path.join(shard_dir, ATTEMPT_FILE), "a+") as attempt:
        try:
            fcntl.flock(attempt, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            attempt.seek(0)
            holder = attempt.read().partition(":")[0] or "?"
            print(f"waiting for an earlier attempt of this shard (pid {holder}; its snakemake killed?), still running "
                  f"in {shard_dir}, to end", file=sys.stderr, flush=True)
            fcntl.flock(attempt, fcntl.LOCK_EX)
        clear_shard_dir(shard_dir)
        token = f"{os.getpid()}:{os.urandom(16).hex()}"  # not uuid: its import (platform, socket) costs every job ~3 ms
        attempt.truncate(0)
        attempt.write(token)
        attempt.flush()
        yield token


def clear_shard_dir(shard_dir: str) -> None:
    """Remove every entry but what the parse wrote (``KEEP_ON_CLEAR``) and the ``.attempt`` lock. When an earlier
    attempt's files are there, the set's merged output goes first (``withdraw_merged``): merged scp files point
    into shard arks, and no merged file may outlive what it points at (a killed forced rerun of one shard left a
    current-looking merge whose scp pointed at a deleted ark; a failed rerun, merged scp files that read new
    values and a partial ark: user trials, 2026-11-27)."""
    os.makedirs(shard_dir, exist_ok=True)
    leftovers = [entry for entry in os.scandir(shard_dir) if entry.name not in KEEP_ON_CLEAR | {ATTEMPT_FILE}]
    if leftovers and os.path.basename(os.path.abspath(shard_dir)).startswith("split."):  # a set's shard
        from snakeshard.core.merged_files import withdraw_merged  # only on a rerun: its imports cost every job

        withdraw_merged(os.path.dirname(os.path.abspath(shard_dir)))
    for entry in leftovers:
        if entry.is_dir(follow_symlinks=False):
            import shutil  # only after a failed attempt: its imports cost every job ~2 ms

            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


# With the default writers, items are processed in slices so per-item bookkeeping (progress,
# validation, writes) is paid per slice. Slices grow while they finish fast and shrink when items
# are slow, so the progress line of a slow model (seconds per item) still moves item by item.
# Runners with their own write_record/reduce_state keep slices of one item (or one batch).
MAX_SLICE = 4096
FAST_SLICE_S, SLOW_SLICE_S = 0.05, 0.5


def _lengths(runner_cls, env, keys, where, purpose="") -> list[float]:
    """Each key's ``item_length`` (audio seconds by default); an error names the key."""
    lengths = []
    for key in keys:
        try:
            lengths.append(float(runner_cls.item_length(key, **env)))
        except SnakeshardError as e:
            raise ShardError(f"{where}: item {key!r}: its length{' ' + purpose if purpose else ''}: {e}") from None
        except Exception as e:  # a runner's own item_length: its traceback goes to the log
            raise ShardError(f"{where}: item {key!r}: its length{' ' + purpose if purpose else ''}: "
                             f"{type(e).__name__}: {e}") from e
    return lengths


def _index_fragments(runner_cls, writers, returned, shard_dir: str) -> list[str]:
    """The per-key index files the merge concatenates: what ``close_writers`` returned, plus those of the
    default writers it left out. ESPnet3's ``close_writers`` returns nothing; taken at its word, the merge
    merged nothing and said it was done. Other writers' hooks that return None while the shard dir holds
    files are an error naming them (``[]`` says that none of them is per-key)."""
    hook = f"{runner_name(runner_cls)}.close_writers"
    if returned is not None and not (isinstance(returned, (list, tuple)) and all(isinstance(n, str) for n in returned)):
        raise ContractError(f"{hook} returned {returned!r}: it returns the list of file names (in the shard dir) "
                            "of the per-key index files the merge concatenates")
    fragments = list(returned or [])
    if isinstance(writers, FieldWriters):
        fragments += [name for name in writers.close() if name not in fragments]  # closes them if the hook did not
    elif returned is None:
        written = sorted(e.name for e in os.scandir(shard_dir) if e.name not in KEEP_ON_CLEAR and e.name != ATTEMPT_FILE)
        if written:
            raise ContractError(f"{hook} returned None, but its writers wrote {written[:MAX_LISTED]} into {shard_dir}: "
                                "return the names of the per-key index files the merge concatenates ('key value' "
                                "text, 'key path' scp, JSON Lines), or [] if none of these files is one")
    missing = [name for name in fragments if not os.path.isfile(os.path.join(shard_dir, name))]
    if missing:
        raise ContractError(f"{hook} returned {missing[:MAX_LISTED]}, which {shard_dir} does not hold")
    return fragments


def _durable_state_files(shard_dir: str, names: list[str]) -> dict:
    """Per file ``finalize_state`` wrote: its size and CRC-32, for the merge to check (as it checks field
    indexes). Each is fsynced, so a done that survives a power loss never points at a lost state file."""
    import zlib

    taken = sorted(set(names) & (KEEP_ON_CLEAR | {"done"}))
    if taken:
        for name in taken:  # overwritten: removed, so the next parse writes the plan's files again
            os.unlink(os.path.join(shard_dir, name))
        raise ContractError(f"finalize_state wrote {taken[0]!r}, a name the plan and the shard job use in the shard "
                            "dir; name the state file otherwise")
    record = {}
    for name in names:
        with open(os.path.join(shard_dir, name), "rb") as f:
            data = f.read()
            os.fsync(f.fileno())
        record[name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    return record


def _plan_batches(runner_cls, env, keys, batch_size, batch_seconds, sort_by_length, where, say: bool):
    """The shard's batches (index lists, see batch.plan_batches), or None without batching. ``say``: print how much
    of the batched length is padding, the figure that says whether sorting pays (in a job's log; in-process only
    with progress on: a notebook's every runner(keys) printed it, a user trial)."""
    if not (batch_size or batch_seconds):
        return None
    from snakeshard.io.batch import padding_ratio, plan_batches

    if batch_seconds or sort_by_length:
        lengths = _lengths(runner_cls, env, keys, where, "for batching")
    else:
        lengths = [1.0] * len(keys)
    batches = plan_batches(lengths, batch_size=batch_size, batch_seconds=batch_seconds,
                           sort_by_length=sort_by_length)
    how = ", ".join(f"{k} {v}" for k, v in (("batch_size", batch_size), ("batch_seconds", batch_seconds)) if v)
    # lengths are known (and padding can be told) only when batching by seconds or sorting
    padding = (f"; padding {100 * padding_ratio(lengths, batches):.1f}% of the batched length"
               if batch_seconds or sort_by_length else "")
    if say:
        print(f"{where}: {len(keys)} items in {len(batches)} batches ({how}"
              f"{', sorted by length' if sort_by_length else ''}){padding}", file=sys.stderr)
    return batches


def _hook_dir(runner_cls, shard_dir: str):
    """The shard dir as the hooks a runner overrides receive it, a ``pathlib.Path``; the default hooks take the
    str: pathlib costs a one-key job 5 ms of its 29 ms CPU (bench/RESULTS.md section 16)."""
    if overrides(runner_cls, "open_writers") or overrides(runner_cls, "finalize_state"):
        from pathlib import Path

        return Path(shard_dir)
    return shard_dir


def run_shard_dir(runner_cls, env: dict, shard_dir, **options):
    """The shard job's path: run over ``shard_dir/keys``, digesting the file's bytes as read.

    Hashing the bytes once costs less than re-joining 100k keys to hash them after the run.
    """
    keys, raw = read_keys_file(shard_dir)
    return run_shard(runner_cls, env, keys, shard_dir, keys_digest=digest_bytes(raw), **options)


def run_shard(runner_cls, env: dict, keys: list[str], shard_dir, **options):
    """Run ``runner_cls`` over ``keys``; write fragments and ``done`` into ``shard_dir``.

    With ``shard_dir=None`` nothing is written and the list of results is returned (in plan order).
    Otherwise returns the ``done`` record. ``inputs`` (what ``fingerprint`` was made of) is
    recorded in ``done`` so status can say what changed. ``allow_nonfinite`` names result fields the
    default writers accept NaN/inf in, ``outputs`` their format overrides (see writers.py).
    With ``batch_size`` or ``batch_seconds``, forward gets lists of keys (see batch.plan_batches).
    ``report_seconds``: count progress in audio seconds too (``item_length``), as for stages sharded by seconds.
    ``pool``: a started ``shard_pool.forward_pool``: forward runs in its workers, one key or planned batch at a
    time; results come back here to be written and reduced as without it.
    """
    kwargs = injected_kwargs(runner_cls, env)  # before the dir is emptied: a runner that cannot run loses nothing
    check_hook_env(runner_cls, env)
    if shard_dir is None:
        return _run_shard(runner_cls, env, kwargs, keys, None, None, **options)
    shard_dir = os.fspath(shard_dir)
    with claimed_shard_dir(shard_dir) as token:  # held until done is written (or the attempt fails)
        return _run_shard(runner_cls, env, kwargs, keys, shard_dir, token, **options)


def _run_shard(runner_cls, env: dict, kwargs: dict, keys: list[str], shard_dir: str | None, token: str | None, *,
               shard_id: int = 0, fingerprint: str | None = None, log_path: str | None = None,
               batch_size: int | None = None, batch_seconds: float | None = None, sort_by_length: bool = False,
               progress: bool = True, keys_digest: str | None = None, inputs: dict | None = None,
               allow_nonfinite=(), outputs: dict | None = None, report_seconds: bool = False, pool=None):
    """run_shard's work, in a claimed ``shard_dir`` (``token``: this attempt's), or collecting (both None)."""
    where = f"shard {shard_id}" + (f" (log: {log_path})" if log_path else "")
    call = functools.partial(runner_cls.forward, **kwargs)
    collect = shard_dir is None
    started = time.time()
    if not collect:
        hook_dir = _hook_dir(runner_cls, shard_dir)

    state = runner_cls.init_state(**env)
    writers = None if collect else runner_cls.open_writers(hook_dir, **env)
    batches = _plan_batches(runner_cls, env, keys, batch_size, batch_seconds, sort_by_length, where,
                            say=progress or log_path is not None)
    if isinstance(writers, FieldWriters):
        writers.allow_nonfinite = frozenset(allow_nonfinite)
        writers.outputs = {**writers.outputs, **(outputs or {})}  # a runner's open_writers may preset formats
        writers.order = keys  # checked at close: every field holds every key, indexed in plan order
    reduce_state = runner_cls.reduce_state if overrides(runner_cls, "reduce_state") else None
    custom_write = overrides(runner_cls, "write_record")
    # The bulk path: default writers, nothing else to call per item.
    write_many = getattr(writers, "write_many", None) if not (custom_write or reduce_state) else None
    results = [] if collect else None

    def handle(result, key):
        nonlocal state
        if not isinstance(result, dict):
            raise ShardError(f"{where}: item {key!r}: forward returned {type(result).__name__}, expected a dict of fields")
        if result.setdefault("key", key) != key:
            raise ShardError(f"{where}: item {key!r}: forward returned a result for key {result['key']!r}")
        if reduce_state is not None:
            state = reduce_state(state, result, **env)
        if collect:
            results.append(result)
        elif custom_write:
            runner_cls.write_record(writers, result, state, **env)
        else:
            writers.write(result)

    bar = ProgressLog(len(keys), f"shard {shard_id}") if progress else None
    seconds = 0.0 if report_seconds else None
    size = 1
    current = None
    next_key, next_batch = 0, 0

    def consume(chunk: list[str], out) -> None:
        """One call's results (a planned batch, or a slice of single keys): written, reduced, counted."""
        nonlocal seconds, current
        if batches is not None and (not isinstance(out, (list, tuple)) or len(out) != len(chunk)):
            got = len(out) if isinstance(out, (list, tuple)) else type(out).__name__
            raise ShardError(f"{where}: batch {chunk[0]!r}..{chunk[-1]!r}: forward returned {got} "
                             f"results for {len(chunk)} keys")
        current = chunk if batches is not None else chunk[0]
        # write_many declines (returns False) anything unusual; per-item handling then
        # writes it or raises the precise error.
        if write_many is None or not write_many(chunk, out):
            for key, result in zip(chunk, out):
                handle(result, key)
        if seconds is not None:
            seconds += sum(_lengths(runner_cls, env, chunk, where))
        if bar is not None:
            bar.update(len(chunk), seconds)

    try:
        if pool is not None:  # forward in the pool's workers; results consumed here, as they come
            from snakeshard.pool import PoolError

            pool.cfg.consume = lambda unit, out: consume(unit, out) if batches is not None else consume([unit], [out])
            units = ([keys[j] for j in batch] for batch in batches) if batches is not None else iter(keys)
            try:
                pool(units)
            except PoolError as e:
                if e.worker_traceback:  # to the log, above the job's one error line
                    print(e.worker_traceback, end="", file=sys.stderr, flush=True)
                raise ShardError(f"{where}: {e.line}") from None
        while pool is None and next_key < len(keys):  # without a pool: forward runs here
            t0 = time.perf_counter()
            if batches is not None:  # one call per planned batch
                chunk = current = [keys[j] for j in batches[next_batch]]
                next_batch += 1
                out = call(chunk)
            else:  # one call per key, over a slice of keys
                chunk = keys[next_key:next_key + size]
                out = []
                current = chunk[0]
                # list.extend keeps what map produced before an exception, so the failing key is chunk[len(out)]
                try:
                    out.extend(map(call, chunk))
                except Exception:
                    current = chunk[len(out)]
                    raise
            next_key += len(chunk)
            consume(chunk, out)
            if write_many is not None and batches is None:  # custom hooks keep forward/write interleaved
                elapsed = time.perf_counter() - t0
                if elapsed < FAST_SLICE_S:
                    size = min(size * 2, MAX_SLICE)
                elif elapsed > SLOW_SLICE_S:
                    size = max(size // 2, 1)
    except ShardError:
        raise
    except SnakeshardError as e:  # snakeshard's own message already names the item
        raise ShardError(f"{where}: {e}{_other_bad_audio(e, env, keys)}") from None
    except Exception as e:  # the user's code: keep its traceback (printed to the log by the CLI)
        if isinstance(current, list):
            what = f"batch {current[0]!r}..{current[-1]!r} ({len(current)} keys)"
        else:
            what = f"item {current!r}"
        # a write that failed (disk full) names no file: say where this shard writes
        place = f" (shard dir {shard_dir})" if isinstance(e, OSError) and not e.filename and not collect else ""
        raise ShardError(f"{where}: {what} failed: {type(e).__name__}: {e}{place}") from e
    finally:
        if bar is not None:
            bar.close()

    if collect:  # nothing is written in-process without an output dir, finalize_state included
        if sort_by_length:
            position = {k: n for n, k in enumerate(keys)}
            results.sort(key=lambda r: position[r["key"]])
        return results
    try:
        fragments = _index_fragments(runner_cls, writers, runner_cls.close_writers(writers, state, **env), shard_dir)
        state_files = _durable_state_files(shard_dir, runner_cls.finalize_state(state, hook_dir, **env) or [])
    except SnakeshardError as e:
        raise ShardError(f"{where}: {e}") from None
    except OSError as e:
        raise ShardError(f"{where}: writing its results failed: {e.strerror}: {e.filename or shard_dir}") from e
    done = {
        "shard": shard_id,
        "items": len(keys),
        "keys_digest": keys_digest or digest_keys(keys),
        "fingerprint": fingerprint,
        "inputs": inputs,
        "fragments": list(fragments),
        "fields": writers.fields if isinstance(writers, FieldWriters) else None,  # what the merge checks
        "state_files": state_files,  # finalize_state's files, checked the same way
        "seconds": None if seconds is None else round(seconds, 3),
        "start": round(started, 3),
        "end": round(time.time(), 3),
        "host": os.uname().nodename,  # what socket.gethostname() returns, without importing socket
        "shard_dir": os.path.abspath(shard_dir),  # its scp files point here: a moved project is told (merge.py)
        "snakeshard": __version__,
    }
    with open(os.path.join(shard_dir, ATTEMPT_FILE)) as f:
        owner = f.read()
    if owner != token:
        raise ShardError(f"{where}: another attempt took over {shard_dir} while this one ran; not writing done")
    # Durable before it exists: fragments were fsynced by close_writers, done is fsynced before its
    # rename and the directory after it, so after a power loss done is either absent or complete.
    atomic_write_json(os.path.join(shard_dir, "done"), done, fsync=True)
    return done


def _other_bad_audio(error: SnakeshardError, env: dict, keys: list[str]) -> str:
    """After one key's audio failed: the shard's other keys whose audio headers fail the same checks, named in
    the same line, so that a shard of 1,000 keys with three bad files fails once rather than three runs in a row.
    Headers only (no decoding, no pipes run), and only on failure."""
    dataset = env.get("dataset")
    if not isinstance(error, AudioError) or not hasattr(dataset, "check_audio_headers"):
        return ""
    bad, unchecked = dataset.check_audio_headers(k for k in keys if k != error.key)
    if not bad:
        return ""
    shown = "; ".join(str(e) for e in bad[:MAX_LISTED])
    more = f"; and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else ""
    pipes = f" ({unchecked} Kaldi pipes not run)" if unchecked else ""
    return f"; {len(bad)} other key(s) of this shard fail too, from their headers{pipes}: {shown}{more}"
