"""Merging shards: validate every ``done``, then concatenate fragments in plan order.

Nothing is merged unless every planned shard is done with the expected
fingerprint, item count and keys digest. Each per-key fragment must hold every
key of its shard exactly once. Outputs are written by rename, and
``merged.json`` last, so a crashed merge never looks complete.

``merged.json`` records the inputs it was made from (every shard's fingerprint).
Once the data, config or code change, the old merged files stay on disk until a
rerun replaces them, but they are stale: ``require_current`` refuses them, and
everything in snakeshard that reads a merged output goes through it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from snakeshard.atomic import atomic_write_json, atomic_write_text
from snakeshard.errors import MergeError, SnakeshardError
from snakeshard.plan import read_shard_keys

MAX_LISTED = 5
_ARK_OFFSET = re.compile(r":\d+(\[[^\]]*\])?$")  # kaldiio's "file.ark:123" (optionally "[0:10]")


class UnreadableDone(SnakeshardError):
    """A ``done`` file exists but is not a done record (cut short by a crash or power loss)."""


class StaleMergedOutput(SnakeshardError):
    """A merged output that was made from other inputs than the current plan's."""


def rerun_command(done_path) -> str:
    """The command that recomputes one shard whatever state its ``done`` is in (and then merges again)."""
    return f"snakemake --profile <your profile> --forcerun {done_path}"


def read_done(shard_dir: Path) -> dict | None:
    """The shard's done record; None if there is none; ``UnreadableDone`` naming the shard and the fix."""
    path = Path(shard_dir) / "done"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        done = json.loads(raw)
        if not isinstance(done, dict):
            raise ValueError(f"a JSON {type(done).__name__}, not an object")
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        what = "empty (0 bytes)" if not raw else f"not a done record ({e})"
        raise UnreadableDone(f"{path} is {what}: a write cut short by a crash or power loss. "
                             f"Rerun the shard: {rerun_command(path)}") from None
    return done


def check_shards(set_dir: Path, plan: dict, shard_fps: list[str]) -> list[Path]:
    """The planned shard dirs, after checking each ``done`` against the plan and its expected fingerprint."""
    shard_dirs = []
    problems = []
    for shard, expected_fp in zip(plan["shards"], shard_fps):
        shard_dir = set_dir / f"split.{shard['shard']}"
        shard_dirs.append(shard_dir)
        try:
            done = read_done(shard_dir)
        except UnreadableDone as e:
            problems.append(f"shard {shard['shard']}: {e}")
            continue
        if done is None:
            problems.append(f"shard {shard['shard']} is not done ({shard_dir}/done missing)")
        elif done.get("fingerprint") != expected_fp:
            problems.append(
                f"shard {shard['shard']} was computed with fingerprint {done.get('fingerprint')}, "
                f"expected {expected_fp} (its data, config, model or code changed since): rerun it"
            )
        elif done.get("items") != shard["items"] or done.get("keys_digest") != shard["keys_digest"]:
            problems.append(f"shard {shard['shard']}: done records {done.get('items')} items / keys "
                            f"{done.get('keys_digest')}, plan has {shard['items']} / {shard['keys_digest']}")
    if problems:
        raise MergeError(f"refusing to merge {set_dir}: " + "; ".join(problems[:MAX_LISTED]))
    return shard_dirs


def _check_fragment_keys(lines: list[str], keys: list[str], where: str) -> None:
    got = [line.split(" ", 1)[0] for line in lines]
    if got == keys:
        return
    seen = set()
    dupes = [k for k in got if k in seen or seen.add(k)]
    if dupes:
        raise MergeError(f"{where}: duplicate key(s) {dupes[:MAX_LISTED]}")
    planned = set(keys)
    unexpected = [k for k in got if k not in planned]
    if unexpected:
        raise MergeError(f"{where}: line(s) with unplanned key(s) {unexpected[:MAX_LISTED]} "
                         "(a value with a newline splits into such lines)")
    missing = [k for k in keys if k not in seen]
    if missing:
        raise MergeError(f"{where}: missing key(s) {missing[:MAX_LISTED]} of {len(missing)}")
    # same keys, another order (e.g. an unordered device pool): accepted, order kept as written


