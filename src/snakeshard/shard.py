"""One shard's work: build nothing, just run the runner over keys and write ``done`` last.

The same function serves a Snakemake shard job (``snakeshard run-shard``) and the
in-process call ``MyRunner(provider, output_dir=...)(keys)``.

Crash safety: the shard dir is emptied (all but ``keys``) at start, so nothing
from a killed attempt survives into this one; ``done`` is written last, by
rename, and only if this attempt still owns the directory (a driver killed with
-9 can leave an orphaned old attempt running next to a retry).
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path

from snakeshard import __version__
from snakeshard.atomic import atomic_write_json
from snakeshard.contract import injected_kwargs, overrides
from snakeshard.errors import ShardError, SnakeshardError
from snakeshard.fingerprint import keys_digest

ATTEMPT_FILE = ".attempt"
KEEP_ON_CLEAR = {"keys"}


def clear_shard_dir(shard_dir: Path) -> str:
    """Remove every entry but ``keys``, then claim the dir for this attempt; returns the attempt token."""
    shard_dir.mkdir(parents=True, exist_ok=True)
    for entry in os.scandir(shard_dir):
        if entry.name in KEEP_ON_CLEAR:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
    token = uuid.uuid4().hex
    (shard_dir / ATTEMPT_FILE).write_text(token)
    return token


def _batches(keys: list[str], batch_size: int):
    for i in range(0, len(keys), batch_size):
        yield keys[i:i + batch_size]


def _progress(keys, enabled: bool, desc: str):
    if not enabled:
        return keys
    from tqdm import tqdm

    # Logs are files, not terminals: a redraw every 10 s keeps them readable.
    interval = 0.1 if sys.stderr.isatty() else 10.0
    return tqdm(keys, desc=desc, mininterval=interval, file=sys.stderr, unit="item")


def run_shard(runner_cls, env: dict, keys: list[str], shard_dir, *, shard_id: int = 0,
              fingerprint: str | None = None, log_path: str | None = None,
              batch_size: int | None = None, progress: bool = True):
    """Run ``runner_cls`` over ``keys``; write fragments and ``done`` into ``shard_dir``.

    With ``shard_dir=None`` nothing is written and the list of results is returned.
    Otherwise returns the ``done`` record.
    """
    where = f"shard {shard_id}" + (f" (log: {log_path})" if log_path else "")
    kwargs = injected_kwargs(runner_cls, env)
    forward = runner_cls.forward
    collect = shard_dir is None
    started = time.time()
    if not collect:
        shard_dir = Path(shard_dir)
        token = clear_shard_dir(shard_dir)

    state = runner_cls.init_state(**env)
    writers = None if collect else runner_cls.open_writers(shard_dir, **env)
    reduce_state = runner_cls.reduce_state if overrides(runner_cls, "reduce_state") else None
    custom_write = overrides(runner_cls, "write_record")
    write = None if collect or custom_write else writers.write
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
        elif write is not None:
            write(result)
        else:
            runner_cls.write_record(writers, result, state, **env)

    current = None
    try:
        if not batch_size:
            for current in _progress(keys, progress, f"shard {shard_id}"):
                handle(forward(current, **kwargs), current)
        else:
            bar = _progress(keys, progress, f"shard {shard_id}")
            for current in _batches(keys, batch_size):
                out = forward(current, **kwargs)
                if not isinstance(out, (list, tuple)) or len(out) != len(current):
                    got = len(out) if isinstance(out, (list, tuple)) else type(out).__name__
                    raise ShardError(f"{where}: batch {current[0]!r}..{current[-1]!r}: forward returned {got} "
                                     f"results for {len(current)} keys")
                for key, result in zip(current, out):
                    handle(result, key)
                if progress:
                    bar.update(len(current))
    except ShardError:
        raise
    except SnakeshardError as e:  # snakeshard's own message already names the item
        raise ShardError(f"{where}: {e}") from None
    except Exception as e:  # the user's code: keep its traceback (printed to the log by the CLI)
        what = f"item {current!r}" if not isinstance(current, list) else f"batch {current!r}"
        raise ShardError(f"{where}: {what} failed: {type(e).__name__}: {e}") from e

    if collect:  # nothing is written in-process without an output dir, finalize_state included
        return results
    fragments = runner_cls.close_writers(writers, state, **env) or []
    runner_cls.finalize_state(state, shard_dir, **env)
    done = {
        "shard": shard_id,
        "items": len(keys),
        "keys_digest": keys_digest(keys),
        "fingerprint": fingerprint,
        "fragments": list(fragments),
        "start": round(started, 3),
        "end": round(time.time(), 3),
        "host": socket.gethostname(),
        "snakeshard": __version__,
    }
    if (shard_dir / ATTEMPT_FILE).read_text() != token:
        raise ShardError(f"{where}: another attempt took over {shard_dir} while this one ran; not writing done")
    atomic_write_json(shard_dir / "done", done)
    return done