def _absolute_scp(lines: list[str], where: str) -> str:
    """``lines`` of an scp fragment with every path made absolute, after checking it exists.

    Merged scp files are read from anywhere (a training recipe's own directory, another
    stage, kaldiio.load_scp in a notebook), so their paths are absolute, as in Kaldi's and
    ESPnet's dump directories. Relative paths in fragments are taken from the working
    directory, where the shard jobs ran. Pipes (``cmd |``) are left as they are.
    """
    out = []
    for line in lines:
        key, _, value = line.partition(" ")
        if value.endswith("|"):
            out.append(line)
            continue
        suffix = _ARK_OFFSET.search(value)
        path = value[:suffix.start()] if suffix else value
        if not os.path.exists(path):
            raise MergeError(f"{where}: key {key!r} points at {path}, which does not exist "
                             f"(relative scp paths are taken from the working directory {os.getcwd()})")
        out.append(f"{key} {os.path.abspath(path)}{suffix.group(0) if suffix else ''}")
    return "".join(line + "\n" for line in out)


def merge_fragments(shard_dirs: list[Path], output_dir: Path) -> list[str]:
    """Concatenate each per-key fragment named in the shards' ``done`` files, in shard order."""
    dones = [read_done(d) for d in shard_dirs]
    names: list[str] = []
    for done in dones:
        for name in done.get("fragments", []):
            if name not in names:
                names.append(name)
    shard_keys = [read_shard_keys(d) for d in shard_dirs]
    for name in names:
        parts = []
        for shard_dir, keys in zip(shard_dirs, shard_keys):
            where = f"{shard_dir}/{name}"
            try:
                text = (shard_dir / name).read_text(encoding="utf-8")
            except FileNotFoundError:
                raise MergeError(f"{where}: fragment missing (other shards wrote {name!r})") from None
            lines = text.split("\n")
            if lines[-1] != "":
                raise MergeError(f"{where}: last line is not newline-terminated (truncated write?)")
            lines.pop()
            _check_fragment_keys(lines, keys, where)
            parts.append(_absolute_scp(lines, where) if name.endswith(".scp") else text)
        atomic_write_text(Path(output_dir) / name, "".join(parts))
    return names


def merge_set(set_dir: Path, plan: dict, fingerprints: dict, runner_cls) -> dict:
    """Validate all shards of one stage/dataset, let the runner merge them, record ``merged.json``.

    ``fingerprints`` is what the parse computed (workflow.FINGERPRINTS_FILE): the stage fingerprint,
    each shard's expected one, and their digest, which merged.json records as its inputs.
    """
    set_dir = Path(set_dir)
    # A merge run by hand (outside Snakemake, which deletes outputs first) must not leave an old
    # merged.json claiming completeness over files this merge may fail halfway through rewriting.
    (set_dir / "merged.json").unlink(missing_ok=True)
    shard_fps = [entry["fingerprint"] for entry in fingerprints["shards"]]
    if len(shard_fps) != plan["num_shards"]:
        raise MergeError(f"refusing to merge {set_dir}: {len(shard_fps)} shard fingerprints for "
                         f"{plan['num_shards']} planned shards (plan and fingerprints out of step: rerun snakemake)")
    shard_dirs = check_shards(set_dir, plan, shard_fps)
    files = runner_cls.merge(shard_dirs, set_dir) or []
    record = {"items": plan["num_items"], "shards": plan["num_shards"], "fingerprint": fingerprints["stage"],
              "inputs": fingerprints["inputs"], "files": list(files)}
    atomic_write_json(set_dir / "merged.json", record)
    return record


def merged_record(set_dir) -> dict | None:
    try:
        return json.loads(Path(set_dir, "merged.json").read_text())
    except FileNotFoundError:
        return None
    except ValueError:  # cut short: treat as not merged, the next run merges again
        return None


def require_current(set_dir, inputs: str) -> dict:
    """``set_dir``'s merged.json if it was made from ``inputs`` (the current plan's digest); else an error
    saying the merged files there are missing or stale. Every reader of merged output calls this first."""
    record = merged_record(set_dir)
    if record is None:
        raise StaleMergedOutput(f"{set_dir} is not merged (no merged.json): run snakemake first")
    if record.get("inputs") != inputs:
        raise StaleMergedOutput(
            f"{set_dir}: the merged output is stale: it was made from other inputs than the current plan "
            "(data, config or code changed, and the rerun has not merged yet; `snakeshard status` shows "
            "which shards are not done): refusing to read it")
    return record
